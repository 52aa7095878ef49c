r"""The planner's measurements, each in a fresh process.

    python -m benchmarks.plan_worker '{"action": "profile", "model": ..., ...}'
    python -m benchmarks.plan_worker '{"action": "measure", "model": ..., ...}'

`tools/plan.py auto` runs this module twice over: once to profile a
registered model (`Profile`: every cell of its GPipeSequentialLayer on two
micro-batch sizes with `lingvo_gpipe.profiling.ProfileCells`, and the task
around the pipeline), then once per verified candidate (`Measure`: the model's
real training step, built as Lingvo's graph-mode trainer builds it, on N
logical CPU devices in splits of K). Each prints one line after
`runner.RESULT_PREFIX` with its JSON, or one error line after
`ERROR_PREFIX` and exits with status 2. A fresh process per measurement keeps
allocator peaks and thread settings from leaking between configurations.

Threads: `intra_op_threads` (default 1) is set before TensorFlow starts, so
that each logical CPU device acts as one core and pipeline stages overlap
(docs/design.md, 6c); the profile uses the same setting as the measurement.

Memory per device: logical CPU devices share one allocator, so
`get_memory_info` reads their sum. `Measure` runs one more step under
FULL_TRACE and replays the allocation records that step stats keep per node:
an allocation counts on the device whose kernel made it
(`DevicePeaks`), from its allocation to its release, and a device that reads
a tensor another device made holds a copy of it, as a device with its own
memory would. Variables are not
allocated during a step; their bytes (weights and optimizer slots) are
attributed to the device of the pipeline chunk whose cell owns them
(`VariableBytesPerDevice`), as a device with its own memory would hold them.
"""

import json
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import app

from benchmarks import host
from benchmarks import runner

ERROR_PREFIX = 'benchmarks.plan_worker: error: '
ACTIONS = ('profile', 'measure')


class WorkerError(ValueError):
  """A failed profile or measurement, printed on one line."""


def SetUpTensorFlow(num_devices: int, intra_op_threads: int) -> None:
  """Threads and logical devices, before anything initializes TensorFlow.

  Args:
    num_devices: The logical CPU devices a graph-mode session will ask for
      (inter-op threads: at least one per device, and 2).
    intra_op_threads: Threads of one op; 1 makes each device act as a core.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
  tf.config.threading.set_inter_op_parallelism_threads(max(2, num_devices))


def FindStack(task_params: Any) -> Tuple[str, Any]:
  """The first GPipeSequentialLayer in a task's params, and its path.

  Args:
    task_params: A Lingvo task's Params.

  Returns:
    (path from the model params, e.g. 'task.stack', the layer's Params).

  Raises:
    WorkerError: if the task has none (a Lingvo stack of
      `lingvo_gpipe.stacks` is named as not supported yet).
  """
  # pylint: disable=g-import-not-at-top
  from lingvo.core import hyperparams
  from lingvo_gpipe import stacks
  from lingvo_gpipe.layers import GPipeSequentialLayer
  # pylint: enable=g-import-not-at-top
  found, lingvo_stacks = [], []

  def Visit(path, p):
    if found:
      return
    if isinstance(p, (list, tuple)):
      for i, item in enumerate(p):
        Visit(f'{path}[{i}]', item)
    if not isinstance(p, hyperparams.Params):
      return
    cls = getattr(p, 'cls', None)
    if cls is GPipeSequentialLayer:
      found.append((path, p))
      return
    if isinstance(cls, type) and issubclass(cls, stacks.PipeliningLayer):
      lingvo_stacks.append(path)
      return
    for name, value in p.IterParams():
      Visit(f'{path}.{name}', value)

  Visit('task', task_params)
  if found:
    return found[0]
  if lingvo_stacks:
    raise WorkerError(
        f'{lingvo_stacks[0]} is a Lingvo stack (lingvo_gpipe.stacks); the '
        'planner plans GPipeSequentialLayer params only (its cells, '
        'num_stages, partition): convert it with '
        'GPipeSequentialLayer.FromPipeliningLayer.')
  raise WorkerError('the task has no GPipeSequentialLayer; the planner plans '
                    'a task with one (e.g. lm.GPipeCharLm).')


def ModelParams(model: str, overrides: str) -> Any:
  """The registered model's 'Train' params with `overrides` applied.

  Args:
    model: A key of Lingvo's model registry.
    overrides: `--model_params_override` text ('key: value' lines, or ';'
      between them).

  Returns:
    The params.

  Raises:
    WorkerError: if the model is not registered or an override fails.
  """
  # pylint: disable=g-import-not-at-top
  from lingvo import model_registry
  import params  # pylint: disable=unused-import  (registers the models)
  # pylint: enable=g-import-not-at-top
  try:
    p = model_registry.GetParams(model, 'Train')
  except LookupError as e:
    raise WorkerError(f'model {model!r}: {e}') from e
  if overrides:
    try:
      p.FromText(overrides.replace(';', '\n'))
    except (AttributeError, ValueError, SyntaxError) as e:
      raise WorkerError(f'model {model!r}: override {overrides!r}: '
                        f'{type(e).__name__}: {e}') from e
  return p


def _Cluster(num_devices: int, split_size: int):
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  return cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=num_devices,
      split_size=split_size)


def _Child(task: Any, path: str) -> Any:
  """The built layer at `path` ('task.<child>.<child>...') of a task."""
  layer = task
  for name in path.split('.')[1:]:
    if '[' in name:
      raise WorkerError(f'{path}: a pipeline inside a list of layers is not '
                        'supported; the planner needs a path of children.')
    layer = getattr(layer, name)
  return layer


def _ReceivedRecords(step_stats: Any) -> Dict[str, List[Tuple[int, int]]]:
  """Allocation records for the buffers a device reads from another device.

  Logical CPU devices share memory: a tensor passed from one to another is
  not copied, and its allocation is recorded only on the device that made
  it. A device with its own memory would hold a copy from its first use
  until its last. This finds, per device, the buffers (by address) that its
  nodes output or read while another device's kernel allocated them, and
  returns a record of each copy: +bytes at its first use, -bytes at the end
  of its last. A buffer is another device's from the node that allocated it
  (an output of the size of one of the node's allocations) until the next
  such node or the buffer's release: the allocator reuses addresses.

  Args:
    step_stats: `RunMetadata.step_stats` of a FULL_TRACE step.

  Returns:
    {device name: [(micros, bytes), ...]}.
  """
  nodes = sorted(((node.all_start_micros, d.device, node)
                  for d in step_stats.dev_stats for node in d.node_stats),
                 key=lambda n: n[0])
  owner: Dict[int, int] = {}  # Address: buffer.
  # Per buffer: its device, bytes and the allocating node's release times
  # of that many bytes.
  buffers: List[Tuple[str, int, List[int]]] = []
  made: Dict[Tuple[str, str], List[Optional[int]]] = {}  # Per node: buffers.
  # (device, buffer): [first start, last end] of another device's uses.
  uses: Dict[Tuple[str, int], List[int]] = {}
  for start, device, node in nodes:
    end = start + node.all_end_rel_micros
    records = [r for m in node.memory for r in m.allocation_records]
    allocated = {r.alloc_bytes for r in records if r.alloc_bytes > 0}
    used = []
    # Inputs by name ('name', 'name:k'; '^name' is a control input).
    label = node.timeline_label
    if '(' in label:
      for name in label[label.index('(') + 1:label.rindex(')')].split(', '):
        name, _, slot = name.partition(':')
        outputs = made.get((device, name))
        if outputs and int(slot or 0) < len(outputs):
          used.append(outputs[int(slot or 0)])
    outputs = []
    for output in node.output:
      a = output.tensor_description.allocation_description
      if not a.ptr:
        outputs.append(None)
        continue
      if (a.allocated_bytes in allocated or a.ptr not in owner or
          _Released(buffers[owner[a.ptr]], start)):
        owner[a.ptr] = len(buffers)
        buffers.append((device, a.allocated_bytes,
                        [r.alloc_micros for r in records
                         if r.alloc_bytes == -a.allocated_bytes]))
      outputs.append(owner[a.ptr])
    used += outputs
    made[device, node.node_name] = outputs
    for buffer in used:
      if buffer is not None and buffers[buffer][0] != device:
        span = uses.setdefault((device, buffer), [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
  records: Dict[str, List[Tuple[int, int]]] = {}
  for (device, buffer), (first, last) in uses.items():
    size = buffers[buffer][1]
    records.setdefault(device, []).extend([(first, size), (last, -size)])
  return records


def _Released(buffer: Tuple[str, int, List[int]], micros: int) -> bool:
  """Whether every release of a buffer's bytes by its node is before micros.

  Its address then belongs to another buffer, whose allocation another node
  recorded.

  Args:
    buffer: (device, bytes, release times) as `_ReceivedRecords` keeps it.
    micros: A node's start.

  Returns:
    False if the buffer's releases are unknown.
  """
  releases = buffer[2]
  return bool(releases) and max(releases) < micros


def DevicePeaks(step_stats: Any) -> Dict[str, Dict[str, float]]:
  """Per device, the most bytes it held at once in a step.

  Replays the allocation records of every node (allocations positive,
  releases negative) of each device in time order, with a copy of each
  buffer the device reads from another (`_ReceivedRecords`), as a device
  with its own memory would hold it. Only what the step allocates counts:
  variables and what earlier steps left are outside.

  Args:
    step_stats: `RunMetadata.step_stats` of a FULL_TRACE step.

  Returns:
    {device name: {'peak': bytes, 'allocated': total bytes allocated,
    'end': bytes still held at the end, 'received': bytes of the copies}}.
  """
  records: Dict[str, List[Tuple[int, int]]] = {}
  for dev_stats in step_stats.dev_stats:
    device = dev_stats.device
    for node in dev_stats.node_stats:
      for memory in node.memory:
        for record in memory.allocation_records:
          records.setdefault(device, []).append(
              (record.alloc_micros, record.alloc_bytes))
  received = _ReceivedRecords(step_stats)
  result = {}
  for device in set(records) | set(received):
    copies = received.get(device, [])
    # At equal times releases first: a buffer freed and another allocated in
    # the same microsecond do not overlap.
    device_records = sorted(records.get(device, []) + copies)
    held = peak = allocated = 0
    for _, size in device_records:
      held += size
      peak = max(peak, held)
      allocated += max(size, 0)
    result[device] = {'peak': float(peak), 'allocated': float(allocated),
                      'end': float(held),
                      'received': float(sum(max(b, 0) for _, b in copies))}
  return result


def DeviceIndex(device: str) -> Optional[int]:
  """k of '.../device:CPU:k' (None for other devices)."""
  marker = 'device:CPU:'
  if marker not in device:
    return None
  return int(device.rsplit(marker, 1)[1].split('/')[0])


def _CellOfVariable(name: str, cell_prefixes: Dict[str, int]) -> Optional[int]:
  """The cell whose variable (or optimizer slot of one) `name` is."""
  for prefix, cell in cell_prefixes.items():
    if name.startswith(prefix):
      return cell
  return None


def VariableBytesPerDevice(variables: Sequence[Any], stack: Any,
                           num_devices: int, split_size: int
                          ) -> Tuple[List[float], float, float]:
  """Bytes of variables each device would hold, by the chunk of their cell.

  A cell's variables and their optimizer slots (variables whose name starts
  with the cell's variable name) count on the device of the chunk that runs
  the cell, in every replica; other variables (global step, optimizer
  counters) on the first device of every replica.

  Args:
    variables: Every global variable of the graph.
    stack: The built GPipeSequentialLayer.
    num_devices: N.
    split_size: K.

  Returns:
    (bytes per device, bytes of the stack's variables and slots, bytes of the
    others).
  """
  cells = stack.params.cell_tpl
  prefixes = {}
  for i, cell_p in enumerate(cells):
    for v in stack.vars[cell_p.name].Flatten():
      prefixes[v.name.split(':')[0] + '/'] = i
      prefixes[v.name] = i
  chunk_of_cell = []
  for c, count in enumerate(stack.partition):
    chunk_of_cell += [c] * count
  per_stage = [0.0] * split_size
  stack_bytes = other_bytes = 0.0
  for v in variables:
    size = float(v.shape.num_elements() * v.dtype.base_dtype.size)
    cell = _CellOfVariable(v.name, prefixes)
    if cell is None:
      other_bytes += size
      per_stage[0] += size
    else:
      stack_bytes += size
      per_stage[chunk_of_cell[cell] % split_size] += size
  return per_stage * (num_devices // split_size), stack_bytes, other_bytes


def Measure(config: Dict[str, Any]) -> Dict[str, Any]:
  """Trains the model a few steps as configured; times and sizes the steps.

  Args:
    config: {'model', 'overrides' (--model_params_override text),
      'num_devices' (N), 'split_size' (K), 'warmups', 'steps',
      'intra_op_threads'}.

  Returns:
    A JSON-ready dict: step_s (the fastest timed step), median_step_s,
    step_times_s,
    first_step_s, device_transient_bytes (per device, `DevicePeaks`' peak of
    the traced step), device_variable_bytes (`VariableBytesPerDevice`),
    device_peak_bytes (their sum per device), peak_bytes (the largest),
    allocator_peak_bytes and allocator_resident_bytes (the shared
    allocator's peak during the timed steps and what it held before them,
    all devices together), partition, engine.
  """
  num_devices, split_size = config['num_devices'], config['split_size']
  SetUpTensorFlow(num_devices, config.get('intra_op_threads', 1))
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  params = ModelParams(config['model'], config.get('overrides', ''))
  path, _ = FindStack(params.task)
  graph = tf.Graph()
  with graph.as_default(), _Cluster(num_devices, split_size):
    model = params.Instantiate()
    model.ConstructFPropBPropGraph()
    task = model.GetTask()
    train_op = task.train_op
    stack = _Child(task, path)
    init_op = tf.compat.v1.global_variables_initializer()
    variables = tf.compat.v1.global_variables()
  session_config = tf.compat.v1.ConfigProto(
      device_count={'CPU': num_devices})
  with tf.compat.v1.Session(graph=graph, config=session_config) as sess:
    sess.run(init_op)
    start = time.perf_counter()
    sess.run(train_op)
    first_step_s = time.perf_counter() - start
    for _ in range(config.get('warmups', 2)):
      sess.run(train_op)
    times, peaks, resident = [], [], []
    for _ in range(config.get('steps', 5)):
      resident.append(host.ResetMemoryStats())
      start = time.perf_counter()
      sess.run(train_op)
      times.append(time.perf_counter() - start)
      peaks.append(host.PeakBytes())
    run_metadata = tf.compat.v1.RunMetadata()
    sess.run(train_op,
             options=tf.compat.v1.RunOptions(
                 trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
             run_metadata=run_metadata)
  transient = [0.0] * num_devices
  for device, numbers in DevicePeaks(run_metadata.step_stats).items():
    k = DeviceIndex(device)
    if k is not None and k < num_devices:
      transient[k] = max(transient[k], numbers['peak'])
  per_device, stack_bytes, other_bytes = VariableBytesPerDevice(
      variables, stack, num_devices, split_size)
  device_peaks = [t + v for t, v in zip(transient, per_device)]
  return {
      # The fastest step: the one least slowed by other processes on a
      # shared machine (the profile takes the fastest runs too).
      'step_s': min(times),
      'median_step_s': statistics.median(times),
      'step_times_s': times,
      'first_step_s': first_step_s,
      'device_transient_bytes': transient,
      'device_variable_bytes': per_device,
      'device_peak_bytes': device_peaks,
      'peak_bytes': max(device_peaks),
      'stack_variable_bytes': stack_bytes,
      'other_variable_bytes': other_bytes,
      'allocator_peak_bytes': float(max(peaks)),
      'allocator_resident_bytes': float(max(resident)),
      'partition': stack.partition,
      'stack_path': path,
  }


def _StackParams(params: Any, path: str) -> Any:
  """The Params at `path` ('task.stack') of the model params."""
  p = params
  for name in path.split('.'):
    p = p.Get(name)
  return p


def _SequentialStack(stack_p: Any, batch_size: int) -> None:
  """Makes the pipeline one stage of one micro-batch, without recompute."""
  stack_p.Set(num_stages=1, virtual_stages=1, num_micro_batches=1,
              partition='uniform', remat='never', engine='unrolled')
  if stack_p.micro_batch_size is not None:
    stack_p.micro_batch_size = batch_size


def _Numpy(sess: Any, nest: Any) -> Any:
  """A nest of tensors (and None) evaluated to numpy."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  flat = tf.nest.flatten(nest)
  values = iter(sess.run([t for t in flat if t is not None]))
  return tf.nest.pack_sequence_as(
      nest, [None if t is None else next(values) for t in flat])


def _CaptureStack(params: Any, path: str, batch_size: int) -> Dict[str, Any]:
  """The pipeline's inputs and outputs on one batch, and the task's optimizer.

  Builds the task with the pipeline as one stage, runs its forward pass once
  and records what its GPipeSequentialLayer received and returned.

  Args:
    params: The model params (input.batch_size = batch_size).
    path: The pipeline's path.
    batch_size: Examples of the batch.

  Returns:
    {'inputs', 'outputs': numpy nests, 'optimizer_fn': a function returning
    the task's (first learner's) TF1 optimizer, 'cell_params'}.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  params = params.Copy()
  stack_p = _StackParams(params, path)
  _SequentialStack(stack_p, batch_size)
  captured = {}
  graph = tf.Graph()
  with graph.as_default(), _Cluster(1, 1):
    model = params.Instantiate()
    task = model.GetTask()
    stack = _Child(task, path)
    fprop = stack.FProp

    def Capture(theta, *args):
      captured['inputs'] = args
      captured['outputs'] = fprop(theta, *args)
      return captured['outputs']

    stack.FProp = Capture
    task.FPropDefaultTheta()
    if 'inputs' not in captured:
      raise WorkerError(f'{path}.FProp was not called by the task\'s forward '
                        'pass; the planner profiles the pipeline the task '
                        'runs.')
    if stack.params.nested_map_fprop:
      raise WorkerError(f'{path} has nested_map_fprop=True; the planner '
                        'profiles cells that take and return tensors.')
    lingvo_optimizer = task.learners[0].optimizer
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      inputs = _Numpy(sess, captured['inputs'])
      outputs = _Numpy(sess, captured['outputs'])
  return {
      'inputs': inputs,
      'outputs': outputs,
      # The learning rate changes neither the update's time nor its slots.
      'optimizer_fn': lambda: lingvo_optimizer.GetOptimizer(1e-3),
      'cell_params': list(stack_p.cell_tpl),
      'batch_dim': stack_p.batch_dim,
  }


def _ProfileOutside(params: Any, path: str, batch_size: int, outputs: Any,
                    batch_dim: int, num_warmup: int,
                    num_runs: int) -> Tuple[float, float]:
  """Seconds and bytes of the task's work around the pipeline on a batch.

  Builds the task on `batch_size` examples with its GPipeSequentialLayer
  replaced by fed tensors shaped like its outputs, and times the input, the
  rest of the forward pass, the loss and the gradients of the loss with
  respect to those outputs. Bytes: the most its kernels held at once in a
  FULL_TRACE run (`DevicePeaks`).

  Args:
    params: The model params.
    path: The pipeline's path.
    batch_size: Examples of the replica's batch.
    outputs: The pipeline's outputs on some batch (numpy nest), for shapes.
    batch_dim: The pipeline's batch dimension.
    num_warmup: Untimed runs.
    num_runs: Timed runs (the fastest counts).

  Returns:
    (seconds, bytes).
  """
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  params = params.Copy()
  params.input.batch_size = batch_size
  _SequentialStack(_StackParams(params, path), batch_size)
  graph = tf.Graph()
  feed = {}
  with graph.as_default(), _Cluster(1, 1):
    model = params.Instantiate()
    task = model.GetTask()
    stack = _Child(task, path)

    def Fed(x):
      if x is None:
        return None
      shape = list(np.shape(x))
      shape[batch_dim] = batch_size
      placeholder = tf.compat.v1.placeholder(tf.as_dtype(x.dtype), shape)
      feed[placeholder] = np.zeros(shape, x.dtype)
      return placeholder

    fed = tf.nest.map_structure(Fed, outputs)
    stack.FProp = lambda theta, *args: fed
    metrics, _ = task.FPropDefaultTheta()
    loss = metrics['loss'][0]
    floats = [p for p in feed if p.dtype.is_floating]
    grads = [g for g in tf.gradients(loss, floats) if g is not None]
    # Ops as targets, not tf.group: grappler would prune pure ops that only
    # a NoOp's control inputs need.
    step = [t.op for t in [loss] + grads]
    nothing = tf.no_op()
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(num_warmup):
        sess.run(step, feed_dict=feed)
        sess.run(nothing, feed_dict=feed)
      seconds = []
      for _ in range(num_runs):
        start = time.perf_counter()
        sess.run(nothing, feed_dict=feed)
        middle = time.perf_counter()
        sess.run(step, feed_dict=feed)
        # Beyond a session call with the same feeds (a step pays it once).
        seconds.append(max((time.perf_counter() - middle) - (middle - start),
                           0.0))
      run_metadata = tf.compat.v1.RunMetadata()
      sess.run(step, feed_dict=feed,
               options=tf.compat.v1.RunOptions(
                   trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
               run_metadata=run_metadata)
  peak = sum(d['peak'] for d in DevicePeaks(run_metadata.step_stats).values())
  return float(min(seconds)), peak


def _SequentialStep(params: Any, path: str, batch_size: int, num_warmup: int,
                    num_runs: int) -> float:
  """Seconds of the task's real training step (fastest), on one device.

  The pipeline as one stage of one micro-batch without recompute, on one
  device, `batch_size` examples: what Lingvo's trainer runs (input,
  forward, loss, gradients, gradient clipping, the learner's update,
  counters).

  Args:
    params: The model params.
    path: The pipeline's path.
    batch_size: Examples.
    num_warmup: Untimed steps.
    num_runs: Timed steps.

  Returns:
    Seconds.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  params = params.Copy()
  params.input.batch_size = batch_size
  stack_p = _StackParams(params, path)
  _SequentialStack(stack_p, batch_size)
  graph = tf.Graph()
  with graph.as_default(), _Cluster(1, 1):
    model = params.Instantiate()
    model.ConstructFPropBPropGraph()
    train_op = model.GetTask().train_op
    init_op = tf.compat.v1.global_variables_initializer()
  with tf.compat.v1.Session(graph=graph) as sess:
    sess.run(init_op)
    for _ in range(num_warmup):
      sess.run(train_op)
    seconds = []
    for _ in range(num_runs):
      start = time.perf_counter()
      sess.run(train_op)
      seconds.append(time.perf_counter() - start)
  return min(seconds)


def Profile(config: Dict[str, Any]) -> Dict[str, Any]:
  """Profiles a registered model for the planner.

  Args:
    config: {'model', 'overrides' (applied first), 'batch_size' (B, the
      examples of one step over all replicas; None: the model's
      input.batch_size), 'num_devices' (N: the cells are profiled on the
      micro-batch sizes of `planning.profile.ProfileSizes`, the work around the
      pipeline on its replica batch sizes), 'warmups', 'runs',
      'intra_op_threads'}.

  Returns:
    `planning.profile.Profile.ToJson()` plus 'input_shapes' and
    'output_shapes' (on the profiled batch) and 'profile_s' (seconds).
  """
  start = time.time()
  SetUpTensorFlow(1, config.get('intra_op_threads', 1))
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import tensorflow as tf
  from lingvo_gpipe import profiling
  from lingvo_gpipe.planning import profile as profile_lib
  # pylint: enable=g-import-not-at-top
  params = ModelParams(config['model'], config.get('overrides', ''))
  path, stack_p = FindStack(params.task)
  batch_size = config.get('batch_size') or params.input.batch_size
  params.input.batch_size = batch_size
  stack_settings = {
      name: stack_p.Get(name) for name in (
          'num_stages', 'virtual_stages', 'num_micro_batches',
          'micro_batch_size', 'remat', 'partition', 'schedule', 'engine',
          'batch_dim')
  }
  try:
    sizes, replica_sizes = profile_lib.ProfileSizes(
        batch_size, config.get('num_devices', 1))
  except ValueError as e:
    raise WorkerError(str(e)) from e
  captured = _CaptureStack(params, path, batch_size)
  batch_dim = captured['batch_dim']
  warmups, runs = config.get('warmups', 3), config.get('runs', 15)
  graph = tf.Graph()
  with graph.as_default():
    cells = [p.Copy().Instantiate() for p in captured['cell_params']]
  profiles, _ = profiling.ProfileCells(
      cells, captured['inputs'], batch_dim=batch_dim, micro_batch_sizes=sizes,
      optimizer_fn=captured['optimizer_fn'], num_warmup=warmups,
      num_runs=runs)
  outputs = captured['outputs']
  flat_outputs = [y for y in tf.nest.flatten(outputs) if y is not None]
  loss_inside = len(flat_outputs) == 1 and np.ndim(flat_outputs[0]) == 0
  outside = [
      _ProfileOutside(params, path, b, outputs, batch_dim, warmups, runs)
      for b in replica_sizes
  ]
  # What a real step costs beyond its parts, on the smallest replica batch:
  # the task's real training step with the pipeline on one device, beyond
  # the cells' own costs (the learner's gradient norms and clipping,
  # counters, the session call).
  smallest = replica_sizes[0]
  outside_s = profile_lib.Affine.Fit(replica_sizes, [o[0] for o in outside])
  parts_s = (sum(c.forward_s(smallest) + c.backward_s(smallest) + c.update_s
                 for c in profiles) + outside_s(smallest))
  sequential_s = _SequentialStep(params, path, smallest, warmups, runs)
  overhead_s = max(sequential_s - parts_s, 0.0)
  input_bytes = sum(float(np.asarray(x).nbytes)
                    for x in tf.nest.flatten(captured['inputs'])
                    if x is not None) / batch_size
  profile = profile_lib.Profile(
      cells=tuple(profiles),
      input_bytes=input_bytes,
      batch_size=batch_size,
      loss_inside=loss_inside,
      outside_s=outside_s,
      outside_bytes=profile_lib.Affine.Fit(replica_sizes,
                                           [o[1] for o in outside]),
      model=config['model'],
      stack_path=path,
      step_overhead_s=overhead_s,
      profiled_sizes=tuple(sizes),
      stack_settings=stack_settings)
  result = profile.ToJson()
  result.update(
      input_shapes=[None if x is None else list(np.shape(x))
                    for x in tf.nest.flatten(captured['inputs'])],
      output_shapes=[None if y is None else list(np.shape(y))
                     for y in tf.nest.flatten(outputs)],
      outside_measured={str(b): list(o) for b, o in zip(replica_sizes,
                                                        outside)},
      sequential_step_s={f'b={smallest}': sequential_s},
      sequential_parts_s={f'b={smallest}': parts_s},
      profile_s=time.time() - start)
  return result


def RunWorker(config: Dict[str, Any], root: str,
              env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
  """Runs `python -m benchmarks.plan_worker CONFIG` in `root`; its result.

  Imports no TensorFlow: the caller only orchestrates.

  Args:
    config: The configuration (see `Profile` and `Measure`).
    root: The repository root (the worker's working directory).
    env: The environment (default: `host.WorkerEnvironment()`, whose
      allocator keeps the statistics the peaks are read from).

  Returns:
    The worker's JSON result.

  Raises:
    WorkerError: with the worker's one-line error (or last line) if it fails.
  """
  import subprocess  # pylint: disable=g-import-not-at-top
  if env is None:
    env = host.WorkerEnvironment()
  command = [sys.executable, '-m', 'benchmarks.plan_worker',
             json.dumps(config)]
  proc = subprocess.run(command, cwd=root, env=env, capture_output=True,
                        text=True, check=False)
  for line in proc.stdout.splitlines():
    if line.startswith(runner.RESULT_PREFIX):
      return json.loads(line[len(runner.RESULT_PREFIX):])
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  ours = [l[len(ERROR_PREFIX):] for l in lines if l.startswith(ERROR_PREFIX)]
  errors = [l for l in lines if 'Error' in l.split(':')[0]]
  message = (ours or errors or lines or ['no output'])[-1]
  raise WorkerError(f'{config.get("action")} of {config.get("model")!r} '
                    f'failed (exit {proc.returncode}): {message}')


def Main(argv: Sequence[str]) -> int:
  """Runs the JSON configuration in argv[1]; prints the result line.

  Args:
    argv: [program, configuration JSON] after absl parsed the flags (Lingvo's
      layers read absl flags).

  Returns:
    The exit status: 0, or 2 after printing one error line.
  """
  return runner.WorkerMain(argv, _Act, (WorkerError, runner.BenchmarkError),
                           ERROR_PREFIX)


def _Act(config: Dict[str, Any]) -> Dict[str, Any]:
  """Runs the configuration's action."""
  action = config.get('action')
  if action not in ACTIONS:
    raise WorkerError(f'action={action!r} must be one of {list(ACTIONS)}.')
  return Measure(config) if action == 'measure' else Profile(config)


if __name__ == '__main__':
  app.run(Main)
