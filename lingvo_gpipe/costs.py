"""How expensive each Lingvo cell is, to choose the pipeline partition.

Costs come from parameter counts, from Lingvo's `FPropMeta` flop estimates, or
from timing each cell's forward and backward pass on a sample micro-batch:

    costs = CellCosts(cells, 'flops', input_shapes=([64, 512],))
    counts = partition.PartitionCosts(costs, 4, memory=CellMemory(cells))
    logging.info('%s', PartitionReport(costs, counts, names=names))

`PartitionReport` prints the chosen stages next to Lingvo's heuristic
(`gpipe.PartitionSequentialLayers`) so the two can be compared.
"""

import math
import time
from typing import Any, Dict, List, Optional, Sequence

from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np

from lingvo_gpipe import partition as partition_lib

METHODS = ('flops', 'params', 'profile')

# Timing repetitions of the 'profile' method: the first runs warm up caches and
# kernels, the median of the rest is the cell's cost.
PROFILE_WARMUP_RUNS = 2
PROFILE_TIMED_RUNS = 7


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


def _AsTuple(values: Any) -> tuple:
  return tuple(values) if isinstance(values, (list, tuple)) else (values,)


def _CheckCells(cells: Sequence[base_layer.BaseLayer]) -> None:
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
  _CheckCells(cells)
  return [
      float(sum(v.shape.num_elements() for v in c.vars.Flatten()
                if v.trainable)) for c in cells
  ]


def CellMemory(cells: Sequence[base_layer.BaseLayer]) -> List[float]:
  """Bytes of the variables of each cell, trainable or not.

  Usable as the `memory` argument of `partition.PartitionCosts`. Activations
  and optimizer slots are not counted.

  Args:
    cells: Instantiated Lingvo layers, in order.

  Returns:
    One float per cell.
  """
  _CheckCells(cells)
  return [
      float(sum(v.shape.num_elements() * v.dtype.size
                for v in c.vars.Flatten())) for c in cells
  ]


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
  _CheckCells(cells)
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
    shapes = _AsTuple(meta.out_shapes)
  return flops


def _SquaredSum(outputs: Sequence[Any]):
  """Sum of squares of the float outputs, or None if there are none."""
  terms = [
      tf.reduce_sum(tf.square(tf.cast(y, tf.float32))) for y in outputs
      if y is not None and y.dtype.is_floating
  ]
  return tf.add_n(terms) if terms else None


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
    py_utils.GetOrCreateGlobalStepVar()
    layer = cell.params.Copy().Instantiate()
    flat_inputs = tf.nest.flatten(inputs)
    placeholders = [
        None if x is None else tf.compat.v1.placeholder(
            tf.as_dtype(np.asarray(x).dtype), np.shape(x)) for x in flat_inputs
    ]
    feed = {p: x for p, x in zip(placeholders, flat_inputs) if p is not None}
    args = tf.nest.pack_sequence_as(inputs, placeholders)
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
    step = tf.group(work)
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      values = iter(sess.run(fetched, feed_dict=feed))
      for _ in range(num_warmup):
        sess.run(step, feed_dict=feed)
      seconds = []
      for _ in range(num_runs):
        start = time.perf_counter()
        sess.run(step, feed_dict=feed)
        seconds.append(time.perf_counter() - start)
  numpy_outputs = [None if y is None else next(values) for y in flat_outputs]
  return (float(np.median(seconds)),
          tf.nest.pack_sequence_as(outputs, numpy_outputs))


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
  _CheckCells(cells)
  if num_runs < 1 or num_warmup < 0:
    raise ValueError(f'num_runs={num_runs} must be >= 1 and num_warmup='
                     f'{num_warmup} >= 0.')
  inputs = _AsTuple(sample_inputs)
  times = []
  for cell in cells:
    seconds, outputs = _TimeCell(cell, inputs, num_warmup, num_runs)
    times.append(max(seconds, 1e-9))
    inputs = _AsTuple(outputs)
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
               for x in _AsTuple(sample_inputs))


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


def _Number(x: float) -> str:
  return f'{x:.4g}'


def _CellRange(names: Sequence[str], start: int, count: int) -> str:
  if count == 0:
    return '(empty)'
  if count == 1:
    return names[start]
  return f'{names[start]} .. {names[start + count - 1]}'


def _Names(names: Optional[Sequence[str]], num_cells: int) -> List[str]:
  if names is None:
    return [f'cell{i}' for i in range(num_cells)]
  if len(names) != num_cells:
    raise ValueError(f'names has {len(names)} entries ({list(names)}) but '
                     f'there are {num_cells} cells; give one name per cell.')
  return [str(n) for n in names]


def PartitionSummary(costs: Sequence[float],
                     partition: Sequence[int],
                     memory: Optional[Sequence[float]] = None,
                     names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  """The numbers of one partition, as plain Python values (JSON-ready).

  Args:
    costs: One cost per cell.
    partition: Cells per stage; zeros (empty stages) are allowed here so that
      Lingvo's heuristic can be summarized too.
    memory: Optional memory per cell.
    names: Optional cell names (default 'cell0', 'cell1', ...).

  Returns:
    A dict with 'partition', 'cells' (first .. last name per stage, or
    '(empty)'), 'stage_costs', 'stage_shares' (fractions of the total),
    'stage_memory' (None without memory), 'imbalance' (largest stage cost /
    (total / K)) and 'empty_stages'.
  """
  names = _Names(names, len(costs))
  stage_costs = partition_lib.StageSums(costs, partition)
  total = sum(stage_costs)
  starts = np.cumsum([0] + list(partition))[:-1]
  return {
      'partition': [int(c) for c in partition],
      'cells': [
          _CellRange(names, int(s), int(c)) for s, c in zip(starts, partition)
      ],
      'stage_costs': stage_costs,
      'stage_shares': [c / total if total else 0.0 for c in stage_costs],
      'stage_memory': (None if memory is None else partition_lib.StageSums(
          memory, partition)),
      'imbalance': partition_lib.Imbalance(costs, partition),
      'empty_stages': sum(1 for c in partition if c == 0),
  }


def _FormatSummary(title: str, summary: Dict[str, Any],
                   memory_limit: Optional[float]) -> List[str]:
  """Table lines of one PartitionSummary."""
  has_memory = summary['stage_memory'] is not None
  width = max([len('cells')] + [len(c) for c in summary['cells']])
  header = f'  stage  {"cells":<{width}}  {"n":>3}  {"cost":>10}  {"share":>6}'
  if has_memory:
    header += f'  {"memory":>10}'
  lines = [f'{title} {summary["partition"]}:', header]
  for k, (cells, count, cost, share) in enumerate(
      zip(summary['cells'], summary['partition'], summary['stage_costs'],
          summary['stage_shares'])):
    line = (f'  {k:>5}  {cells:<{width}}  {count:>3}  {_Number(cost):>10}  '
            f'{share:>6.1%}')
    if has_memory:
      mem = summary['stage_memory'][k]
      line += f'  {_Number(mem):>10}'
      if memory_limit is not None and mem > memory_limit:
        line += '  over memory_limit'
    lines.append(line)
  tail = f'  imbalance (largest stage / ideal): {summary["imbalance"]:.3f}'
  if has_memory:
    tail += f', largest stage memory: {_Number(max(summary["stage_memory"]))}'
  if summary['empty_stages']:
    tail += f', {summary["empty_stages"]} empty stage(s)'
  lines.append(tail)
  return lines


def PartitionReport(costs: Sequence[float],
                    partition: Sequence[int],
                    memory: Optional[Sequence[float]] = None,
                    names: Optional[Sequence[str]] = None,
                    memory_limit: Optional[float] = None) -> str:
  """A table of the stages of `partition` next to Lingvo's heuristic.

  For each stage: its cells (first .. last name), their number, cost, share of
  the total and memory; then the imbalance (largest stage cost / ideal). The
  same follows for `partition.LingvoPartition(costs, K)`, whose empty stages
  show as '(empty)'.

  Args:
    costs: One non-negative cost per cell.
    partition: Cells per stage (K positive ints).
    memory: Optional memory per cell (e.g. `CellMemory(cells)`).
    names: Optional cell names.
    memory_limit: Optional; stages above it are marked.

  Returns:
    Multi-line text.

  Raises:
    ValueError: if the partition, memory or names do not match the costs.
  """
  costs = [float(c) for c in costs]
  if not costs or not all(math.isfinite(c) and c >= 0 for c in costs):
    raise ValueError(f'costs={costs} must be a non-empty list of finite '
                     'non-negative numbers.')
  counts = partition_lib.CheckPartition(partition, len(costs))
  if memory is not None and len(memory) != len(costs):
    raise ValueError(f'memory has {len(memory)} entries but there are '
                     f'{len(costs)} cells; give one per cell.')
  num_stages, total = len(counts), sum(costs)
  lines = [
      f'{len(costs)} cells, {num_stages} stages, total cost {_Number(total)}, '
      f'ideal stage cost {_Number(total / num_stages)}.'
  ]
  lines += _FormatSummary('Partition', PartitionSummary(
      costs, counts, memory, names), memory_limit)
  if total == 0:
    lines.append("Lingvo's heuristic: undefined (all costs are zero).")
  else:
    lingvo = partition_lib.LingvoPartition(costs, num_stages)
    lines += _FormatSummary("Lingvo's heuristic (PartitionSequentialLayers)",
                            PartitionSummary(costs, lingvo, memory, names),
                            memory_limit)
  return '\n'.join(lines)
