"""Measures one configuration: `python -m benchmarks.worker CONFIG`.

CONFIG is the JSON of a `runner.Config`. The worker builds the model's
training step (forward, gradients, SGD update) on `stages` logical CPU
devices, runs a timed first step, the other warm-up steps and `steps`
measured steps, each after a reset of the allocator's peak, and prints one line
`runner.RESULT_PREFIX + JSON` (see `MeasureStep`), or one error line after
`runner.ERROR_PREFIX` with exit status 2.

The peak is `tf.config.experimental.get_memory_info('CPU:0')['peak']`, read
through `host` (the runner gives the worker an allocator that keeps it); on
logical devices it is that of all stages together, whose devices share the
process's allocator. With `processes` the stages run in pinned server
processes (`loopback`) instead, each with an allocator of its own, as each
accelerator has its own memory: the peak is the largest of theirs. There,
as on accelerators, each stage's weights live in its process and the batch
is drawn once, into the first stage's: each step starts with it at hand.
"""

import statistics
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

from absl import app

from benchmarks import host
from benchmarks import loopback
from benchmarks import models
from benchmarks import runner

_LEARNING_RATE = 1e-4
_MIB = 1024.0 * 1024.0


# Reads each allocator of the step's devices: [(peak bytes since the last
# read, bytes held now)], and starts a new peak.
MemoryReader = Callable[[], List[Tuple[int, int]]]


def _ProcessMemory() -> List[Tuple[int, int]]:
  """A `MemoryReader` of this process's allocator (all its logical devices)."""
  return [host.TakeMemoryStats()]


def _TimeSteps(run_step: Callable[[], None], read_memory: MemoryReader,
               config: Dict[str, Any]) -> Dict[str, Any]:
  """Times `warmups` warm-up steps (the first one reported) and `steps` steps.

  Args:
    run_step: Runs one training step to completion.
    read_memory: Reads the allocators the step runs on.
    config: A configuration dict, see `runner.Config`.

  Returns:
    peak_mib (the largest allocator's peak in the step where it is largest),
    peaks_mib (per step), device_peaks_mib (per step, per allocator: one for
    logical devices, one per server with `processes`), resident_mib (held
    between steps, the largest allocator), step_s (median), step_times_s,
    warmup_s (the first step).

  Raises:
    host.MemoryStatsError: if the allocator keeps no statistics.
  """
  start = time.time()
  run_step()
  warmup_s = time.time() - start
  for _ in range(config.get('warmups', 1) - 1):
    run_step()
  resident = [current for _, current in read_memory()]
  device_peaks, times = [], []
  for _ in range(config['steps']):
    start = time.time()
    run_step()
    times.append(time.time() - start)
    memory = read_memory()
    device_peaks.append([peak / _MIB for peak, _ in memory])
    resident += [current for _, current in memory]
  peaks = [max(step) for step in device_peaks]
  return {
      'peak_mib': max(peaks),
      'peaks_mib': peaks,
      'device_peaks_mib': device_peaks,
      'resident_mib': max(resident) / _MIB,
      'step_s': statistics.median(times),
      'step_times_s': times,
      'warmup_s': warmup_s,
  }


def _GraphStep(
    config: Dict[str, Any]
) -> Tuple[float, int, Callable[[], None], MemoryReader]:
  """Builds the TF1 training step on K CPU devices; see `MeasureStep`."""
  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory
  from lingvo.core import py_utils
  import numpy as np
  import tensorflow as tf
  from lingvo_gpipe.engine import channel
  # pylint: enable=g-import-not-at-top
  num_stages = config['stages']
  threads = config.get('intra_op_threads', 0)
  start = time.time()
  graph = tf.Graph()
  if config.get('processes'):
    try:  # They exit with this process.
      servers = loopback.PinnedCluster(num_stages, threads)
    except ValueError as e:
      raise runner.BenchmarkError(
          f'processes=True, stages={num_stages}: {e}') from e
    devices = [servers.Device(k) for k in range(num_stages)]
    read_memory = lambda: [servers.MemoryBytes(k) for k in range(num_stages)]
    sess = tf.compat.v1.Session(servers.target, graph=graph)
    # Stage k on task k; the loops pass tensors between the processes.
    scope = channel.DeviceIncarnations(sess.list_devices())
  else:
    devices = None  # K devices per split: stage k on CPU:k (Lingvo's rule).
    read_memory = _ProcessMemory
    scope = cluster_factory.ForTestingWorker(
        mode='sync', job='trainer_client', cpus=num_stages,
        split_size=num_stages)
    sess = tf.compat.v1.Session(
        graph=graph,
        config=tf.compat.v1.ConfigProto(
            device_count={'CPU': num_stages},
            intra_op_parallelism_threads=threads,
            inter_op_parallelism_threads=max(2, 2 * num_stages) if threads
            else 0))
  with graph.as_default(), scope, tf.device(devices[0] if devices else ''):
    global_step = py_utils.GetOrCreateGlobalStepVar()
    if config.get('processes'):
      # Each stage's weights on its task, the batch drawn once on the first
      # stage's, as accelerators hold them: drawn in the step, the first
      # stage's core would draw it (40 ms at 2048 x 1024) before each step.
      model = models.BuildModelWithWeightsOnStages(config, devices)
      x = tf.Variable(tf.random.normal([config['batch'], config['dim']],
                                       seed=1),
                      trainable=False, name='batch').read_value()
    else:
      model = models.BuildModel(config, devices)
      x = tf.random.normal([config['batch'], config['dim']], seed=1)
    loss = models.Loss(model.FProp(model.theta, x))
    variables = model.vars.Flatten()
    # Like Lingvo's trainer: each gradient op on its forward op's device.
    grads = tf.compat.v1.gradients(
        loss, variables, colocate_gradients_with_ops=True)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(
        _LEARNING_RATE).apply_gradients(
            zip(grads, variables), global_step=global_step)
    init_op = tf.compat.v1.global_variables_initializer()
    num_params = int(sum(np.prod(v.shape.as_list()) for v in variables))
  build_s = time.time() - start
  sess.run(init_op)
  return build_s, num_params, lambda: sess.run(train_op), read_memory


def _FunctionStep(
    config: Dict[str, Any]) -> Tuple[float, int, Callable[[], None]]:
  """Builds the eager training step: GradientTape + update in a tf.function.

  With mode 'xla' the tf.function is compiled by XLA (jit_compile=True).

  Args:
    config: A configuration dict, see `runner.Config`.

  Returns:
    (build_s, num_params, run_step): the time to build the model and trace
    the function, the number of weights, and a function running one step.
  """
  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils
  import numpy as np
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  start = time.time()
  global_step = py_utils.GetOrCreateGlobalStepVar()
  model = models.BuildModel(config)
  variables = model.vars.Flatten()
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(_LEARNING_RATE)

  @tf.function(autograph=False, jit_compile=config['mode'] == 'xla')
  def Step():
    x = tf.random.normal([config['batch'], config['dim']], seed=1)
    with tf.GradientTape() as tape:
      loss = models.Loss(model.FProp(model.theta, x))
    grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables), global_step=global_step)

  # Tracing happens here; graph optimization (or XLA's compile) at the first
  # call. The step is called through the tf.function, the way XLA compiles.
  Step.get_concrete_function()
  build_s = time.time() - start
  num_params = int(sum(np.prod(v.shape.as_list()) for v in variables))
  return build_s, num_params, Step


def MeasureStep(config: Dict[str, Any]) -> Dict[str, Any]:
  """Builds one training step and measures its time and peak memory.

  Runs on `stages` logical CPU devices (or server processes): the first step
  (timed), `warmups` - 1 more warm-up steps, then `steps` steps, each after
  a reset of the allocators' peaks.

  Args:
    config: A configuration dict, see `runner.Config`.

  Returns:
    A JSON-ready dict: peak_mib (largest of the steps), peaks_mib,
    device_peaks_mib, resident_mib (in use between steps: weights,
    optimizer), see `_TimeSteps`; step_s (median), step_times_s, build_s (model, forward, gradients and update;
    in modes 'function' and 'xla' the tracing of the tf.function), warmup_s
    (the first step: graph optimization, or XLA's compile), hlo_lines (mode
    'xla': lines of the step's HLO before XLA's optimizations), num_params,
    tf_version, lingvo_version.

  Raises:
    host.MemoryStatsError: if the allocator keeps no statistics.
  """
  # pylint: disable=g-import-not-at-top
  from importlib import metadata
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  hlo_lines = None
  threads = config.get('intra_op_threads', 0)
  if threads:  # Before TensorFlow creates its thread pools.
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(
        max(2, 2 * config['stages']))
  if config.get('mode', 'graph') == 'graph':
    build_s, num_params, run_step, read_memory = _GraphStep(config)
    result = _TimeSteps(run_step, read_memory, config)
  else:
    # Before anything initializes TensorFlow's devices (Lingvo's imports).
    cpu = tf.config.list_physical_devices('CPU')[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * config['stages'])
    build_s, num_params, run_step = _FunctionStep(config)
    result = _TimeSteps(run_step, _ProcessMemory, config)
    if config['mode'] == 'xla':
      hlo = run_step.experimental_get_compiler_ir()(stage='hlo')
      hlo_lines = len(hlo.splitlines())
  result.update(
      build_s=build_s,
      hlo_lines=hlo_lines,
      num_params=num_params,
      tf_version=tf.__version__,
      lingvo_version=metadata.version('lingvo'))
  return result


def Main(argv: Sequence[str]) -> int:
  """Measures the JSON configuration in argv[1]; prints the result line.

  Args:
    argv: [program, configuration JSON], after absl parsed the flags (Lingvo's
      layers read absl flags).

  Returns:
    The exit status: 0, or 2 after printing one error line.
  """
  return runner.WorkerMain(argv, MeasureStep)


if __name__ == '__main__':
  app.run(Main)
