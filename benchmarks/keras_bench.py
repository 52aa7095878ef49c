"""The Keras benchmark: GPipeSequential against keras.Sequential of its layers.

One training step (`model.train_on_batch`: forward, gradients, SGD update) of
a stack of Dense(dim, relu) layers, built as `keras.Sequential` (plain) or
wrapped in `lingvo_gpipe.keras.GPipeSequential` with K stages, M
micro-batches and a remat mode, compiled without XLA ('function') or with it
('xla'). Each configuration runs in a fresh process
(`python -m benchmarks.keras_bench CONFIG`), which times a first step, one
more warm-up step and `steps` steps, each after
`reset_memory_stats('CPU:0')`, with TensorFlow's default threads; the peak is
`get_memory_info('CPU:0')['peak']`, read through `host` (the workers run with
an allocator that keeps it). Neither side imports Lingvo.

    configs = Configs(num_layers=16, dim=512, batch=1024, steps=10,
                      memory_micro_batches=4, modes=['function', 'xla'])
    rows = Measure(configs, repeats=3, report=print)
    print(FormatTable(rows))
"""

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks import host
from benchmarks import runner as runner_lib

MODES = ('function', 'xla')
WARMUPS = 2
_MIB = 1024.0 * 1024.0
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def Config(model: str, num_layers: int, dim: int, batch: int, steps: int,
           mode: str, stages: int = 1, micro_batches: int = 1,
           remat: Optional[str] = None) -> Dict[str, Any]:
  """One configuration: 'plain' or 'gpipe' (K, M, remat) in a mode."""
  if mode not in MODES:
    raise runner_lib.BenchmarkError(f'mode={mode!r} is not one of '
                                    f'{list(MODES)}.')
  return {'model': model, 'num_layers': num_layers, 'dim': dim,
          'batch': batch, 'steps': steps, 'mode': mode, 'stages': stages,
          'micro_batches': micro_batches, 'remat': remat}


def Name(config: Dict[str, Any]) -> str:
  """E.g. 'plain xla', 'gpipe K=1 M=4 always function'."""
  if config['model'] == 'plain':
    return f'plain {config["mode"]}'
  return (f'gpipe K={config["stages"]} M={config["micro_batches"]} '
          f'{config["remat"]} {config["mode"]}')


def Configs(num_layers: int, dim: int, batch: int, steps: int,
            memory_micro_batches: int,
            modes: Sequence[str]) -> List[Dict[str, Any]]:
  """Per mode: plain; GPipe K=1 M=1 'never' and 'always'; K=1 M 'always'.

  Args:
    num_layers: Dense layers in every model.
    dim: Their width (and the input's).
    batch: The mini-batch size; M divides it.
    steps: Measured steps after the warm-up steps.
    memory_micro_batches: M of the memory row (remat='always').
    modes: Some of `MODES`.

  Returns:
    The configurations, four per mode, in that order.
  """
  configs = []
  for mode in modes:
    common = dict(num_layers=num_layers, dim=dim, batch=batch, steps=steps,
                  mode=mode)
    configs += [
        Config('plain', **common),
        Config('gpipe', remat='never', **common),
        Config('gpipe', remat='always', **common),
        Config('gpipe', micro_batches=memory_micro_batches, remat='always',
               **common),
    ]
  return configs


def RunWorker(config: Dict[str, Any]) -> Dict[str, Any]:
  """Measures `config` in a fresh `python -m benchmarks.keras_bench` process.

  Raises:
    runner.BenchmarkError: with the worker's error line if it fails.
  """
  proc = subprocess.run(
      [sys.executable, '-m', 'benchmarks.keras_bench', json.dumps(config)],
      cwd=_ROOT, env=host.WorkerEnvironment(), capture_output=True, text=True,
      check=False)
  for line in proc.stdout.splitlines():
    if line.startswith(runner_lib.RESULT_PREFIX):
      return json.loads(line[len(runner_lib.RESULT_PREFIX):])
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  raise runner_lib.BenchmarkError(
      f'measuring {Name(config)} failed (exit {proc.returncode}): '
      f'{(lines or ["no output"])[-1]}')


def Measure(configs: List[Dict[str, Any]], repeats: int,
            report: Callable[[str], None]) -> List[Dict[str, Any]]:
  """Measures every configuration `repeats` times, interleaved, one at a time.

  Returns:
    One row per configuration: name, config, runs, the medians of step_s,
    peak_mib and warmup_s over the repeats, best_s (the fastest step of all
    runs) and the ratios step_ratio, best_ratio and peak_ratio to the plain
    model of the same mode.
  """
  runs = [[] for _ in configs]
  for r in range(repeats):
    order = list(range(len(configs)))
    for i in (order if r % 2 == 0 else reversed(order)):
      result = RunWorker(configs[i])
      report(f'  {Name(configs[i])}: step {result["step_s"]:.3f} s, peak '
             f'{result["peak_mib"]:.1f} MiB')
      runs[i].append(result)
  rows = []
  for config, config_runs in zip(configs, runs):
    row = {'name': Name(config), 'config': config, 'runs': config_runs}
    for key in ('step_s', 'peak_mib', 'warmup_s'):
      row[key] = statistics.median(run[key] for run in config_runs)
    # The fastest step of all runs: what the step costs when the (shared)
    # machine leaves it alone.
    row['best_s'] = min(min(run['step_times_s']) for run in config_runs)
    rows.append(row)
  # Ratios against the plain model of the same mode.
  plain = {row['config']['mode']: row for row in rows
           if row['config']['model'] == 'plain'}
  for row in rows:
    reference = plain[row['config']['mode']]
    row['step_ratio'] = runner_lib.Ratio(row['step_s'], reference['step_s'])
    row['best_ratio'] = runner_lib.Ratio(row['best_s'], reference['best_s'])
    row['peak_ratio'] = runner_lib.Ratio(row['peak_mib'],
                                         reference['peak_mib'])
  return rows


def FormatTable(rows: List[Dict[str, Any]]) -> str:
  """The rows as a text table: step times and peak, each against plain.

  Columns: median step and its ratio to the plain model of the same mode,
  fastest step and its ratio, peak MiB and its ratio, the first step.
  """
  lines = [f'{"model":30} {"step s":>7} {"x plain":>7} {"best s":>7} '
           f'{"x plain":>7} {"peak MiB":>8} {"x plain":>7} {"first s":>7}']
  for row in rows:
    lines.append(
        f'{row["name"]:30} {row["step_s"]:7.3f} '
        f'{runner_lib.FormatRatio(row["step_ratio"]):>7} '
        f'{row["best_s"]:7.3f} '
        f'{runner_lib.FormatRatio(row["best_ratio"]):>7} '
        f'{row["peak_mib"]:8.1f} '
        f'{runner_lib.FormatRatio(row["peak_ratio"]):>7} '
        f'{row["warmup_s"]:7.2f}')
  return '\n'.join(lines)


def MeasureStep(config: Dict[str, Any]) -> Dict[str, Any]:
  """Builds the model of `config` and measures its training steps.

  Runs in the worker process: creates `stages` logical CPU devices first.

  Args:
    config: See `Config`.

  Returns:
    step_s (median), step_times_s, peak_mib (largest), peaks_mib,
    warmup_s (the first step: trace and compile), num_params, tf_version,
    keras_version.

  Raises:
    runner.BenchmarkError: if the allocator keeps no statistics.
  """
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import tensorflow as tf
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * config['stages'])
  import keras
  from lingvo_gpipe.keras import GPipeSequential
  # pylint: enable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  dim = config['dim']
  layers = [keras.layers.Dense(dim, activation='relu', name=f'dense{i}')
            for i in range(config['num_layers'])]
  if config['model'] == 'plain':
    body = keras.Sequential(layers, name='body')
  else:
    body = GPipeSequential(layers, num_stages=config['stages'],
                           num_micro_batches=config['micro_batches'],
                           remat=config['remat'], name='body')
  model = keras.Sequential([keras.Input((dim,)), body])
  model.compile(optimizer=keras.optimizers.SGD(1e-4), loss='mse',
                jit_compile=config['mode'] == 'xla')
  rng = np.random.RandomState(0)
  x = rng.randn(config['batch'], dim).astype(np.float32)
  y = np.zeros_like(x)

  def Step():
    model.train_on_batch(x, y)  # Returns the loss as numpy: synchronous.

  start = time.perf_counter()
  Step()
  warmup_s = time.perf_counter() - start
  for _ in range(WARMUPS - 1):
    Step()
  times, peaks = [], []
  for _ in range(config['steps']):
    host.ResetMemoryStats()
    start = time.perf_counter()
    Step()
    times.append(time.perf_counter() - start)
    peaks.append(host.PeakBytes() / _MIB)
  return {
      'step_s': statistics.median(times),
      'step_times_s': times,
      'peak_mib': max(peaks),
      'peaks_mib': peaks,
      'warmup_s': warmup_s,
      'num_params': int(model.count_params()),
      'tf_version': tf.__version__,
      'keras_version': keras.__version__,
  }


def Main(argv: Sequence[str]) -> int:
  """Measures the JSON configuration argv[1]; prints the result line."""
  return runner_lib.WorkerMain(argv, MeasureStep)


if __name__ == '__main__':
  sys.exit(Main(sys.argv))
