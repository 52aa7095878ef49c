"""How expensive each Lingvo cell is, to choose the pipeline partition.

The costs of partition='params' | 'flops' | 'profile': trainable parameter
counts, Lingvo's `FPropMeta` flop estimates, or each cell's forward and
backward pass timed on a sample micro-batch:

    >>> from lingvo.core import layers
    >>> from lingvo_gpipe.planning import partition
    >>> dims = [8, 8, 32, 32, 8]
    >>> cells = [layers.FCLayer.Params().Set(
    ...     name=f'fc{i}', input_dim=dims[i], output_dim=dims[i + 1])
    ...          .Instantiate() for i in range(4)]
    >>> CellCosts(cells, 'params')
    [72.0, 288.0, 1056.0, 264.0]
    >>> costs = CellCosts(cells, 'flops', input_shapes=([4, 8],))
    >>> costs
    [552.0, 2208.0, 8352.0, 2088.0]
    >>> partition.PartitionCosts(costs, 2, memory=CellMemory(cells))
    [2, 2]

A timed cost is the median of its timed runs (`planning.timing`, the rule
the Keras layer's 'profile' follows too): the partition balances the cells'
typical times, which one slow or one lucky run does not move.
`planning.report.PartitionReport` prints the chosen stages next to Lingvo's
heuristic. What `plan.py auto` measures of each cell is another job, with
another statistic: `lingvo_gpipe.profiling`.
"""

from typing import Any, List, Sequence

from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np

from lingvo_gpipe.planning import config
from lingvo_gpipe.planning import sizes
from lingvo_gpipe.planning import timing

METHODS = config.COST_PARTITIONS

# Timing repetitions of the 'profile' method (shared with the Keras layer).
PROFILE_WARMUP_RUNS = timing.PROFILE_WARMUP_RUNS
PROFILE_TIMED_RUNS = timing.PROFILE_TIMED_RUNS


def _Describe(cell: base_layer.BaseLayer) -> str:
  return f"cell '{cell.params.name}' ({type(cell).__name__})"


def _IsSingleShape(value: Any) -> bool:
  """Whether `value` is one shape (not a sequence of shapes)."""
  if isinstance(value, (tshape.Shape, tf.TensorShape)):
    return True
  return isinstance(value, (list, tuple)) and all(
      d is None or isinstance(d, (int, np.integer, str)) for d in value)


def _ToTShape(shape: Any) -> tshape.Shape:
  """A tshape.Shape from a tshape.Shape, TensorShape, list or tuple."""
  if isinstance(shape, tshape.Shape):
    return shape
  if isinstance(shape, tf.TensorShape):
    if shape.rank is None:
      raise ValueError(f'input_shapes has a shape of unknown rank ({shape}); '
                       'give every dimension.')
    shape = shape.as_list()
  dims = list(shape)
  if any(d is None for d in dims):
    raise ValueError(f'input_shapes has a shape with unknown dimensions '
                     f'{dims}; give every dimension (e.g. the micro-batch '
                     'size for the batch dimension).')
  return tshape.Shape([int(d) if isinstance(d, np.integer) else d
                       for d in dims])


def _InputShapes(input_shapes: Any) -> tuple:
  """The first cell's input shapes as a tuple of tshape.Shape (None kept)."""
  if _IsSingleShape(input_shapes):
    input_shapes = (input_shapes,)
  return tuple(None if s is None else _ToTShape(s) for s in input_shapes)


def AsTuple(values: Any) -> tuple:
  """A cell's inputs or outputs as a tuple: a list or tuple, else (values,)."""
  return tuple(values) if isinstance(values, (list, tuple)) else (values,)


def CheckCells(cells: Sequence[base_layer.BaseLayer]) -> None:
  """Raises ValueError unless `cells` is a non-empty list of Lingvo layers."""
  if not cells or not all(isinstance(c, base_layer.BaseLayer) for c in cells):
    raise ValueError(f'cells={cells!r} must be a non-empty list of '
                     'instantiated Lingvo layers (BaseLayer).')


def ParamCounts(cells: Sequence[base_layer.BaseLayer]) -> List[float]:
  """The number of trainable parameters of each cell (may be zero).

  Args:
    cells: Instantiated Lingvo layers, in order.

  Returns:
    One float per cell.
  """
  CheckCells(cells)
  return sizes.ParamCounts([c.vars.Flatten() for c in cells])


def CellMemory(cells: Sequence[base_layer.BaseLayer]) -> List[float]:
  """Bytes of the variables of each cell, trainable or not.

  Usable as the `memory` argument of `partition.PartitionCosts`. Activations
  and optimizer slots are not counted.

  Args:
    cells: Instantiated Lingvo layers, in order.

  Returns:
    One float per cell.
  """
  CheckCells(cells)
  return sizes.VariableBytes([c.vars.Flatten() for c in cells],
                             dtype_size=lambda dtype: dtype.size)


def FlopCounts(cells: Sequence[base_layer.BaseLayer],
               input_shapes: Any) -> List[float]:
  """Lingvo's `FPropMeta` flop estimate of each cell, chained cell to cell.

  Args:
    cells: Instantiated Lingvo layers, in order; every class must implement
      `FPropMeta`.
    input_shapes: The first cell's input shapes: one shape or a tuple of them,
      each a `tshape.Shape`, `tf.TensorShape`, list or tuple of dimensions.

  Returns:
    One float per cell: `FPropMeta(...).flops`.

  Raises:
    ValueError: if a cell does not define `FPropMeta`, rejects the shapes it
      receives, or returns flops that are not a number.
  """
  CheckCells(cells)
  shapes = _InputShapes(input_shapes)
  flops = []
  for cell in cells:
    try:
      meta = cell.params.cls.FPropMeta(cell.params, *shapes)
    except NotImplementedError as e:
      raise ValueError(
          f"partition='flops': {_Describe(cell)} does not define FPropMeta "
          f"({e}); use partition='params' or 'profile' or an explicit list."
      ) from e
    except (AssertionError, TypeError, ValueError) as e:
      shown = ', '.join(str(s) for s in shapes)
      raise ValueError(
          f"partition='flops': {_Describe(cell)} rejects input shapes "
          f'({shown}) in FPropMeta ({type(e).__name__}: {e}); check '
          'input_shapes and the cell dimensions.') from e
    try:
      flops.append(float(meta.flops))
    except TypeError as e:
      raise ValueError(
          f"partition='flops': {_Describe(cell)} reports flops="
          f'{meta.flops!r}, not a number; give input_shapes with integer '
          'dimensions.') from e
    shapes = AsTuple(meta.out_shapes)
  return flops


def _SquaredSum(outputs: Sequence[Any]):
  """Sum of squares of the float outputs, or None if there are none."""
  terms = [
      tf.reduce_sum(tf.square(tf.cast(y, tf.float32))) for y in outputs
      if y is not None and y.dtype.is_floating
  ]
  return tf.add_n(terms) if terms else None


def RunTargets(tensors: Sequence[Any]) -> List[Any]:
  """The ops of `tensors`, to run them without fetching their values.

  Not `tf.group(tensors)`: grappler prunes side-effect-free ops that only a
  NoOp's control inputs need, and the session would run nothing. Fed
  placeholders (an input passed through) are no work and are left out.
  `lingvo_gpipe.profiling` runs its steps the same way.
  """
  return [t.op for t in tensors if t.op.type != 'Placeholder']


def FedCell(cell: base_layer.BaseLayer, inputs: Any):
  """A copy of `cell` in the current graph, with placeholders for `inputs`.

  What a timed or profiled (`lingvo_gpipe.profiling`) cell runs in.

  Args:
    cell: An instantiated Lingvo layer; the copy is built from its params.
    inputs: Its FProp inputs: numpy arrays, None or nests of them.

  Returns:
    (layer, placeholders, args, feed): the copy; one placeholder per flat
    input (None where the input is None); the FProp arguments in the inputs'
    structure; the feed dict of the inputs.
  """
  py_utils.GetOrCreateGlobalStepVar()
  layer = cell.params.Copy().Instantiate()
  flat_inputs = tf.nest.flatten(inputs)
  placeholders = [
      None if x is None else tf.compat.v1.placeholder(
          tf.as_dtype(np.asarray(x).dtype), np.shape(x)) for x in flat_inputs
  ]
  feed = {p: x for p, x in zip(placeholders, flat_inputs) if p is not None}
  return layer, placeholders, tf.nest.pack_sequence_as(inputs,
                                                       placeholders), feed


def _TimeCell(cell: base_layer.BaseLayer, inputs: tuple, num_warmup: int,
              num_runs: int):
  """Times one cell's FProp + gradients in a fresh graph.

  Args:
    cell: An instantiated Lingvo layer; a copy of it is built from its params.
    inputs: The cell's FProp inputs: numpy arrays, None or nests of them.
    num_warmup: Untimed runs first.
    num_runs: Timed runs; their median is returned.

  Returns:
    (median seconds, the cell's outputs as numpy, in FProp's structure).
  """
  graph = tf.Graph()
  with graph.as_default():
    layer, placeholders, args, feed = FedCell(cell, inputs)
    outputs = layer.FProp(layer.theta, *args)
    flat_outputs = tf.nest.flatten(outputs)
    fetched = [y for y in flat_outputs if y is not None]
    loss = _SquaredSum(fetched)
    work = list(fetched)
    if loss is not None:
      wrt = layer.vars.Flatten() + [
          p for p in placeholders if p is not None and p.dtype.is_floating
      ]
      work += [g for g in tf.gradients(loss, wrt) if g is not None]
    step = RunTargets(work)
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      values = iter(sess.run(fetched, feed_dict=feed))
      seconds = timing.MedianSeconds(
          lambda: sess.run(step, feed_dict=feed), num_warmup, num_runs)
  numpy_outputs = [None if y is None else next(values) for y in flat_outputs]
  return seconds, tf.nest.pack_sequence_as(outputs, numpy_outputs)


def ProfileTimes(cells: Sequence[base_layer.BaseLayer],
                 sample_inputs: Any,
                 num_warmup: int = PROFILE_WARMUP_RUNS,
                 num_runs: int = PROFILE_TIMED_RUNS) -> List[float]:
  """Measured forward + backward seconds of each cell on a sample micro-batch.

  Each cell is rebuilt from its params in its own TF1 graph and session
  (fresh variables, same shapes), its FProp and the gradients of the sum of
  its squared outputs run `num_warmup` times untimed and then `num_runs` times
  timed; the median is the cost. Cell i + 1 receives cell i's outputs.

  Args:
    cells: Instantiated Lingvo layers, in order.
    sample_inputs: The first cell's FProp inputs: a numpy array or a tuple of
      them (None or NestedMaps allowed), e.g. one micro-batch.
    num_warmup: Untimed runs per cell.
    num_runs: Timed runs per cell (>= 1).

  Returns:
    One positive float (seconds) per cell.

  Raises:
    ValueError: if num_runs < 1 or num_warmup < 0.
  """
  CheckCells(cells)
  timing.CheckRuns(num_warmup, num_runs)
  inputs = AsTuple(sample_inputs)
  times = []
  for cell in cells:
    seconds, outputs = _TimeCell(cell, inputs, num_warmup, num_runs)
    times.append(seconds)
    inputs = AsTuple(outputs)
  return times


def _SampleFromShapes(input_shapes: Any) -> tuple:
  """float32 zeros of the given (fully defined) shapes.

  Zeros are valid for vectors, paddings and masks alike (Lingvo asserts that
  paddings are 0 or 1), and dense kernels take the same time on any values.
  """
  shapes = _InputShapes(input_shapes)
  dims = [None if s is None else s.ToTensorShape() for s in shapes]
  for d in dims:
    if d is not None and not d.is_fully_defined():
      raise ValueError(f"partition='profile' needs numeric input_shapes to "
                       f'make sample inputs; got {d}. Give sample_inputs.')
  return tuple(None if d is None else np.zeros(d.as_list(), np.float32)
               for d in dims)


def _ShapesFromSample(sample_inputs: Any) -> tuple:
  return tuple(None if x is None else list(np.shape(x))
               for x in AsTuple(sample_inputs))


def CellCosts(cells: Sequence[base_layer.BaseLayer],
              method: str,
              input_shapes: Any = None,
              sample_inputs: Any = None) -> List[float]:
  """The cost of each cell, by one of `METHODS`.

  Args:
    cells: Instantiated Lingvo layers, in order; the outputs of cell i are the
      inputs of cell i + 1.
    method: 'params' (trainable parameter count), 'flops' (Lingvo's
      `FPropMeta` estimate, needs `input_shapes` or `sample_inputs`) or
      'profile' (measured forward + backward seconds, needs `sample_inputs` or
      numeric `input_shapes`, from which float32 zeros are made).
    input_shapes: The first cell's input shapes, see `FlopCounts`.
    sample_inputs: The first cell's inputs as numpy arrays, see `ProfileTimes`.

  Returns:
    One non-negative float per cell.

  Raises:
    ValueError: on an unknown method, missing shapes or inputs, or a cell
      that the method cannot handle (e.g. no `FPropMeta` for 'flops').
  """
  if method not in METHODS:
    raise ValueError(f'method={method!r} is not a cost method; use one of '
                     f'{list(METHODS)}.')
  if method == 'params':
    return ParamCounts(cells)
  if input_shapes is None and sample_inputs is None:
    raise ValueError(
        f"partition={method!r} needs the first cell's input_shapes or "
        "sample_inputs; give one, or use partition='params'.")
  if method == 'flops':
    if input_shapes is None:
      input_shapes = _ShapesFromSample(sample_inputs)
    return FlopCounts(cells, input_shapes)
  if sample_inputs is None:
    sample_inputs = _SampleFromShapes(input_shapes)
  return ProfileTimes(cells, sample_inputs)
