"""Parameter counts and variable bytes of cells, the same for every front end.

Pure Python, no TensorFlow. The 'params' partition balances each cell's
trainable parameters, and `partition.PartitionCosts(memory=...)` its
variables' bytes. The front ends hand over each cell's variables (Lingvo's
`cell.vars.Flatten()` in `lingvo_gpipe.costs`, a Keras layer's `variables`
in `lingvo_gpipe.keras.costs`): anything with a `shape` (ints), a `dtype`
and a `trainable` flag, which TensorFlow and Keras variables both have
(their `dtype_size` is `lambda dtype: dtype.size`). A dense cell and a batch
norm's scale and moving mean:

    >>> from types import SimpleNamespace as Var
    >>> dense = [Var(shape=(64, 32), dtype='float32', trainable=True),
    ...          Var(shape=(32,), dtype='float32', trainable=True)]
    >>> norm = [Var(shape=(32,), dtype='float32', trainable=True),
    ...         Var(shape=(32,), dtype='float32', trainable=False)]
    >>> ParamCounts([dense, norm])
    [2080.0, 32.0]
    >>> VariableBytes([dense, norm], dtype_size={'float32': 4}.get)
    [8320.0, 256.0]
"""

import math
from typing import Any, Callable, Iterable, List, Sequence


def _Elements(variable: Any) -> int:
  return math.prod(int(d) for d in variable.shape)


def ParamCounts(cell_variables: Sequence[Iterable[Any]]) -> List[float]:
  """Per cell, the number of its trainable parameters (may be zero).

  Args:
    cell_variables: Per cell, its variables.

  Returns:
    One float per cell.
  """
  return [float(sum(_Elements(v) for v in variables if v.trainable))
          for variables in cell_variables]


def VariableBytes(cell_variables: Sequence[Iterable[Any]],
                  dtype_size: Callable[[Any], int]) -> List[float]:
  """Per cell, the bytes of its variables, trainable or not.

  Args:
    cell_variables: Per cell, its variables.
    dtype_size: The bytes of one element of a variable's `dtype`.

  Returns:
    One float per cell.
  """
  return [float(sum(_Elements(v) * dtype_size(v.dtype) for v in variables))
          for variables in cell_variables]
