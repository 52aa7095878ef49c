"""Benchmarks GPipeSequentialLayer against the plain stack and Lingvo's GPipe.

    python tools/benchmark.py memory
    python tools/benchmark.py memory --num_layers=16 --batch=4096 --repeats=3
    python tools/benchmark.py memory --nobudget_search --micro_batches=4,8
    python tools/benchmark.py speed
    python tools/benchmark.py speed --speed_stages=2,4 --speed_micro_batches=8

Subcommands (the first argument that is not a flag):
  memory  Peak memory and step time of one training step (forward,
          tf.gradients, SGD update; TF1 graph and session) of a deep stack of
          Lingvo FCLayers: the plain `builder_layers.SequentialLayer` and
          GPipeSequentialLayer with one stage for every number of
          micro-batches M and re-materialization mode. Then the largest number
          of layers whose step fits a memory budget, plain vs. GPipe.
  speed   Step time, first-step time, graph build time and peak memory of the
          same kind of training step (gradients colocated with their ops, as
          Lingvo's trainer does) on K logical CPU devices (one per stage,
          placed by Lingvo's cluster model split) for every K in
          --speed_stages and M in --speed_micro_batches: GPipeSequentialLayer
          (remat='always'), Lingvo's gpipe.PipeliningLayer (which always
          recomputes) and GPipeSequentialLayer in an eager tf.function
          (GradientTape), plus the plain SequentialLayer and GPipe with
          remat='never' at K=1, M=1 as references. Unless given, its flags
          default to --num_layers=16 --batch=2048 --steps=5 --repeats=2.

Every configuration runs in a fresh subprocess of this script (the internal
subcommand `_measure`), so allocator peaks never leak from one configuration
into the next. The peak is `tf.config.experimental.get_memory_info('CPU:0')`
after `reset_memory_stats`, measured on the steps after a warm-up step. These
statistics need oneDNN's allocator (TensorFlow's default on x86): a
TF_ENABLE_ONEDNN_OPTS=0 in the environment is removed for the subprocesses.
Timings on a shared machine are noisy: repetitions (--repeats) run
interleaved and the median is reported.
"""

import concurrent.futures
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import flags

import cli  # tools/cli.py

FLAGS = flags.FLAGS

flags.DEFINE_integer(
    'num_layers', 32, 'Number of Lingvo FCLayer cells (dim -> dim, ReLU) in '
    'the model (speed: 16 unless given).', lower_bound=1)
flags.DEFINE_integer(
    'dim', 256, 'Input and output dimension of every FCLayer. Small against '
    '--batch so that activations, not weights, dominate memory.',
    lower_bound=1)
flags.DEFINE_integer(
    'batch', 16384, 'Mini-batch size of the training step; must be divisible '
    'by every --micro_batches value and by --budget_micro_batches (speed: '
    'by every --speed_micro_batches value; 2048 unless given).',
    lower_bound=1)
flags.DEFINE_list(
    'micro_batches', ['1', '4', '8'], 'Comma-separated numbers of '
    'micro-batches M to measure GPipe with (one stage, K = 1).')
flags.DEFINE_list(
    'remat', ['always', 'except_last', 'never'], 'Comma-separated '
    're-materialization modes to measure GPipe with: always, except_last, '
    'never.')
flags.DEFINE_integer(
    'steps', 3, 'Measured training steps per configuration, after one '
    'warm-up step (speed: 5 steps after 2 warm-ups unless given). Peak memory '
    'is the largest of their peaks, step time the median.', lower_bound=1)
flags.DEFINE_integer(
    'repeats', 1, 'How many times every configuration of the table runs (each '
    'in a fresh subprocess, interleaved with the others); the table shows '
    'medians (speed: 2 unless given).', lower_bound=1)
flags.DEFINE_integer(
    'parallel', 1, 'How many measuring subprocesses run at once. Keep 1 for '
    'meaningful step times; peaks stay per process, so more only makes '
    'timings worse and the run faster.', lower_bound=1)
flags.DEFINE_bool(
    'budget_search', True, 'Whether to search the largest number of layers '
    'that trains within --budget_mib, plain vs. GPipe.')
flags.DEFINE_float(
    'budget_mib', None, 'Memory budget in MiB for the largest-model search: '
    'the peak of one training step must not exceed it. Default: half the '
    "plain model's peak in the table.", lower_bound=0.0)
flags.DEFINE_integer(
    'budget_micro_batches', 8, 'M of the GPipe model in the largest-model '
    "search (one stage, remat='always').", lower_bound=1)
flags.DEFINE_integer(
    'budget_max_layers', 256, 'Upper bound of the largest-model search: '
    'larger models are not tried (the result is then reported as capped).',
    lower_bound=1)
flags.DEFINE_list(
    'speed_stages', ['1', '2', '4'], 'speed: comma-separated numbers of '
    'pipeline stages K (= logical CPU devices) to measure.')
flags.DEFINE_list(
    'speed_micro_batches', ['1', '4', '8', '16'], 'speed: comma-separated '
    'numbers of micro-batches M to measure with every K.')

_WORKER = '_measure'
_RESULT_PREFIX = 'BENCHMARK_RESULT '
_REMAT_MODES = ('always', 'except_last', 'never')
_LEARNING_RATE = 1e-4
_MIB = 1024.0 * 1024.0
_PAPER_RATIO = 318.0 / 82.0
# TensorFlow's C++ log lines ('I0000 00:00:...', 'E1202 17:44:56...').
_TF_LOG_LINE = re.compile(r'^([IWEF]\d{4} |WARNING: All log messages)')


class BenchmarkError(ValueError):
  """A bad flag or a failed measurement; main prints it on one line."""


# ---------------------------------------------------------------------------
# The measuring subprocess.


def _Cells(config: Dict[str, Any]) -> List[Any]:
  """The Params of the model's FCLayer cells (dim -> dim, ReLU)."""
  # pylint: disable=g-import-not-at-top
  from lingvo.core import layers
  from lingvo.core import py_utils
  # pylint: enable=g-import-not-at-top
  dim = config['dim']
  # He initialization keeps the ReLU activations' scale through deep stacks.
  init = py_utils.WeightInit.Gaussian(math.sqrt(2.0 / dim))
  return [
      layers.FCLayer.Params().Set(
          name=f'fc{i}', input_dim=dim, output_dim=dim, params_init=init)
      for i in range(config['num_layers'])
  ]


def _UniformSplit(num_cells: int, num_stages: int) -> List[int]:
  """Cells per stage: equal counts, the first stages get one more."""
  base, extra = divmod(num_cells, num_stages)
  return [base + (k < extra) for k in range(num_stages)]


def _BuildModel(config: Dict[str, Any]):
  """Instantiates the configuration's model (in a graph or eagerly).

  Args:
    config: A configuration dict, see `_Config`.

  Returns:
    A Lingvo layer: builder_layers.SequentialLayer (plain),
    GPipeSequentialLayer (gpipe, gpipe_function) or gpipe.PipeliningLayer
    (lingvo).
  """
  # pylint: disable=g-import-not-at-top
  from lingvo.core import builder_layers
  from lingvo.core import gpipe
  from lingvo_gpipe import GPipeSequentialLayer
  # pylint: enable=g-import-not-at-top
  cells = _Cells(config)
  num_stages = config['stages']
  if config['model'] == 'plain':
    params = builder_layers.SequentialLayer.Params().Set(name='model',
                                                         sub=cells)
  elif config['model'] == 'lingvo':
    stages, start = [], 0
    for k, count in enumerate(_UniformSplit(len(cells), num_stages)):
      stages.append(gpipe.FeatureExtractionLayer.Params().Set(
          name=f'stage{k}', sub=cells[start:start + count]))
      start += count
    params = gpipe.PipeliningLayer.Params().Set(
        name='model',
        cell_tpl=stages,
        num_micro_batches=config['micro_batches'])
  else:
    devices = None
    if config['model'] == 'gpipe_function':
      devices = [f'/device:CPU:{k}' for k in range(num_stages)]
    params = GPipeSequentialLayer.Params().Set(
        name='model',
        cell_tpl=cells,
        num_stages=num_stages,
        num_micro_batches=config['micro_batches'],
        remat=config['remat'],
        devices=devices)
  return params.Instantiate()


def _Loss(y):
  """The scalar loss of the model's output (a tensor or a 1-tuple)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if isinstance(y, (list, tuple)):
    (y,) = y
  return tf.reduce_mean(tf.square(y))


def _TimeSteps(run_step: Callable[[], None],
               config: Dict[str, Any]) -> Dict[str, Any]:
  """Times `warmups` warm-up steps (the first one reported) and `steps` steps.

  Args:
    run_step: Runs one training step to completion.
    config: A configuration dict, see `_Config`.

  Returns:
    peak_mib, peaks_mib, resident_mib, step_s (median), step_times_s,
    warmup_s (the first step).

  Raises:
    BenchmarkError: if the allocator keeps no statistics.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  start = time.time()
  run_step()
  warmup_s = time.time() - start
  for _ in range(config.get('warmups', 1) - 1):
    run_step()
  peaks, resident, times = [], [], []
  for _ in range(config['steps']):
    try:
      tf.config.experimental.reset_memory_stats('CPU:0')
      resident.append(
          tf.config.experimental.get_memory_info('CPU:0')['current'])
    except ValueError as e:
      raise BenchmarkError(
          f'{e}: memory statistics need oneDNN\'s allocator; do not set '
          'TF_ENABLE_ONEDNN_OPTS=0.') from e
    start = time.time()
    run_step()
    times.append(time.time() - start)
    peaks.append(tf.config.experimental.get_memory_info('CPU:0')['peak'])
  return {
      'peak_mib': max(peaks) / _MIB,
      'peaks_mib': [p / _MIB for p in peaks],
      'resident_mib': max(resident) / _MIB,
      'step_s': statistics.median(times),
      'step_times_s': times,
      'warmup_s': warmup_s,
  }


def _GraphStep(config: Dict[str, Any]) -> Tuple[float, int, Callable[[], None]]:
  """Builds the TF1 training step on K CPU devices; see `MeasureStep`."""
  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory
  from lingvo.core import py_utils
  import numpy as np
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  num_stages = config['stages']
  start = time.time()
  graph = tf.Graph()
  # K devices per split: Lingvo's layers place stage k on CPU:k.
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=num_stages,
      split_size=num_stages)
  with graph.as_default(), cluster:
    global_step = py_utils.GetOrCreateGlobalStepVar()
    model = _BuildModel(config)
    x = tf.random.normal([config['batch'], config['dim']], seed=1)
    loss = _Loss(model.FProp(model.theta, x))
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
  sess = tf.compat.v1.Session(
      graph=graph,
      config=tf.compat.v1.ConfigProto(device_count={'CPU': num_stages}))
  sess.run(init_op)
  return build_s, num_params, lambda: sess.run(train_op)


def _FunctionStep(
    config: Dict[str, Any]) -> Tuple[float, int, Callable[[], None]]:
  """Builds the eager training step: GradientTape + update in a tf.function."""
  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils
  import numpy as np
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  start = time.time()
  global_step = py_utils.GetOrCreateGlobalStepVar()
  model = _BuildModel(config)
  variables = model.vars.Flatten()
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(_LEARNING_RATE)

  @tf.function(autograph=False)
  def Step():
    x = tf.random.normal([config['batch'], config['dim']], seed=1)
    with tf.GradientTape() as tape:
      loss = _Loss(model.FProp(model.theta, x))
    grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables), global_step=global_step)

  # Tracing (and graph optimization at the first call) happens here.
  step = Step.get_concrete_function()
  build_s = time.time() - start
  num_params = int(sum(np.prod(v.shape.as_list()) for v in variables))
  return build_s, num_params, step


def MeasureStep(config: Dict[str, Any]) -> Dict[str, Any]:
  """Builds one training step and measures its time and peak memory.

  Runs in the `_measure` subprocess, on `stages` logical CPU devices: the
  first step (timed), `warmups` - 1 more warm-up steps, then `steps` steps,
  each after `reset_memory_stats('CPU:0')`.

  Args:
    config: A configuration dict, see `_Config`.

  Returns:
    A JSON-ready dict: peak_mib (largest of the steps), peaks_mib,
    resident_mib (in use before the step: weights, optimizer), step_s
    (median), step_times_s, build_s (model, forward, gradients and update;
    for gpipe_function the tracing of the tf.function), warmup_s (the first
    step), num_params, tf_version, lingvo_version.

  Raises:
    BenchmarkError: if the allocator keeps no statistics.
  """
  # Imported here: the parent process only orchestrates subprocesses and
  # should not spend seconds importing TensorFlow and Lingvo.
  # pylint: disable=g-import-not-at-top
  from importlib import metadata
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  if config['model'] == 'gpipe_function':
    # Before anything initializes TensorFlow's devices (Lingvo's imports).
    cpu = tf.config.list_physical_devices('CPU')[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * config['stages'])
    build_s, num_params, run_step = _FunctionStep(config)
  else:
    build_s, num_params, run_step = _GraphStep(config)
  result = _TimeSteps(run_step, config)
  result.update(
      build_s=build_s,
      num_params=num_params,
      tf_version=tf.__version__,
      lingvo_version=metadata.version('lingvo'))
  return result


def _Worker(args: Sequence[str]) -> None:
  """The `_measure` subcommand: measures the JSON config in args[0]."""
  if len(args) != 1:
    raise BenchmarkError(f'{_WORKER} takes one JSON configuration, got '
                         f'{list(args)}.')
  result = MeasureStep(json.loads(args[0]))
  print(_RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------
# The parent process: configurations, subprocesses, the budget search.


def _Config(model: str,
            num_layers: int,
            steps: int,
            micro_batches: Optional[int] = None,
            remat: Optional[str] = None,
            stages: int = 1,
            warmups: int = 1,
            batch: Optional[int] = None) -> Dict[str, Any]:
  """A configuration to measure.

  Args:
    model: 'plain', 'gpipe', 'lingvo' (gpipe.PipeliningLayer) or
      'gpipe_function' (GPipe in an eager tf.function).
    num_layers: Number of FCLayers.
    steps: Measured steps after the warm-up steps.
    micro_batches: M (not plain).
    remat: Re-materialization mode (gpipe and gpipe_function only).
    stages: K, the number of stages and logical CPU devices.
    warmups: Warm-up steps (the first one is timed as the first step).
    batch: The mini-batch size; None: --batch.

  Returns:
    A JSON-ready dict; dim (and batch) come from the flags.
  """
  return {
      'model': model,
      'num_layers': num_layers,
      'dim': FLAGS.dim,
      'batch': FLAGS.batch if batch is None else batch,
      'micro_batches': micro_batches,
      'remat': remat,
      'stages': stages,
      'steps': steps,
      'warmups': warmups,
  }


def _Name(config: Dict[str, Any]) -> str:
  """A short name, e.g. 'plain', 'gpipe K=1 M=8 always' or 'lingvo K=2 M=4'."""
  model = config['model']
  if model == 'plain':
    return 'plain'
  shape = f'K={config.get("stages", 1)} M={config["micro_batches"]}'
  if model == 'lingvo':
    return f'lingvo {shape}'
  prefix = 'gpipe' if model == 'gpipe' else 'gpipe tf.function'
  return f'{prefix} {shape} {config["remat"]}'


def _WorkerEnv() -> Dict[str, str]:
  """The environment of the measuring subprocesses."""
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env['PYTHONPATH'] = os.pathsep.join(
      [root] + [p for p in [env.get('PYTHONPATH')] if p])
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  if env.get('TF_ENABLE_ONEDNN_OPTS') == '0':
    print('benchmark.py: note: ignoring TF_ENABLE_ONEDNN_OPTS=0; memory '
          "statistics need oneDNN's allocator.", file=sys.stderr)
    del env['TF_ENABLE_ONEDNN_OPTS']
  return env


class _Runner:
  """Runs configurations in fresh subprocesses, at most `parallel` at once."""

  def __init__(self, parallel: int):
    self.parallel = parallel
    self._slots = threading.Semaphore(parallel)
    self._env = _WorkerEnv()
    self._lock = threading.Lock()
    self.num_runs = 0

  def Run(self, config: Dict[str, Any]) -> Dict[str, Any]:
    """Measures `config` in a subprocess.

    Args:
      config: A configuration dict, see `_Config`.

    Returns:
      The dict of `MeasureStep`.

    Raises:
      BenchmarkError: if the subprocess fails.
    """
    command = [
        sys.executable,
        os.path.abspath(__file__), _WORKER,
        json.dumps(config)
    ]
    with self._slots:
      proc = subprocess.run(
          command, env=self._env, capture_output=True, text=True, check=False)
    with self._lock:
      self.num_runs += 1
    for line in proc.stdout.splitlines():
      if line.startswith(_RESULT_PREFIX):
        result = json.loads(line[len(_RESULT_PREFIX):])
        print(f'  {_Name(config)}, {config["num_layers"]} layers: peak '
              f'{result["peak_mib"]:.1f} MiB, step {result["step_s"]:.2f} s',
              file=sys.stderr, flush=True)
        return result
    # Our own one-line error, else the last line (a traceback's exception),
    # skipping TensorFlow's log lines such as 'E0000 ... failed call to cuInit'.
    lines = [
        l for l in proc.stderr.splitlines()
        if l.strip() and not _TF_LOG_LINE.match(l)
    ]
    ours = [l for l in lines if l.startswith('benchmark.py: error:')]
    message = (ours or lines or ['no output'])[-1]
    raise BenchmarkError(
        f'measuring {_Name(config)} with {config["num_layers"]} layers failed '
        f'(exit {proc.returncode}): {message}')


def MeasureTable(runner: _Runner, configs: List[Dict[str, Any]],
                 repeats: int) -> List[Dict[str, Any]]:
  """Measures every configuration `repeats` times, interleaved.

  Repeat r runs the configurations in order, every odd repeat in reverse, so
  slow phases of a shared machine spread over all of them.

  Args:
    runner: Runs one configuration.
    configs: The configurations.
    repeats: Runs per configuration.

  Returns:
    One row per configuration: the config, medians of peak_mib, step_s and
    resident_mib over the repeats, and every run.
  """
  jobs = []
  for r in range(repeats):
    order = range(len(configs)) if r % 2 == 0 else reversed(range(
        len(configs)))
    jobs.extend(order)
  # A FIFO pool keeps the interleaved order when runs go one at a time.
  with concurrent.futures.ThreadPoolExecutor(runner.parallel) as pool:
    futures = [(i, pool.submit(runner.Run, configs[i])) for i in jobs]
    runs = [[] for _ in configs]
    for i, future in futures:
      runs[i].append(future.result())
  rows = []
  for config, config_runs in zip(configs, runs):
    row = {'name': _Name(config), 'config': config, 'runs': config_runs}
    for key in ('peak_mib', 'step_s', 'resident_mib', 'build_s', 'warmup_s'):
      row[key] = statistics.median(run[key] for run in config_runs)
    row['num_params'] = config_runs[0]['num_params']
    rows.append(row)
  return rows


def _NextProbe(points: Dict[int, float], budget: float, lo: int, hi: int,
               bisect: bool, open_above: bool) -> int:
  """The next number of layers to try in `LargestUnderBudget`.

  Peak memory grows about linearly with the number of layers, so the next
  probe is where the line through the measured points nearest the budget
  meets it (with one point: a line through the origin), clamped into the open
  interval (lo, hi) and, while no model is known to fail, to at most 4 lo
  (galloping, so a convex curve cannot send the search to the bound);
  `bisect` halves the interval instead.

  Args:
    points: Measured {num_layers: peak MiB}.
    budget: The budget in MiB.
    lo: The largest number of layers known to fit (0: none).
    hi: The smallest number known not to fit (or the search bound + 1).
    bisect: Whether to bisect instead of interpolating.
    open_above: Whether no probed model above lo failed (hi is the bound).

  Returns:
    An int in (lo, hi).
  """
  if bisect:
    return (lo + hi) // 2
  nearest = sorted(points, key=lambda n: abs(points[n] - budget))[:2]
  if len(nearest) == 2 and points[nearest[0]] != points[nearest[1]]:
    (n0, p0), (n1, p1) = [(n, points[n]) for n in nearest]
    guess = n0 + (budget - p0) * (n1 - n0) / (p1 - p0)
  elif nearest:
    guess = nearest[0] * budget / max(points[nearest[0]], 1e-9)
  else:
    guess = lo + 1
  if open_above and lo > 0:
    guess = min(guess, 4 * lo)
  return min(max(int(math.floor(guess)), lo + 1), hi - 1)


def LargestUnderBudget(measure: Callable[[int], float], budget: float,
                       max_layers: int,
                       known: Dict[int, float]) -> Tuple[int, Dict[int, float]]:
  """The largest number of layers whose peak stays within `budget`.

  Safeguarded interpolation: each probe is the linear estimate of where the
  peak reaches the budget; if a probe fails to halve the bracket, the next one
  bisects, so the search takes O(log max_layers) probes at worst and about
  three when memory is linear in the number of layers.

  Args:
    measure: Maps a number of layers to the peak MiB of one training step.
    budget: The budget in MiB.
    max_layers: Larger models are not tried.
    known: Already measured {num_layers: peak MiB}, used as free probes.

  Returns:
    (num_layers, points): the answer (0 if even one layer does not fit) and
    every {num_layers: peak MiB} known at the end.
  """
  points = dict(known)
  width, bisect = None, False
  while True:
    lo = min(max((n for n, p in points.items() if p <= budget), default=0),
             max_layers)
    fails = [n for n, p in points.items() if p > budget]
    hi = min(fails + [max_layers + 1])
    if hi - lo <= 1:
      return lo, points
    # Bisect when the last interpolated probe did not halve a closed bracket.
    closed = bool(fails) and lo > 0
    bisect = (closed and not bisect and width is not None and
              hi - lo > width / 2)
    width = hi - lo if closed else None
    n = _NextProbe(points, budget, lo, hi, bisect, open_above=not fails)
    points[n] = measure(n)


def _Search(runner: _Runner, config_fn: Callable[[int], Dict[str, Any]],
            budget: float, known: Dict[int, float]) -> Dict[str, Any]:
  """Runs `LargestUnderBudget` for one model; returns a JSON-ready dict."""
  results = {}

  def Measure(num_layers: int) -> float:
    results[num_layers] = runner.Run(config_fn(num_layers))
    return results[num_layers]['peak_mib']

  num_layers, points = LargestUnderBudget(Measure, budget,
                                          FLAGS.budget_max_layers, known)
  config = config_fn(num_layers) if num_layers else None
  return {
      'name': _Name(config_fn(1)),
      'num_layers': num_layers,
      'num_params': num_layers * (FLAGS.dim * FLAGS.dim + FLAGS.dim),
      'peak_mib': points.get(num_layers),
      'capped': num_layers == FLAGS.budget_max_layers,
      'config': config,
      'probes': {str(n): p for n, p in sorted(points.items())},
      'probe_runs': {str(n): r for n, r in sorted(results.items())},
  }


def _Ratio(a: float, b: float) -> Optional[float]:
  return a / b if b else None


def _FormatRatio(ratio: Optional[float]) -> str:
  return 'n/a' if ratio is None else f'{ratio:.2f}'


def FormatTable(rows: List[Dict[str, Any]]) -> str:
  """The memory table: one fixed-width line per configuration.

  Args:
    rows: Rows of `MeasureTable`, the plain model first, with peak_ratio and
      step_ratio set.

  Returns:
    The table as text, header first.
  """
  lines = [
      f'{"model":<26}{"peak MiB":>10}{"x plain":>9}{"step s":>9}'
      f'{"x plain":>9}',
  ]
  lines.append('-' * len(lines[0]))
  for row in rows:
    lines.append(f'{row["name"]:<26}{row["peak_mib"]:>10.1f}'
                 f'{_FormatRatio(row["peak_ratio"]):>9}{row["step_s"]:>9.2f}'
                 f'{_FormatRatio(row["step_ratio"]):>9}')
  return '\n'.join(lines)


def FormatBudget(budget: Dict[str, Any]) -> str:
  """The budget search's result as text."""
  lines = [f'Largest model within {budget["budget_mib"]:.1f} MiB (one '
           f'training step, dim {FLAGS.dim}, batch {FLAGS.batch}):']
  for result in (budget['plain'], budget['gpipe']):
    peak = result['peak_mib']
    peak = f'{peak:.1f} MiB' if peak is not None else '-'
    capped = ' (capped by --budget_max_layers)' if result['capped'] else ''
    lines.append(f'  {result["name"]:<24}{result["num_layers"]:>5} layers '
                 f'{result["num_params"] / 1e6:>8.2f}M params  peak '
                 f'{peak}{capped}')
  ratio = budget['layer_ratio']
  lines.append(
      '  gpipe / plain: ' + (f'{ratio:.2f}x' if ratio else 'n/a') +
      f' layers and parameters (target >= 3.5x; GPipe paper 318M/82M = '
      f'{_PAPER_RATIO:.1f}x)')
  return '\n'.join(lines)


def _CheckMemoryFlags() -> Tuple[List[int], List[str]]:
  """Validates the memory flags; returns (micro-batch counts, remat modes)."""
  micro_batches = []
  for v in FLAGS.micro_batches:
    if not v.strip().isdigit() or int(v) < 1:
      raise BenchmarkError(f'--micro_batches={",".join(FLAGS.micro_batches)}:'
                           f' {v!r} is not a positive int.')
    micro_batches.append(int(v))
  for v in FLAGS.remat:
    if v not in _REMAT_MODES:
      raise BenchmarkError(f'--remat={",".join(FLAGS.remat)}: {v!r} is not '
                           f'one of {list(_REMAT_MODES)}.')
  checks = [('micro_batches', m) for m in micro_batches]
  if FLAGS.budget_search:
    checks.append(('budget_micro_batches', FLAGS.budget_micro_batches))
  for flag, m in checks:
    if FLAGS.batch % m:
      raise BenchmarkError(f'--{flag}: M={m} does not divide --batch='
                           f'{FLAGS.batch}; use a divisor of the batch.')
  if FLAGS.budget_mib is not None and FLAGS.budget_mib <= 0:
    raise BenchmarkError(f'--budget_mib={FLAGS.budget_mib} must be positive.')
  return micro_batches, list(FLAGS.remat)


def Memory(args: Sequence[str]) -> Dict[str, Any]:
  """The `memory` subcommand: prints the table and budget result.

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict with the flags, versions, rows and budget search.

  Raises:
    BenchmarkError: on bad flags or a failed measurement.
  """
  if args:
    raise BenchmarkError(f'memory takes no positional arguments, got '
                         f'{list(args)}.')
  micro_batches, remats = _CheckMemoryFlags()
  start = time.time()
  runner = _Runner(FLAGS.parallel)
  configs = [_Config('plain', FLAGS.num_layers, FLAGS.steps)]
  configs += [
      _Config('gpipe', FLAGS.num_layers, FLAGS.steps, m, remat)
      for remat in remats
      for m in micro_batches
  ]
  print(f'Measuring {len(configs)} configurations x {FLAGS.repeats} '
        'repeats, each in a subprocess...', file=sys.stderr, flush=True)
  rows = MeasureTable(runner, configs, FLAGS.repeats)
  plain = rows[0]
  for row in rows:
    row['peak_ratio'] = _Ratio(row['peak_mib'], plain['peak_mib'])
    row['step_ratio'] = _Ratio(row['step_s'], plain['step_s'])
  print(f'One training step of {FLAGS.num_layers} FCLayers, dim {FLAGS.dim}, '
        f'batch {FLAGS.batch} (median of {FLAGS.repeats} runs, '
        f'{FLAGS.steps} steps each):')
  print(FormatTable(rows))
  print()
  first = rows[0]['runs'][0]
  numbers = {
      'subcommand': 'memory',
      'flags': {
          name: FLAGS[name].value for name in (
              'num_layers', 'dim', 'batch', 'micro_batches', 'remat',
              'steps', 'repeats', 'parallel', 'budget_search', 'budget_mib',
              'budget_micro_batches', 'budget_max_layers', 'json_out')
      },
      'tf_version': first['tf_version'],
      'lingvo_version': first['lingvo_version'],
      'rows': rows,
      'budget': None,
  }
  if FLAGS.budget_search:
    budget = (FLAGS.budget_mib if FLAGS.budget_mib is not None else
              plain['peak_mib'] / 2)
    gpipe_m = FLAGS.budget_micro_batches
    known = {
        'plain': {FLAGS.num_layers: plain['peak_mib']},
        'gpipe': {
            FLAGS.num_layers: row['peak_mib'] for row in rows[1:]
            if row['config']['micro_batches'] == gpipe_m and
            row['config']['remat'] == 'always'
        },
    }
    config_fns = {
        'plain': lambda n: _Config('plain', n, 1),
        'gpipe': lambda n: _Config('gpipe', n, 1, gpipe_m, 'always'),
    }
    print(f'Searching the largest models within {budget:.1f} MiB...',
          file=sys.stderr, flush=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      futures = {
          name: pool.submit(_Search, runner, config_fns[name], budget,
                            known[name]) for name in ('plain', 'gpipe')
      }
      results = {name: f.result() for name, f in futures.items()}
    numbers['budget'] = dict(
        budget_mib=budget,
        layer_ratio=_Ratio(results['gpipe']['num_layers'],
                           results['plain']['num_layers']),
        param_ratio=_Ratio(results['gpipe']['num_params'],
                           results['plain']['num_params']),
        **results)
    print(FormatBudget(numbers['budget']))
    print()
  numbers['subprocesses'] = runner.num_runs
  numbers['total_s'] = time.time() - start
  print(f'{runner.num_runs} subprocesses, {numbers["total_s"]:.0f} s.')
  return numbers


# ---------------------------------------------------------------------------
# The speed subcommand.

# Defaults of the speed subcommand for shared flags the user did not give:
# a step of about 0.1-0.5 s on 2 cores, so that the whole run stays short.
_SPEED_DEFAULTS = {'num_layers': 16, 'batch': 2048, 'steps': 5, 'repeats': 2}
_SPEED_WARMUPS = 2


def _SpeedFlag(name: str) -> Any:
  """The flag's value if given on the command line, else speed's default."""
  return FLAGS[name].value if FLAGS[name].present else _SPEED_DEFAULTS[name]


def _PositiveInts(name: str) -> List[int]:
  """The list flag `name` as positive ints, or a BenchmarkError."""
  values = []
  for v in FLAGS[name].value:
    if not v.strip().isdigit() or int(v) < 1:
      raise BenchmarkError(f'--{name}={",".join(FLAGS[name].value)}: {v!r} is '
                           'not a positive int.')
    values.append(int(v))
  return values


def _FormatSpeedTable(rows: List[Dict[str, Any]]) -> str:
  """The speed table: one line per (K, M); see `Speed`."""

  def Num(value: Optional[float], width: int, digits: int) -> str:
    return f'{"n/a":>{width}}' if value is None else f'{value:>{width}.{digits}f}'

  columns = [('K', 3), ('M', 4), ('ours s', 8), ('Lingvo s', 9),
             ('ours/Lingvo', 12), ('ours/plain', 11), ('ours build', 11),
             ('Lingvo build', 13), ('build ratio', 12), ('tf.fn s', 9),
             ('ours MiB', 9), ('Lingvo MiB', 11), ('tf.fn MiB', 10)]
  lines = [''.join(f'{name:>{width}}' for name, width in columns)]
  lines.append('-' * len(lines[0]))
  for row in rows:
    ours, lingvo, func = row['gpipe'], row['lingvo'], row['gpipe_function']
    lines.append(
        f'{row["stages"]:>3}{row["micro_batches"]:>4}'
        f'{Num(ours["step_s"], 8, 3)}{Num(lingvo["step_s"], 9, 3)}'
        f'{Num(row["step_ratio_lingvo"], 12, 2)}'
        f'{Num(row["step_ratio_plain"], 11, 2)}'
        f'{Num(ours["build_s"], 11, 2)}{Num(lingvo["build_s"], 13, 2)}'
        f'{Num(row["build_ratio_lingvo"], 12, 2)}{Num(func["step_s"], 9, 3)}'
        f'{Num(ours["peak_mib"], 9, 1)}{Num(lingvo["peak_mib"], 11, 1)}'
        f'{Num(func["peak_mib"], 10, 1)}')
  return '\n'.join(lines)


def _Summary(row: Dict[str, Any]) -> Dict[str, Any]:
  """The medians of one measured configuration (a `MeasureTable` row)."""
  return {
      key: row[key]
      for key in ('name', 'step_s', 'warmup_s', 'build_s', 'peak_mib',
                  'resident_mib')
  }


def Speed(args: Sequence[str]) -> Dict[str, Any]:
  """The `speed` subcommand: ours vs. Lingvo's GPipe for every (K, M).

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict with the flags, versions, one row per (K, M), the plain
    and remat='never' references and every measurement.

  Raises:
    BenchmarkError: on bad flags or a failed measurement.
  """
  if args:
    raise BenchmarkError(f'speed takes no positional arguments, got '
                         f'{list(args)}.')
  num_layers, batch, steps, repeats = (
      _SpeedFlag(name) for name in ('num_layers', 'batch', 'steps', 'repeats'))
  stages = _PositiveInts('speed_stages')
  micro_batches = _PositiveInts('speed_micro_batches')
  for k in stages:
    if k > num_layers:
      raise BenchmarkError(f'--speed_stages: K={k} is more than '
                           f'--num_layers={num_layers}; every stage needs a '
                           'cell.')
  for m in micro_batches:
    if batch % m:
      raise BenchmarkError(f'--speed_micro_batches: M={m} does not divide '
                           f'--batch={batch}; use a divisor of the batch.')
  start = time.time()
  runner = _Runner(FLAGS.parallel)

  def Config(model, k=1, m=1, remat=None):
    return _Config(model, num_layers, steps, m, remat, stages=k,
                   warmups=_SPEED_WARMUPS, batch=batch)

  configs = [Config('plain', m=None), Config('gpipe', remat='never')]
  shapes = [(k, m) for k in stages for m in micro_batches]
  for k, m in shapes:
    configs += [
        Config('gpipe', k, m, 'always'),
        Config('lingvo', k, m),
        Config('gpipe_function', k, m, 'always')
    ]
  print(f'Measuring {len(configs)} configurations x {repeats} rounds, each '
        'in a subprocess...', file=sys.stderr, flush=True)
  measured = MeasureTable(runner, configs, repeats)
  plain, never = measured[0], measured[1]
  rows = []
  for i, (k, m) in enumerate(shapes):
    ours, lingvo, func = measured[2 + 3 * i:5 + 3 * i]
    rows.append({
        'stages': k,
        'micro_batches': m,
        'gpipe': _Summary(ours),
        'lingvo': _Summary(lingvo),
        'gpipe_function': _Summary(func),
        'step_ratio_lingvo': _Ratio(ours['step_s'], lingvo['step_s']),
        'step_ratio_plain': _Ratio(ours['step_s'], plain['step_s']),
        'build_ratio_lingvo': _Ratio(ours['build_s'], lingvo['build_s']),
        'examples_per_s': {
            name: _Ratio(batch, row['step_s'])
            for name, row in (('gpipe', ours), ('lingvo', lingvo),
                              ('gpipe_function', func))
        },
    })
  print(f'One training step of {num_layers} FCLayers, dim {FLAGS.dim}, batch '
        f'{batch} on K logical CPU devices (median of {repeats} rounds x '
        f'{steps} steps; ours: remat=always):')
  print(f'  plain SequentialLayer: step {plain["step_s"]:.3f} s '
        f'({batch / plain["step_s"]:.0f} examples/s), build '
        f'{plain["build_s"]:.2f} s, peak {plain["peak_mib"]:.1f} MiB')
  print(f'  ours K=1 M=1 remat=never: step {never["step_s"]:.3f} s = '
        f'{_FormatRatio(_Ratio(never["step_s"], plain["step_s"]))}x plain, '
        f'build {never["build_s"]:.2f} s, peak {never["peak_mib"]:.1f} MiB')
  print(_FormatSpeedTable(rows))
  print()
  first = plain['runs'][0]
  numbers = {
      'subcommand': 'speed',
      'flags': {
          'num_layers': num_layers, 'dim': FLAGS.dim, 'batch': batch,
          'steps': steps, 'warmups': _SPEED_WARMUPS, 'repeats': repeats,
          'speed_stages': stages, 'speed_micro_batches': micro_batches,
          'parallel': FLAGS.parallel, 'json_out': FLAGS.json_out,
      },
      'tf_version': first['tf_version'],
      'lingvo_version': first['lingvo_version'],
      'plain': _Summary(plain),
      'gpipe_never': dict(
          _Summary(never), step_ratio_plain=_Ratio(never['step_s'],
                                                   plain['step_s'])),
      'rows': rows,
      'measurements': measured,
      'subprocesses': runner.num_runs,
      'total_s': time.time() - start,
  }
  print(f'{runner.num_runs} subprocesses, {numbers["total_s"]:.0f} s.')
  return numbers


# Subcommand name -> function(positional args) -> JSON-ready dict (or None).
SUBCOMMANDS: Dict[str, Callable[[Sequence[str]], Optional[Dict[str, Any]]]] = {
    'memory': Memory,
    'speed': Speed,
    _WORKER: _Worker,
}

if __name__ == '__main__':
  cli.Run('benchmark.py', SUBCOMMANDS, (BenchmarkError,),
          'benchmark.py memory --num_layers=32')
