"""Splitting a mini-batch into micro-batches and merging them back.

Inputs are flat sequences whose entries are tensors or None (None stays None in
every micro-batch). Everything is split along one batch dimension.

    >>> MicroBatchSize(batch_size=8, num_micro_batches=4)
    2
    >>> x = tf.reshape(tf.range(16.0), [8, 2])
    >>> parts = Split([x, None], num_micro_batches=4, batch_dim=0)
    >>> len(parts), parts[1][0].numpy().tolist(), parts[1][1]
    (4, [[4.0, 5.0], [6.0, 7.0]], None)
    >>> x_again, none = Merge(parts, batch_dim=0)
    >>> bool(tf.reduce_all(x_again == x)), none
    (True, None)
"""

from typing import Any, List, Optional, Sequence

import tensorflow as tf

from lingvo_gpipe.planning import config

MaybeTensor = Optional[tf.Tensor]


def MicroBatchSize(batch_size: int, num_micro_batches: int) -> int:
  """Checks that a batch splits evenly into M micro-batches.

  Args:
    batch_size: The mini-batch size along the batch dimension.
    num_micro_batches: M.

  Returns:
    The micro-batch size, batch_size // M.

  Raises:
    ValueError: if M is not in [1, batch_size] or does not divide the batch.
  """
  config.CheckSplit(batch_size, num_micro_batches)
  return batch_size // num_micro_batches


def StaticBatchSize(inputs: Sequence[MaybeTensor],
                    batch_dim: int) -> Optional[int]:
  """The common static size of `inputs` along `batch_dim`.

  Args:
    inputs: Tensors or None.
    batch_dim: The batch dimension.

  Returns:
    The batch size, or None if no input has a static size there.

  Raises:
    ValueError: if an input has too few dimensions or the inputs disagree.
  """
  sizes = set()
  for i, x in enumerate(inputs):
    if x is None:
      continue
    shape = x.shape
    if shape.rank is not None:
      if shape.rank <= batch_dim:
        raise ValueError(
            f'batch_dim={batch_dim} but input {i} has shape {shape}; '
            f'batch_dim must be in [0, {shape.rank - 1}] for it.')
      if shape[batch_dim] is not None:
        sizes.add(shape[batch_dim])
  if len(sizes) > 1:
    raise ValueError(f'Inputs disagree on the batch size along batch_dim='
                     f'{batch_dim}: {sorted(sizes)}.')
  return sizes.pop() if sizes else None


def Split(inputs: Sequence[MaybeTensor], num_micro_batches: int,
          batch_dim: int) -> List[List[MaybeTensor]]:
  """Splits every input into M equal micro-batches.

  Args:
    inputs: Tensors or None.
    num_micro_batches: M.
    batch_dim: The dimension to split along.

  Returns:
    M lists, the m-th holding micro-batch m of every input (None stays None).
  """
  if num_micro_batches == 1:
    return [list(inputs)]
  pieces = [
      [None] * num_micro_batches if x is None else tf.split(
          x, num_micro_batches, axis=batch_dim) for x in inputs
  ]
  return [[p[m] for p in pieces] for m in range(num_micro_batches)]


def Merge(micro_batches: Sequence[Sequence[MaybeTensor]],
          batch_dim: int) -> List[MaybeTensor]:
  """Concatenates micro-batch outputs back into mini-batch outputs, in order.

  Args:
    micro_batches: M sequences of outputs with None at the same positions.
    batch_dim: The dimension to concatenate along.

  Returns:
    One list of outputs.
  """
  if len(micro_batches) == 1:
    return list(micro_batches[0])
  merged = []
  for parts in zip(*micro_batches):
    merged.append(None if parts[0] is None else tf.concat(parts, batch_dim))
  return merged


def _Dims(x: tf.Tensor) -> List[Any]:
  """The dimensions of `x`: Python ints where static, scalar tensors else."""
  dynamic = tf.shape(x)
  return [d if d is not None else dynamic[i]
          for i, d in enumerate(x.shape.as_list())]


def Stack(x: tf.Tensor, num_micro_batches: int, batch_dim: int) -> tf.Tensor:
  """Micro-batches of `x` stacked on a new leading dimension of size M.

  Micro-batch m is `Stack(x, M, d)[m]`, the same slice as `Split`'s m-th
  piece, made with one reshape (and a transpose if batch_dim > 0) instead of
  M slices, so the graph does not grow with M.

  Args:
    x: A tensor whose size along `batch_dim` M divides.
    num_micro_batches: M.
    batch_dim: The dimension to split along.

  Returns:
    A tensor of shape [M] + x's shape with the batch dimension divided by M.
  """
  dims = _Dims(x)
  batch = dims[batch_dim]
  micro = (batch // num_micro_batches if isinstance(batch, int) else -1)
  shape = dims[:batch_dim] + [num_micro_batches, micro] + dims[batch_dim + 1:]
  y = tf.reshape(x, tf.stack(shape) if any(
      isinstance(d, tf.Tensor) for d in shape) else shape)
  if batch_dim == 0:
    return y
  rank = len(dims) + 1
  perm = [batch_dim] + list(range(batch_dim)) + list(range(batch_dim + 1,
                                                           rank))
  return tf.transpose(y, perm)


def Unstack(stacked: tf.Tensor, batch_dim: int) -> tf.Tensor:
  """The inverse of `Stack`: [M, ...] back to one tensor, in order.

  Args:
    stacked: Micro-batches on the leading dimension.
    batch_dim: The batch dimension of each micro-batch (and of the result).

  Returns:
    The micro-batches concatenated along `batch_dim`.
  """
  rank = stacked.shape.rank
  if batch_dim > 0:
    perm = list(range(1, batch_dim + 1)) + [0] + list(range(batch_dim + 1,
                                                            rank))
    stacked = tf.transpose(stacked, perm)
  dims = _Dims(stacked)
  merged = (dims[batch_dim] * dims[batch_dim + 1] if all(
      isinstance(d, int) for d in dims[batch_dim:batch_dim + 2]) else -1)
  shape = dims[:batch_dim] + [merged] + dims[batch_dim + 2:]
  return tf.reshape(stacked, tf.stack(shape) if any(
      isinstance(d, tf.Tensor) for d in shape) else shape)
