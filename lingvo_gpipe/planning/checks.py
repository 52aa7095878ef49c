"""Argument checks shared by planning, the engine and the layer.

Pure Python. Every check raises ValueError naming the parameter, its value and
what would be valid, so that errors read the same wherever they come from.

    >>> CheckPositiveInt('num_micro_batches', 8)
    >>> CheckPositiveInt('num_micro_batches', 0)
    Traceback (most recent call last):
    ValueError: num_micro_batches=0 must be a positive int.
    >>> PositiveInts('num_stages', '2,4,8')
    [2, 4, 8]
"""

from typing import List, Sequence, Union


def CheckPositiveInt(name: str, value: int) -> None:
  """Raises ValueError naming `name` unless `value` is an int >= 1."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f'{name}={value!r} must be a positive int.')



def CheckBatchDim(batch_dim: int) -> None:
  """Raises ValueError unless `batch_dim` is an int >= 0."""
  if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or (
      batch_dim < 0):
    raise ValueError(f'batch_dim={batch_dim!r} must be an int >= 0.')


def PositiveInts(name: str, values: Union[str, Sequence[str]]) -> List[int]:
  """Parses a comma-separated list (or a list of strings) of positive ints.

  Args:
    name: The parameter or flag name, for the error message.
    values: '2,4,8' or ['2', '4', '8'].

  Returns:
    The ints, in order.

  Raises:
    ValueError: if the list is empty or an entry is not a positive int.
  """
  items = values.split(',') if isinstance(values, str) else list(values)
  if not items:
    raise ValueError(f'{name} is empty; give comma-separated positive ints, '
                     'e.g. 2,4,8.')
  numbers = []
  for item in items:
    text = str(item).strip()
    if not text.isdigit() or int(text) < 1:
      raise ValueError(f'{name}={",".join(str(i) for i in items)}: {item!r} '
                       'is not a positive int.')
    numbers.append(int(text))
  return numbers
