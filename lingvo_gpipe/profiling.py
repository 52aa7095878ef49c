"""What `plan.py auto` measures of each Lingvo cell: times and bytes.

`ProfileCells` gives the planner (`planning.search`) each cell's
`planning.profile.CellProfile`: forward, backward and optimizer-update time
on micro-batches of two sizes, the part of the backward its weight gradients
take and what they read (for schedules that split the backward), the
activation bytes its backward keeps, the workspace of its running backward,
its output, weight, gradient and optimizer-slot bytes. Two cells, one timed run per part:

    >>> from lingvo.core import layers
    >>> cells = [layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=8,
    ...                                      output_dim=8).Instantiate()
    ...          for i in range(2)]
    >>> profiles, _ = ProfileCells(
    ...     cells, (np.ones([32, 8], np.float32),), batch_dim=0,
    ...     micro_batch_sizes=[4, 32], num_runs=1,
    ...     optimizer_fn=lambda: tf.train.AdamOptimizer(1e-3))
    >>> fc0 = profiles[0]
    >>> fc0.name, fc0.weight_bytes, fc0.slot_bytes, fc0.output_bytes
    ('fc0', 288.0, 576.0, 32.0)
    >>> fc0.weight_stash_bytes  # Its input and output gradient, per example.
    64.0

A time is the fastest of its timed runs, not the median that partition costs
take (`lingvo_gpipe.costs`): the parts of a cell (forward, forward +
backward, the update, an empty session call) run in turns and each is the
least disturbed of its runs, so that differences between parts (the
backward is forward + backward minus forward; the session call is
subtracted) are not differences of noise; and what the planner's
predictions meet is the fastest measured step (`plan.py auto --verify`, the
calibration of the call overhead). Bytes come from FULL_TRACE runs'
allocation records (`AllocationPeak`, `HeldAtForwardEnd`).
"""

import collections
import time
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
import numpy as np

from lingvo_gpipe import cells as cells_lib
from lingvo_gpipe import costs
from lingvo_gpipe.engine import split_backward
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.planning import profile as profile_lib
from lingvo_gpipe.planning import timing

Affine = profile_lib.Affine

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
# than of one run's order); kept bytes the largest. The bytes are what the
# allocator handed out: TensorFlow's BFC allocator (the measuring workers')
# rounds each request up to 256 bytes and may give a free chunk of up to
# twice the request whole, more often in a process that allocated before.
TRACED_RUNS = 9


class CellRun(NamedTuple):
  """One cell profiled on one micro-batch (see `ProfileCell`).

  Attributes:
    forward_s: Seconds of the forward pass (beyond a session call).
    backward_s: Seconds of forward + backward, minus forward_s.
    weight_s: The part of backward_s that the weight gradients take:
      forward + backward minus forward + input gradients.
    weight_stash_bytes: Bytes a split backward stashes from its input
      gradients (B) for its weight gradients (W): `split_backward`'s cut.
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
  weight_s: float
  weight_stash_bytes: float
  update_s: float
  workspace_bytes: float
  kept_workspace_bytes: float
  kept_bytes: float
  output_bytes: float
  weight_bytes: float
  gradient_bytes: float
  slot_bytes: float
  outputs: Any


def _WeightStashBytes(layer: base_layer.BaseLayer, args: Any) -> float:
  """What W of the cell's split backward reads from B, in bytes.

  The cut of the loop engine (`split_backward.BackwardSplit`) of a chunk
  that is this cell alone.

  Args:
    layer: The cell, in the current graph.
    args: Its FProp arguments (placeholders, None or nests).

  Returns:
    The bytes of the weight stash of one call.
  """
  name = layer.params.name
  stage = stage_lib.Stage(cells_lib.StageFunction([layer]), name, device='')
  theta = stage.FlattenTheta(py_utils.NestedMap({name: layer.theta}))
  x, state = stage.FlattenCall(
      tuple(args), py_utils.NestedMap({name: layer.GetAccumulatorValues()}))
  split = split_backward.BackwardSplit(stage, theta, x, state)
  return sum(_Bytes(s.shape.as_list(), s.dtype)
             for s in split.weight_stash_specs)


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
  verification reports the fastest step too, and the median; see the
  module docstring).

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
                num_warmup: int = timing.PROFILE_WARMUP_RUNS,
                num_runs: int = timing.PROFILE_TIMED_RUNS) -> CellRun:
  """Times and sizes one cell on one micro-batch, in a fresh graph.

  The cell is rebuilt from its params; its backward pass computes the
  gradients of its weights and float inputs given fed upstream gradients
  (`UPSTREAM_GRADIENT`; no loss of its outputs is kept) and waits for the
  whole forward pass (`HeldAtForwardEnd`); the update applies
  `optimizer_fn()` to fed weight gradients. Forward, forward + backward, the
  update and a session call that does nothing run in turns, `num_warmup`
  turns untimed, then `num_runs` timed; each time is the fastest run minus
  the empty call's (a real step pays the session call once, not per cell),
  backward = forward + backward - forward, and the weight gradients' part of
  it = forward + backward - (forward + input gradients).

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
    layer, placeholders, args, feed = costs.FedCell(cell, inputs)
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
    forward_step = costs.RunTargets(fetched)
    grad_step = costs.RunTargets([g for g in grads if g is not None])
    backward_step = costs.RunTargets(fetched) + grad_step
    input_step = costs.RunTargets(fetched) + costs.RunTargets(
        [g for g in grads[len(trainable):] if g is not None])
    weight_stash_bytes = _WeightStashBytes(layer, args)
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
      steps = [nothing, forward_step, backward_step, input_step]
      if update_step is not None:
        steps.append(update_step)
      fastest = _InterleavedFastest(
          [lambda step=step: sess.run(step, feed_dict=feed) for step in steps],
          num_warmup, num_runs)
      work = [max(t - fastest[0], 0.0) for t in fastest[1:]]
      forward_s, both_s, input_s = work[:3]
      update_s = work[3] if update_step is not None else 0.0
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
      weight_s=max(both_s - max(input_s, forward_s), 0.0),
      weight_stash_bytes=weight_stash_bytes,
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
                 num_warmup: int = timing.PROFILE_WARMUP_RUNS,
                 num_runs: int = timing.PROFILE_TIMED_RUNS
                ) -> Tuple[List[profile_lib.CellProfile], Any]:
  """What the planner needs of each cell (`planning.profile.CellProfile`).

  Every cell is profiled (`ProfileCell`) on micro-batches of each size in
  `micro_batch_sizes` (the first examples of `sample_inputs`), cell i + 1 on
  cell i's outputs. Times and workspaces are fitted as fixed + per-example
  cost (`planning.profile.Affine.Fit`: some kernels' temporaries do not
  shrink with the micro-batch); other bytes are taken per example on the
  largest size;
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
  costs.CheckCells(cells)
  sizes = sorted(set(int(n) for n in micro_batch_sizes))
  if not sizes or sizes[0] < 1:
    raise ValueError(f'micro_batch_sizes={list(micro_batch_sizes)} must be '
                     'positive ints.')
  timing.CheckRuns(num_warmup, num_runs)
  runs = collections.defaultdict(list)
  outputs = None
  for size in sizes:
    inputs = costs.AsTuple(
        SliceBatch(costs.AsTuple(sample_inputs), batch_dim, size))
    for i, cell in enumerate(cells):
      run = ProfileCell(cell, inputs, optimizer_fn=optimizer_fn,
                        num_warmup=num_warmup, num_runs=num_runs)
      runs[i].append(run)
      inputs = costs.AsTuple(run.outputs)
    outputs = inputs
  largest = sizes[-1]
  profiles = []
  for i, cell in enumerate(cells):
    cell_runs = runs[i]
    last = cell_runs[-1]
    profiles.append(profile_lib.CellProfile(
        name=cell.params.name,
        forward_s=Affine.Fit(sizes, [r.forward_s for r in cell_runs]),
        backward_s=Affine.Fit(sizes, [r.backward_s for r in cell_runs]),
        weight_s=Affine.Fit(sizes, [r.weight_s for r in cell_runs]),
        weight_stash_bytes=last.weight_stash_bytes / largest,
        update_s=float(np.median([r.update_s for r in cell_runs])),
        activation_bytes=last.kept_bytes / largest,
        workspace_bytes=Affine.Fit(
            sizes, [r.workspace_bytes for r in cell_runs]),
        kept_workspace_bytes=Affine.Fit(
            sizes, [r.kept_workspace_bytes for r in cell_runs]),
        output_bytes=last.output_bytes / largest,
        weight_bytes=last.weight_bytes,
        gradient_bytes=last.gradient_bytes,
        slot_bytes=last.slot_bytes))
  return profiles, outputs
