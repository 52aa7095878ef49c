"""Runs benchmark configurations, each in a fresh worker process.

A configuration is a JSON-ready dict (`Config`); `Runner.Run` measures it in
`python -m benchmarks.worker CONFIG` and returns the worker's numbers, so
that allocator peaks never leak from one configuration into the next.
`MeasureTable` runs many configurations several times, interleaved, and takes
medians. Standard library only: the parent process never imports TensorFlow.
"""

import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks import host

# The worker prints its numbers on one line after this prefix, or one line
# after ERROR_PREFIX.
RESULT_PREFIX = 'BENCHMARK_RESULT '
ERROR_PREFIX = 'benchmarks.worker: error: '
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TensorFlow's C++ log lines ('I0000 00:00:...', 'E1202 17:44:56...').
_TF_LOG_LINE = re.compile(r'^([IWEF]\d{4} |WARNING: All log messages)')


class BenchmarkError(ValueError):
  """A bad setting or a failed measurement; tools print it on one line."""


def WorkerMain(argv: Sequence[str],
               measure: Callable[[Dict[str, Any]], Dict[str, Any]],
               errors: tuple = (BenchmarkError,),
               error_prefix: str = ERROR_PREFIX) -> int:
  """A worker's main: measures the configuration argv[1], prints the result.

  The result also says what its figures depend on: `result['host']` is
  `host.Describe()` of the measuring process.

  Args:
    argv: [program, configuration JSON].
    measure: Returns the JSON-ready numbers of a configuration.
    errors: Exception types printed as one error line (exit status 2), besides
      `host.MemoryStatsError`.
    error_prefix: What the error line starts with.

  Returns:
    The exit status: 0, or 2 after printing one error line.
  """
  try:
    if len(argv) != 2:
      raise BenchmarkError(
          f'takes one JSON configuration, got {list(argv[1:])}.')
    result = measure(json.loads(argv[1]))
    result['host'] = host.Describe()
  except errors + (host.MemoryStatsError,) as e:
    print(f'{error_prefix}{" ".join(str(e).split())}', file=sys.stderr)
    return 2
  print(RESULT_PREFIX + json.dumps(result), flush=True)
  return 0


# How a worker builds the training step: a TF1 graph and session, an eager
# tf.function, or a tf.function that XLA compiles (jit_compile=True).
MODES = ('graph', 'function', 'xla')


def Config(model: str,
           num_layers: int,
           dim: int,
           batch: int,
           steps: int,
           micro_batches: Optional[int] = None,
           remat: Optional[str] = None,
           stages: int = 1,
           warmups: int = 1,
           mode: str = 'graph',
           engine: str = 'auto',
           schedule: str = 'gpipe',
           virtual_stages: int = 1,
           intra_op_threads: int = 0,
           processes: bool = False) -> Dict[str, Any]:
  """A configuration to measure.

  Args:
    model: 'plain', 'gpipe' (GPipeSequentialLayer) or 'lingvo'
      (gpipe.PipeliningLayer, graph mode only); see `models`.
    num_layers: Number of FCLayers.
    dim: Their input and output size.
    batch: The mini-batch size.
    steps: Measured steps after the warm-up steps.
    micro_batches: M (not plain).
    remat: Re-materialization mode (gpipe only).
    stages: K, the number of stages and logical CPU devices.
    warmups: Warm-up steps (the first one is timed as the first step).
    mode: One of `MODES`.
    engine: GPipeSequentialLayer's engine (gpipe only).
    schedule: Its schedule (gpipe only); with the loss inside (1f1b) the
      model's last cell computes the loss.
    virtual_stages: Its chunks per device (gpipe only).
    intra_op_threads: Threads per TensorFlow op (0: TensorFlow's default).
      1 makes each logical CPU device act as one core, so that stages
      overlap as on K accelerators (docs/benchmarks.md).
    processes: Stage k in a server process of its own pinned to core k
      (`loopback`; gpipe in graph mode only), so that each stage has exactly
      one core: logical devices of one process share both cores, and a
      stage's independent ops (a backward's two matmuls) run on both. Each
      server has an allocator of its own: the peak is the largest stage's,
      where on logical devices it is all stages' together. Each server
      holds its stage's weights, and the batch is drawn once, in the first
      stage's server (`worker`).

  Returns:
    A JSON-ready dict.

  Raises:
    BenchmarkError: on an unknown mode, Lingvo outside graph mode, or
      processes outside gpipe in graph mode.
  """
  if mode not in MODES:
    raise BenchmarkError(f'mode={mode!r} is not one of {list(MODES)}.')
  if model == 'lingvo' and mode != 'graph':
    raise BenchmarkError(f"Lingvo's PipeliningLayer runs in graph mode only, "
                         f'not mode={mode!r}.')
  if processes and (model != 'gpipe' or mode != 'graph'):
    raise BenchmarkError(f'processes=True runs gpipe in graph mode only, not '
                         f'model={model!r} in mode={mode!r}.')
  return {
      'model': model,
      'num_layers': num_layers,
      'dim': dim,
      'batch': batch,
      'micro_batches': micro_batches,
      'remat': remat,
      'stages': stages,
      'steps': steps,
      'warmups': warmups,
      'mode': mode,
      'engine': engine,
      'schedule': schedule,
      'virtual_stages': virtual_stages,
      'intra_op_threads': intra_op_threads,
      'processes': processes,
  }


def Name(config: Dict[str, Any]) -> str:
  """A short name, e.g. 'plain', 'gpipe K=1 M=8 always', 'lingvo K=2 M=4'.

  The mode and the engine are added when not the defaults ('graph', 'auto'):
  'gpipe loop K=4 M=32 always xla'.
  """
  model = config['model']
  mode = config.get('mode', 'graph')
  suffix = '' if mode == 'graph' else f' {mode}'
  if config.get('intra_op_threads', 0):
    suffix += f' {config["intra_op_threads"]}-thread ops'
  if config.get('processes'):
    suffix += ' a process per stage'
  if model == 'plain':
    return 'plain' + suffix
  shape = f'K={config.get("stages", 1)} M={config["micro_batches"]}'
  if model == 'lingvo':
    return f'lingvo {shape}{suffix}'
  engine = config.get('engine', 'auto')
  engine = '' if engine == 'auto' else f' {engine}'
  schedule = config.get('schedule', 'gpipe')
  if schedule != 'gpipe':
    engine += f' {schedule}'
  if config.get('virtual_stages', 1) != 1:
    shape += f' v={config["virtual_stages"]}'
  return f'gpipe{engine} {shape} {config["remat"]}{suffix}'


def CheckStages(flag: str, stages: Sequence[int], num_layers: int) -> None:
  """Raises BenchmarkError unless every K of --flag has a cell per stage."""
  for k in stages:
    if k > num_layers:
      raise BenchmarkError(f'--{flag}: K={k} is more than --num_layers='
                           f'{num_layers}; every stage needs a cell.')


def CheckMicroBatches(flag: str, micro_batches: Sequence[int],
                      batch: int) -> None:
  """Raises BenchmarkError unless every M of --flag divides the batch."""
  for m in micro_batches:
    if batch % m:
      raise BenchmarkError(f'--{flag}: M={m} does not divide --batch={batch}; '
                           'use a divisor of the batch.')


def Ratio(a: float, b: float) -> Optional[float]:
  """a / b, or None if b is 0."""
  return a / b if b else None


def FormatRatio(ratio: Optional[float]) -> str:
  """A ratio with two decimals, or 'n/a'."""
  return 'n/a' if ratio is None else f'{ratio:.2f}'


class Runner:
  """Runs configurations in fresh subprocesses, at most `parallel` at once.

  Attributes:
    parallel: How many workers run at once.
    num_runs: Workers run so far.
  """

  def __init__(self, parallel: int,
               report: Optional[Callable[[str], None]] = None):
    """Prepares the workers' environment.

    Args:
      parallel: How many workers run at once (1 for meaningful timings).
      report: Called with a line of progress after each measurement; None:
        silent.
    """
    self.parallel = parallel
    self.num_runs = 0
    self._report = report or (lambda line: None)
    self._slots = threading.Semaphore(parallel)
    self._lock = threading.Lock()
    self._env = host.WorkerEnvironment()

  def Run(self, config: Dict[str, Any]) -> Dict[str, Any]:
    """Measures `config` in a worker process.

    Args:
      config: A configuration dict, see `Config`.

    Returns:
      The dict of `worker.MeasureStep`.

    Raises:
      BenchmarkError: if the worker fails.
    """
    # The working directory is the repository root, so `-m benchmarks.worker`
    # imports this package (and params, lingvo_gpipe) from this checkout.
    command = [sys.executable, '-m', 'benchmarks.worker', json.dumps(config)]
    with self._slots:
      proc = subprocess.run(command, cwd=_ROOT, env=self._env,
                            capture_output=True, text=True, check=False)
    with self._lock:
      self.num_runs += 1
    for line in proc.stdout.splitlines():
      if line.startswith(RESULT_PREFIX):
        result = json.loads(line[len(RESULT_PREFIX):])
        self._report(f'  {Name(config)}, {config["num_layers"]} layers: peak '
                     f'{result["peak_mib"]:.1f} MiB, step '
                     f'{result["step_s"]:.2f} s')
        return result
    # The worker's own one-line error, else the last line (a traceback's
    # exception), skipping TensorFlow's log lines such as
    # 'E0000 ... failed call to cuInit'.
    lines = [
        l for l in proc.stderr.splitlines()
        if l.strip() and not _TF_LOG_LINE.match(l)
    ]
    ours = [l for l in lines if l.startswith(ERROR_PREFIX)]
    message = (ours or lines or ['no output'])[-1]
    raise BenchmarkError(
        f'measuring {Name(config)} with {config["num_layers"]} layers failed '
        f'(exit {proc.returncode}): {message}')


def MeasureTable(runner: Runner, configs: List[Dict[str, Any]],
                 repeats: int) -> List[Dict[str, Any]]:
  """Measures every configuration `repeats` times, interleaved.

  Repeat r runs the configurations in order, every odd repeat in reverse, so
  slow phases of a shared machine spread over all of them.

  Args:
    runner: Runs one configuration.
    configs: The configurations.
    repeats: Runs per configuration.

  Returns:
    One row per configuration: name, config, every run, and the medians over
    the repeats of peak_mib, step_s, resident_mib, build_s and warmup_s.
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
    row = {'name': Name(config), 'config': config, 'runs': config_runs}
    for key in ('peak_mib', 'step_s', 'resident_mib', 'build_s', 'warmup_s'):
      row[key] = statistics.median(run[key] for run in config_runs)
    row['num_params'] = config_runs[0]['num_params']
    rows.append(row)
  return rows
