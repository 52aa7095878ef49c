"""How expensive each Lingvo cell is, to choose the pipeline partition.

Costs come from parameter counts, from Lingvo's `FPropMeta` flop estimates, or
from timing each cell's forward and backward pass on a sample micro-batch:

    costs = CellCosts(cells, 'flops', input_shapes=([64, 512],))
    counts = partition.PartitionCosts(costs, 4, memory=CellMemory(cells))

`planning.report.PartitionReport` prints the chosen stages next to Lingvo's
heuristic; that part needs no Lingvo. `ProfileCells` measures what the
planner (`planning.planner`) needs of each cell: forward, backward and
optimizer-update time on micro-batches of two sizes, the activation bytes
its backward keeps, its output, weight, gradient and optimizer-slot bytes:

    profiles = ProfileCells(cells, sample_inputs, batch_dim=0,
                            micro_batch_sizes=[4, 32],
                            optimizer_fn=lambda: tf.train.AdamOptimizer(1e-3))
"""

import collections
import time
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np

from lingvo_gpipe.planning import config
from lingvo_gpipe.planning import planner
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


def _Targets(tensors: Sequence[Any]) -> List[Any]:
  """The ops of `tensors`, to run them without fetching their values.

  Not `tf.group(tensors)`: grappler prunes side-effect-free ops that only a
  NoOp's control inputs need, and the session would run nothing. Fed
  placeholders (an input passed through) are no work and are left out.
  """
  return [t.op for t in tensors if t.op.type != 'Placeholder']


def _FedCell(cell: base_layer.BaseLayer, inputs: Any):
  """A copy of `cell` in the current graph, with placeholders for `inputs`.

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
    layer, placeholders, args, feed = _FedCell(cell, inputs)
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
    step = _Targets(work)
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
  _CheckCells(cells)
  timing.CheckRuns(num_warmup, num_runs)
  inputs = _AsTuple(sample_inputs)
  times = []
  for cell in cells:
    seconds, outputs = _TimeCell(cell, inputs, num_warmup, num_runs)
    times.append(seconds)
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


# The upstream gradient of every output element while a cell is profiled.
UPSTREAM_GRADIENT = 1e-6

# The name scope of a profiled cell's backward pass (`HeldAtForwardEnd`).
BACKWARD_SCOPE = 'profiled_backward'

# Traced runs of each profiled cell, for its memory. Which independent
# kernels of a backward run at once changes from run to run, and with it
# the peak: a Transformer layer of lm.GPipeCharLm holds one 4 MiB
# matrix-product temporary at a time in some runs and two in others, in
# proportions that change between processes. Workspaces are the least of
# the runs (the fewest temporaries at once, a property of the cell rather
# than of one run's order); kept bytes the largest.
TRACED_RUNS = 9


class CellRun(NamedTuple):
  """One cell profiled on one micro-batch (see `ProfileCell`).

  Attributes:
    forward_s: Seconds of the forward pass (beyond a session call).
    backward_s: Seconds of forward + backward, minus forward_s.
    update_s: Seconds of the optimizer update of its variables, on fed
      gradients (0 without an optimizer).
    workspace_bytes: The most bytes the kernels of forward + backward held at
      once (the least of `TRACED_RUNS` FULL_TRACE runs, `AllocationPeak`)
      beyond the kept bytes and the weight gradients: what a backward that
      runs in one function with its forward (a recompute) needs besides
      them; its activations go as it consumes them.
    kept_workspace_bytes: The most bytes the backward's own kernels held at
      once (the least of the same runs) beyond the weight gradients: what
      the backward of a call that kept its activations needs besides them:
      in a pipeline's allocation records such a backward runs as a function
      call of its own and holds all of them until it ends.
    kept_bytes: Bytes the forward pass holds for the backward when it ends,
      the largest of the same runs (`HeldAtForwardEnd`).
    output_bytes: Bytes of the cell's outputs.
    weight_bytes: Bytes of all the cell's variables.
    gradient_bytes: Bytes of its trainable variables.
    slot_bytes: Bytes of the optimizer's slots for them.
    outputs: The outputs as numpy, in FProp's structure.
  """
  forward_s: float
  backward_s: float
  update_s: float
  workspace_bytes: float
  kept_workspace_bytes: float
  kept_bytes: float
  output_bytes: float
  weight_bytes: float
  gradient_bytes: float
  slot_bytes: float
  outputs: Any


def _Bytes(shape: Sequence[int], dtype: Any) -> float:
  return float(np.prod(shape, dtype=np.float64) * tf.as_dtype(dtype).size)


def HeldAtForwardEnd(step_stats: Any, backward_scope: str) -> float:
  """Bytes a traced run's forward pass still holds when it ends.

  The run's backward pass (its nodes named under `backward_scope`) must wait
  for the whole forward pass; then what the forward's kernels allocated and
  not yet released when its last kernel ends is what it keeps for the
  backward: the bytes a call that does not re-materialize holds from its
  forward to its backward. Fed inputs (`_arg` nodes) are not allocations of
  the forward. This is measured, not read from the graph: Grappler's
  rewrites change which tensors a backward reads (for Lingvo's transformer
  layer the graph names 1.2 times the bytes a run holds).

  Args:
    step_stats: `RunMetadata.step_stats` of a FULL_TRACE run.
    backward_scope: The name scope of the backward pass.

  Returns:
    Bytes.
  """
  forward_end = 0
  records = []
  for device in step_stats.dev_stats:
    for node in device.node_stats:
      if (node.node_name.startswith('_') or
          node.node_name.startswith(backward_scope)):
        continue
      forward_end = max(forward_end,
                        node.all_start_micros + node.all_end_rel_micros)
      records.extend((r.alloc_micros, r.alloc_bytes) for m in node.memory
                     for r in m.allocation_records)
  return float(sum(size for when, size in records if when <= forward_end))


def _InterleavedFastest(runs: Sequence[Callable[[], None]], num_warmup: int,
                        num_runs: int) -> List[float]:
  """The fastest of `num_runs` timed runs of each function, run in turns.

  Turns spread slow phases of a shared machine over all of them; the fastest
  run is the one least slowed by other processes (the planner's
  verification reports the fastest step too, and the median).

  Args:
    runs: Functions to time.
    num_warmup: Untimed turns first.
    num_runs: Timed turns.

  Returns:
    One time per function, in seconds.
  """
  for _ in range(num_warmup):
    for run in runs:
      run()
  seconds = [[] for _ in runs]
  for _ in range(num_runs):
    for i, run in enumerate(runs):
      start = time.perf_counter()
      run()
      seconds[i].append(time.perf_counter() - start)
  return [float(min(s)) for s in seconds]


def ProfileCell(cell: base_layer.BaseLayer,
                inputs: tuple,
                optimizer_fn: Optional[Callable[[], Any]] = None,
                num_warmup: int = PROFILE_WARMUP_RUNS,
                num_runs: int = PROFILE_TIMED_RUNS) -> CellRun:
  """Times and sizes one cell on one micro-batch, in a fresh graph.

  The cell is rebuilt from its params; its backward pass computes the
  gradients of its weights and float inputs given fed upstream gradients
  (`UPSTREAM_GRADIENT`; no loss of its outputs is kept) and waits for the
  whole forward pass (`HeldAtForwardEnd`); the update applies
  `optimizer_fn()` to fed weight gradients. Forward, forward + backward, the
  update and a session call that does nothing run in turns, `num_warmup`
  turns untimed, then `num_runs` timed; each time is the fastest run minus
  the empty call's (a real step pays the session call once, not per cell),
  and backward = forward + backward - forward.

  Args:
    cell: An instantiated Lingvo layer.
    inputs: Its FProp inputs: numpy arrays, None or nests of them.
    optimizer_fn: Returns a TF1 optimizer (e.g. the task's); None: no update
      is timed and slots are 0.
    num_warmup: Untimed runs of each part.
    num_runs: Timed runs of each part.

  Returns:
    The `CellRun`.
  """
  graph = tf.Graph()
  with graph.as_default():
    layer, placeholders, args, feed = _FedCell(cell, inputs)
    outputs = layer.FProp(layer.theta, *args)
    flat_outputs = tf.nest.flatten(outputs)
    fetched = [y for y in flat_outputs if y is not None]
    floats = [y for y in fetched if y.dtype.is_floating]
    # Upstream gradients are fed (small values, so that repeated updates keep
    # the weights finite; fed, so that no constant folds the backward away).
    upstream = [tf.compat.v1.placeholder(y.dtype, y.shape) for y in floats]
    variables = layer.vars.Flatten()
    trainable = [v for v in variables if v.trainable]
    float_inputs = [p for p in placeholders
                    if p is not None and p.dtype.is_floating]
    with tf.name_scope(BACKWARD_SCOPE), tf.control_dependencies(floats):
      gated = [tf.identity(u) for u in upstream]
    grads = (tf.gradients(floats, trainable + float_inputs, grad_ys=gated,
                          name=BACKWARD_SCOPE) if floats else [])
    weight_grads = [(g, v) for g, v in zip(grads, trainable) if g is not None]
    forward_step = _Targets(fetched)
    grad_step = _Targets([g for g in grads if g is not None])
    backward_step = _Targets(fetched) + grad_step
    update_step, slot_bytes = None, 0.0
    if optimizer_fn is not None and weight_grads:
      # The update on fed gradients: timed alone, not as a difference.
      fed_grads = [(tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape), v)
                   for _, v in weight_grads]
      feed.update({g: np.full(v.shape.as_list(), UPSTREAM_GRADIENT,
                              v.dtype.base_dtype.as_numpy_dtype)
                   for g, v in fed_grads})
      optimizer = optimizer_fn()
      update_step = optimizer.apply_gradients(fed_grads)
      slots = [optimizer.get_slot(v, name) for _, v in weight_grads
               for name in optimizer.get_slot_names()]
      slot_bytes = sum(_Bytes(s.shape.as_list(), s.dtype.base_dtype)
                       for s in slots if s is not None)
    nothing = tf.no_op()
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      values = sess.run(fetched, feed_dict=feed)
      feed.update({
          p: np.full(np.shape(y), UPSTREAM_GRADIENT, y.dtype)
          for p, y in zip(upstream, [v for v, t in zip(values, fetched)
                                     if t.dtype.is_floating])
      })
      # The first is a run that does nothing with the same feeds: the cost
      # of a session call, which a real step pays once, not once per cell.
      steps = [nothing, forward_step, backward_step]
      if update_step is not None:
        steps.append(update_step)
      fastest = _InterleavedFastest(
          [lambda step=step: sess.run(step, feed_dict=feed) for step in steps],
          num_warmup, num_runs)
      work = [max(t - fastest[0], 0.0) for t in fastest[1:]]
      forward_s, both_s = work[:2]
      update_s = work[2] if update_step is not None else 0.0
      # Traced without fetching the outputs: what the backward does not read
      # is released as it would be in a pipeline. The order of kernels that
      # may run in parallel changes the peaks (see TRACED_RUNS).
      step_peaks, backward_peaks, kept = [], [], []
      for _ in range(TRACED_RUNS):
        run_metadata = tf.compat.v1.RunMetadata()
        sess.run(grad_step, feed_dict=feed,
                 options=tf.compat.v1.RunOptions(
                     trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                 run_metadata=run_metadata)
        step_peaks.append(AllocationPeak(run_metadata.step_stats))
        backward_peaks.append(AllocationPeak(run_metadata.step_stats,
                                             BACKWARD_SCOPE))
        kept.append(HeldAtForwardEnd(run_metadata.step_stats, BACKWARD_SCOPE))
  values = iter(values)
  numpy_outputs = [None if y is None else next(values) for y in flat_outputs]
  output_bytes = sum(float(np.asarray(y).nbytes) for y in numpy_outputs
                     if y is not None)
  gradient_bytes = sum(_Bytes(v.shape.as_list(), v.dtype.base_dtype)
                       for v in trainable)
  return CellRun(
      forward_s=forward_s,
      backward_s=max(both_s - forward_s, 0.0),
      update_s=update_s,
      workspace_bytes=max(min(step_peaks) - max(kept) - gradient_bytes, 0.0),
      kept_workspace_bytes=max(min(backward_peaks) - gradient_bytes, 0.0),
      kept_bytes=max(kept),
      output_bytes=output_bytes,
      weight_bytes=sum(_Bytes(v.shape.as_list(), v.dtype.base_dtype)
                       for v in variables),
      gradient_bytes=gradient_bytes,
      slot_bytes=slot_bytes,
      outputs=tf.nest.pack_sequence_as(outputs, numpy_outputs))


def AllocationPeak(step_stats: Any, scope: Optional[str] = None) -> float:
  """The most bytes a traced run's kernels held at once (all devices).

  Replays the allocation records that step stats keep per node (FULL_TRACE):
  allocations positive, releases negative, in time order. Variables and
  what earlier runs left are not in them.

  Args:
    step_stats: `RunMetadata.step_stats`.
    scope: If given, only the kernels of nodes named under it (e.g.
      `BACKWARD_SCOPE`: what a backward's own kernels held at once).

  Returns:
    Bytes.
  """
  records = sorted(
      (r.alloc_micros, r.alloc_bytes) for d in step_stats.dev_stats
      for node in d.node_stats
      if scope is None or node.node_name.startswith(scope)
      for m in node.memory for r in m.allocation_records)
  held = peak = 0
  for _, size in records:
    held += size
    peak = max(peak, held)
  return float(peak)


def SliceBatch(inputs: Any, batch_dim: int, size: int) -> Any:
  """The first `size` examples of every array in `inputs` (None kept).

  Args:
    inputs: Numpy arrays (or None) in any nest.
    batch_dim: Their batch dimension.
    size: Examples to keep.

  Returns:
    The same nest, arrays cut along batch_dim.

  Raises:
    ValueError: if an array has fewer than `size` examples or no batch_dim.
  """

  def Cut(x):
    if x is None:
      return None
    x = np.asarray(x)
    if x.ndim <= batch_dim or x.shape[batch_dim] < size:
      raise ValueError(f'an input of shape {list(x.shape)} has no {size} '
                       f'examples along batch_dim={batch_dim}.')
    return np.take(x, np.arange(size), axis=batch_dim)

  return tf.nest.map_structure(Cut, inputs)


def ProfileCells(cells: Sequence[base_layer.BaseLayer],
                 sample_inputs: Any,
                 batch_dim: int,
                 micro_batch_sizes: Sequence[int],
                 optimizer_fn: Optional[Callable[[], Any]] = None,
                 num_warmup: int = PROFILE_WARMUP_RUNS,
                 num_runs: int = PROFILE_TIMED_RUNS
                ) -> Tuple[List[planner.CellProfile], Any]:
  """What the planner needs of each cell (`planner.CellProfile`).

  Every cell is profiled (`ProfileCell`) on micro-batches of each size in
  `micro_batch_sizes` (the first examples of `sample_inputs`), cell i + 1 on
  cell i's outputs. Times and workspaces are fitted as fixed + per-example
  cost (`planner.Affine.Fit`: some kernels' temporaries do not shrink with
  the micro-batch); other bytes are taken per example on the largest size;
  the update time is the median over the sizes (it does not depend on them).

  Args:
    cells: Instantiated Lingvo layers, in order.
    sample_inputs: The first cell's FProp inputs (numpy arrays, None or
      nests) with at least max(micro_batch_sizes) examples along batch_dim.
    batch_dim: The batch dimension of every input and output.
    micro_batch_sizes: One or more positive example counts.
    optimizer_fn: Returns the TF1 optimizer whose update and slots to
      measure; None for none.
    num_warmup: Untimed runs of each part.
    num_runs: Timed runs of each part (>= 1).

  Returns:
    (one CellProfile per cell, the last cell's outputs on the largest size).

  Raises:
    ValueError: on bad sizes, runs, or inputs without enough examples.
  """
  _CheckCells(cells)
  sizes = sorted(set(int(n) for n in micro_batch_sizes))
  if not sizes or sizes[0] < 1:
    raise ValueError(f'micro_batch_sizes={list(micro_batch_sizes)} must be '
                     'positive ints.')
  if num_runs < 1 or num_warmup < 0:
    raise ValueError(f'num_runs={num_runs} must be >= 1 and num_warmup='
                     f'{num_warmup} >= 0.')
  runs = collections.defaultdict(list)
  outputs = None
  for size in sizes:
    inputs = _AsTuple(SliceBatch(_AsTuple(sample_inputs), batch_dim, size))
    for i, cell in enumerate(cells):
      run = ProfileCell(cell, inputs, optimizer_fn, num_warmup, num_runs)
      runs[i].append(run)
      inputs = _AsTuple(run.outputs)
    outputs = inputs
  largest = sizes[-1]
  profiles = []
  for i, cell in enumerate(cells):
    cell_runs = runs[i]
    last = cell_runs[-1]
    profiles.append(planner.CellProfile(
        name=cell.params.name,
        forward_s=planner.Affine.Fit(sizes, [r.forward_s for r in cell_runs]),
        backward_s=planner.Affine.Fit(sizes,
                                      [r.backward_s for r in cell_runs]),
        update_s=float(np.median([r.update_s for r in cell_runs])),
        activation_bytes=last.kept_bytes / largest,
        workspace_bytes=planner.Affine.Fit(
            sizes, [r.workspace_bytes for r in cell_runs]),
        kept_workspace_bytes=planner.Affine.Fit(
            sizes, [r.kept_workspace_bytes for r in cell_runs]),
        output_bytes=last.output_bytes / largest,
        weight_bytes=last.weight_bytes,
        gradient_bytes=last.gradient_bytes,
        slot_bytes=last.slot_bytes))
  return profiles, outputs
