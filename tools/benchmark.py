"""Benchmarks GPipeSequentialLayer against the plain stack and Lingvo's GPipe.

    python tools/benchmark.py memory
    python tools/benchmark.py memory --num_layers=16 --batch=4096 --repeats=3
    python tools/benchmark.py memory --nobudget_search --micro_batches=4,8
    python tools/benchmark.py memory --engines=unrolled,loop --modes=graph,xla
    python tools/benchmark.py speed
    python tools/benchmark.py speed --speed_stages=2,4 --speed_micro_batches=8
    python tools/benchmark.py scale --png_out=docs/scale.png
    python tools/benchmark.py keras
    python tools/benchmark.py keras --keras_modes=function --repeats=1
    python tools/benchmark.py schedules

Subcommands (the first argument that is not a flag), one module of the
repository's `benchmarks` package each:
  memory  Peak memory and step time of one training step (forward,
          gradients, SGD update) of a deep stack of Lingvo FCLayers: the
          plain `builder_layers.SequentialLayer` and GPipeSequentialLayer with
          one stage for every engine (--engines), re-materialization mode and
          number of micro-batches M, in a TF1 graph and session and/or
          compiled by XLA (--modes). Then the largest number of layers whose
          graph-mode step fits a memory budget, plain vs. GPipe
          (`benchmarks.memory`).
  speed   Step time, first-step time, graph build time and peak memory of the
          same kind of training step (gradients colocated with their ops, as
          Lingvo's trainer does) on K logical CPU devices (one per stage,
          placed by Lingvo's cluster model split) for every K in
          --speed_stages and M in --speed_micro_batches: GPipeSequentialLayer
          (remat='always'), Lingvo's gpipe.PipeliningLayer (which always
          recomputes) and GPipeSequentialLayer in an eager tf.function
          (GradientTape), plus the plain SequentialLayer and GPipe with
          remat='never' at K=1, M=1 as references (`benchmarks.speed`).
          Unless given, its flags default to --num_layers=16 --batch=2048
          --steps=5 --repeats=2. GPipe uses the unrolled engine here.
  scale   How start-up and step time grow with M, for both engines and
          Lingvo's PipeliningLayer, for every K in --scale_stages and M in
          --scale_micro_batches: HLO lines, tf.function trace + first call,
          XLA trace + compile + first call, graph build, first run, steady
          step and peak memory; the loop engine's targets and a PNG of
          start-up cost against M (--png_out) (`benchmarks.scale`). Unless
          given, its flags default to --num_layers=16 --dim=64 --batch=512
          --steps=5 --repeats=1.
  keras   Step time and peak memory of one `model.train_on_batch` step of
          Dense(dim, relu) layers as a plain keras.Sequential and inside
          lingvo_gpipe.keras.GPipeSequential (K=1: M=1 with remat 'never' and
          'always', and M=--keras_micro_batches with 'always'), without and
          with XLA (--keras_modes), with TensorFlow's default threads
          (`benchmarks.keras_bench`). Unless given, its flags default to
          --num_layers=16 --dim=256 --batch=4096 --steps=10 --repeats=3.
          Neither the tool nor its workers import Lingvo.
  schedules  Ratios of measured steps with their targets: the loop engine
          against the unrolled one and Lingvo's PipeliningLayer, the cost
          of re-materialization, circular and interleaved stages against
          their plain schedules (one core per device), and 1F1B against
          GPipe in peak memory and step time (`benchmarks.schedules`). Its
          sizes are fixed (--schedules_small: tiny, for a quick check);
          --schedules_match keeps the comparisons whose name contains its
          text; --repeats (default 3) and --parallel apply.

Every configuration runs in a fresh worker process (`python -m
benchmarks.worker`), so allocator peaks never leak from one configuration into
the next. The peak is `tf.config.experimental.get_memory_info('CPU:0')` after
`reset_memory_stats`, measured on the steps after a warm-up step; the workers
run with TF_CPU_ALLOCATOR_USE_BFC=true, whose allocator keeps these statistics
on every host, with oneDNN on or off (`benchmarks/host.py`). Each run prints
and records (JSON key 'host') the CPU model and whether oneDNN was on: step
times depend on both.
Timings on a shared machine are noisy: repetitions (--repeats) run
interleaved and the median is reported.

Runs from any directory; tools/__init__.py says how it finds the repository.
"""

import os
import sys

if __name__ == '__main__':  # Run as a script: see tools/__init__.py.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import flags

from benchmarks import host
from benchmarks import keras_bench
from benchmarks import memory
from benchmarks import runner as runner_lib
from benchmarks import scale
from benchmarks import schedules
from benchmarks import speed
from lingvo_gpipe.planning import schedule
from tools import cli
# pylint: enable=g-import-not-at-top,wrong-import-position

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
    'micro_batches', ['1', '4', '8'], 'memory: comma-separated numbers of '
    'micro-batches M to measure GPipe with (one stage, K = 1).')
flags.DEFINE_list(
    'remat', ['always', 'except_last', 'never'], 'memory: comma-separated '
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
    'budget_search', True, 'memory: whether to search the largest number of '
    'layers that trains within --budget_mib, plain vs. GPipe.')
flags.DEFINE_float(
    'budget_mib', None, 'memory: budget in MiB for the largest-model search: '
    'the peak of one training step must not exceed it. Default: half the '
    "plain model's peak in the table.", lower_bound=0.0)
flags.DEFINE_integer(
    'budget_micro_batches', 8, 'memory: M of the GPipe model in the '
    "largest-model search (one stage, remat='always').", lower_bound=1)
flags.DEFINE_integer(
    'budget_max_layers', 256, 'memory: upper bound of the largest-model '
    'search: larger models are not tried (the result is then reported as '
    'capped).', lower_bound=1)
flags.DEFINE_list(
    'engines', ['unrolled'], 'memory: comma-separated GPipeSequentialLayer '
    "engines to measure: unrolled, loop (which measures remat='always' "
    'only).')
flags.DEFINE_list(
    'modes', ['graph'], 'memory: comma-separated ways to build the step: '
    'graph (TF1 graph and session), xla (tf.function with '
    'jit_compile=True), function (tf.function).')
flags.DEFINE_list(
    'speed_stages', ['1', '2', '4'], 'speed: comma-separated numbers of '
    'pipeline stages K (= logical CPU devices) to measure.')
flags.DEFINE_list(
    'speed_micro_batches', ['1', '4', '8', '16'], 'speed: comma-separated '
    'numbers of micro-batches M to measure with every K.')
flags.DEFINE_list(
    'scale_stages', ['2', '4', '8'], 'scale: comma-separated numbers of '
    'pipeline stages K (= logical CPU devices) to measure.')
flags.DEFINE_list(
    'scale_micro_batches', ['4', '8', '32', '64', '128'], 'scale: '
    'comma-separated numbers of micro-batches M to measure with every K.')
flags.DEFINE_integer(
    'keras_micro_batches', 4, "keras: M of the GPipeSequential row with "
    "remat='always' whose peak memory is compared with the plain model's.",
    lower_bound=1)
flags.DEFINE_list(
    'keras_modes', list(keras_bench.MODES), 'keras: comma-separated ways to '
    'compile the train step: function (model.compile(jit_compile=False)), '
    'xla (jit_compile=True).')
flags.DEFINE_bool(
    'schedules_small', False, 'schedules: tiny sizes, to check that every '
    'comparison builds and runs (the ratios mean nothing then).')
flags.DEFINE_string(
    'schedules_match', None, "schedules: measure only the comparisons whose "
    "name contains this text, e.g. 'K=4 M=64'.")
flags.DEFINE_string(
    'png_out', None, 'scale: optional path of a PNG plot of start-up cost '
    '(tf.function, XLA, graph mode) against M.')

BenchmarkError = runner_lib.BenchmarkError

# Defaults of the speed subcommand for shared flags the user did not give:
# a step of about 0.1-0.5 s on 2 cores, so that the whole run stays short.
_SPEED_DEFAULTS = {'num_layers': 16, 'batch': 2048, 'steps': 5, 'repeats': 2}
# Defaults of the scale subcommand: 16 FCLayers of 64, batch 512, small
# enough for M = 128 and K = 8 on 2 cores.
_SCALE_DEFAULTS = {'num_layers': 16, 'dim': 64, 'batch': 512, 'steps': 5,
                   'repeats': 1}
# Repeats of the schedules subcommand unless --repeats is given.
_SCHEDULES_REPEATS = 3
# Defaults of the keras subcommand: 16 Dense(256) on a batch of 4096, whose
# activations (64 MiB) outweigh the weights (4 MiB); a step of about 0.25 s.
_KERAS_DEFAULTS = {'num_layers': 16, 'dim': 256, 'batch': 4096, 'steps': 10,
                   'repeats': 3}


def _Progress(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _NoPositionalArguments(subcommand: str, args: Sequence[str]) -> None:
  if args:
    raise BenchmarkError(f'{subcommand} takes no positional arguments, got '
                         f'{list(args)}.')


def _Choices(flag: str, valid: Sequence[str]) -> List[str]:
  """The values of list flag --flag, each checked against `valid`."""
  values = list(FLAGS[flag].value)
  if not values:
    raise BenchmarkError(f'--{flag} is empty; use some of {list(valid)}.')
  for v in values:
    if v not in valid:
      raise BenchmarkError(f'--{flag}={",".join(values)}: {v!r} is not one '
                           f'of {list(valid)}.')
  return values


def _CheckMemoryFlags() -> Tuple[List[int], List[str]]:
  """Validates the memory flags; returns (micro-batch counts, remat modes)."""
  micro_batches = cli.PositiveIntsFlag('micro_batches', BenchmarkError)
  remats = _Choices('remat', schedule.REMAT_MODES)
  _Choices('engines', schedule.ENGINES)
  _Choices('modes', runner_lib.MODES)
  runner_lib.CheckMicroBatches('micro_batches', micro_batches, FLAGS.batch)
  if FLAGS.budget_search:
    runner_lib.CheckMicroBatches('budget_micro_batches',
                                 [FLAGS.budget_micro_batches], FLAGS.batch)
  if FLAGS.budget_mib is not None and FLAGS.budget_mib <= 0:
    raise BenchmarkError(f'--budget_mib={FLAGS.budget_mib} must be positive.')
  return micro_batches, remats


def Memory(args: Sequence[str]) -> Dict[str, Any]:
  """The `memory` subcommand: prints the table and budget result.

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict with the flags, versions, rows and budget search.

  Raises:
    BenchmarkError: on bad flags or a failed measurement.
  """
  _NoPositionalArguments('memory', args)
  micro_batches, remats = _CheckMemoryFlags()
  start = time.time()
  runner = runner_lib.Runner(FLAGS.parallel, _Progress)
  configs = memory.Configs(FLAGS.num_layers, FLAGS.dim, FLAGS.batch,
                           FLAGS.steps, micro_batches, remats, FLAGS.engines,
                           FLAGS.modes)
  _Progress(f'Measuring {len(configs)} configurations x {FLAGS.repeats} '
            'repeats, each in a subprocess...')
  rows = memory.MeasureRows(runner, configs, FLAGS.repeats)
  print(f'One training step of {FLAGS.num_layers} FCLayers, dim {FLAGS.dim}, '
        f'batch {FLAGS.batch} (median of {FLAGS.repeats} runs, '
        f'{FLAGS.steps} steps each):')
  print(memory.FormatTable(rows))
  print()
  first = rows[0]['runs'][0]
  numbers = {
      'subcommand': 'memory',
      'host': _Host(first),
      'flags': {
          name: FLAGS[name].value for name in (
              'num_layers', 'dim', 'batch', 'micro_batches', 'remat',
              'engines', 'modes', 'steps', 'repeats', 'parallel',
              'budget_search', 'budget_mib', 'budget_micro_batches',
              'budget_max_layers', 'json_out')
      },
      'tf_version': first['tf_version'],
      'lingvo_version': first['lingvo_version'],
      'rows': rows,
      'budget': None,
  }
  if FLAGS.budget_search and 'graph' not in FLAGS.modes:
    raise BenchmarkError('--budget_search searches graph-mode models; add '
                         'graph to --modes or pass --nobudget_search.')
  if FLAGS.budget_search:
    budget_mib = (FLAGS.budget_mib if FLAGS.budget_mib is not None else
                  rows[0]['peak_mib'] / 2)
    _Progress(f'Searching the largest models within {budget_mib:.1f} MiB...')
    numbers['budget'] = memory.CompareLargest(runner, rows, budget_mib,
                                              FLAGS.budget_micro_batches,
                                              FLAGS.budget_max_layers)
    print(memory.FormatBudget(numbers['budget'], FLAGS.dim, FLAGS.batch))
    print()
  numbers['subprocesses'] = runner.num_runs
  numbers['total_s'] = time.time() - start
  print(f'{runner.num_runs} subprocesses, {numbers["total_s"]:.0f} s.')
  return numbers


def _Host(result: Dict[str, Any]) -> Dict[str, Any]:
  """Prints what a worker's `result` was measured on; returns its host dict."""
  print(f'Measured on {host.Summary(result["host"])}.')
  return result['host']


def _SubcommandFlag(name: str, defaults: Dict[str, Any]) -> Any:
  """The flag's value if given on the command line, else `defaults[name]`."""
  return FLAGS[name].value if FLAGS[name].present else defaults[name]


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
  _NoPositionalArguments('speed', args)
  num_layers, batch, steps, repeats = (
      _SubcommandFlag(name, _SPEED_DEFAULTS)
      for name in ('num_layers', 'batch', 'steps', 'repeats'))
  stages = cli.PositiveIntsFlag('speed_stages', BenchmarkError)
  micro_batches = cli.PositiveIntsFlag('speed_micro_batches', BenchmarkError)
  runner_lib.CheckStages('speed_stages', stages, num_layers)
  runner_lib.CheckMicroBatches('speed_micro_batches', micro_batches, batch)
  start = time.time()
  runner = runner_lib.Runner(FLAGS.parallel, _Progress)
  shapes = [(k, m) for k in stages for m in micro_batches]
  configs = speed.Configs(num_layers, FLAGS.dim, batch, steps, shapes)
  _Progress(f'Measuring {len(configs)} configurations x {repeats} rounds, '
            'each in a subprocess...')
  measured = runner_lib.MeasureTable(runner, configs, repeats)
  plain, never = measured[0], measured[1]
  rows = speed.Rows(measured, shapes, batch)
  print(f'One training step of {num_layers} FCLayers, dim {FLAGS.dim}, batch '
        f'{batch} on K logical CPU devices (median of {repeats} rounds x '
        f'{steps} steps; ours: remat=always):')
  print(speed.FormatReferences(plain, never, batch))
  print(speed.FormatTable(rows))
  print()
  first = plain['runs'][0]
  numbers = {
      'subcommand': 'speed',
      'host': _Host(first),
      'flags': {
          'num_layers': num_layers, 'dim': FLAGS.dim, 'batch': batch,
          'steps': steps, 'warmups': speed.WARMUPS, 'repeats': repeats,
          'speed_stages': stages, 'speed_micro_batches': micro_batches,
          'parallel': FLAGS.parallel, 'json_out': FLAGS.json_out,
      },
      'tf_version': first['tf_version'],
      'lingvo_version': first['lingvo_version'],
      'plain': speed.Summary(plain),
      'gpipe_never': dict(
          speed.Summary(never),
          step_ratio_plain=runner_lib.Ratio(never['step_s'], plain['step_s'])),
      'rows': rows,
      'measurements': measured,
      'subprocesses': runner.num_runs,
      'total_s': time.time() - start,
  }
  print(f'{runner.num_runs} subprocesses, {numbers["total_s"]:.0f} s.')
  return numbers


def Scale(args: Sequence[str]) -> Dict[str, Any]:
  """The `scale` subcommand: start-up and step cost of both engines and Lingvo.

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict with the flags, versions, one row per (K, M), the
    targets and every measurement.

  Raises:
    BenchmarkError: on bad flags or a failed measurement.
  """
  _NoPositionalArguments('scale', args)
  num_layers, dim, batch, steps, repeats = (
      _SubcommandFlag(name, _SCALE_DEFAULTS)
      for name in ('num_layers', 'dim', 'batch', 'steps', 'repeats'))
  stages = cli.PositiveIntsFlag('scale_stages', BenchmarkError)
  micro_batches = cli.PositiveIntsFlag('scale_micro_batches', BenchmarkError)
  runner_lib.CheckStages('scale_stages', stages, num_layers)
  runner_lib.CheckMicroBatches('scale_micro_batches', micro_batches, batch)
  start = time.time()
  runner = runner_lib.Runner(FLAGS.parallel, _Progress)
  shapes = scale.AllShapes(stages, micro_batches)
  configs = scale.Configs(num_layers, dim, batch, steps, shapes)
  _Progress(f'Measuring {len(configs)} configurations x {repeats} rounds, '
            'each in a subprocess...')
  measured = runner_lib.MeasureTable(runner, configs, repeats)
  rows = scale.Rows(measured, shapes)
  targets = scale.Targets(rows)
  print(f'One training step of {num_layers} FCLayers, dim {dim}, batch '
        f'{batch} on K logical CPU devices, remat=always (median of {repeats} '
        f'rounds x {steps} steps); u = unrolled, l = loop, L = Lingvo '
        'PipeliningLayer:')
  print(scale.FormatTable(rows))
  print('Targets:')
  print(scale.FormatTargets(targets))
  if FLAGS.png_out:
    scale.DrawStartup(rows, FLAGS.png_out,
                      f'Start-up cost against M: {num_layers} FCLayers of '
                      f'{dim}, batch {batch}, remat=always')
    print(f'Wrote {FLAGS.png_out}')
  first = measured[0]['runs'][0]
  numbers = {
      'subcommand': 'scale',
      'host': _Host(first),
      'flags': {
          'num_layers': num_layers, 'dim': dim, 'batch': batch,
          'steps': steps, 'warmups': scale.WARMUPS, 'repeats': repeats,
          'scale_stages': stages, 'scale_micro_batches': micro_batches,
          'parallel': FLAGS.parallel, 'png_out': FLAGS.png_out,
          'json_out': FLAGS.json_out,
      },
      'tf_version': first['tf_version'],
      'lingvo_version': first['lingvo_version'],
      'rows': rows,
      'targets': targets,
      'measurements': measured,
      'subprocesses': runner.num_runs,
      'total_s': time.time() - start,
  }
  print(f'{runner.num_runs} subprocesses, {numbers["total_s"]:.0f} s.')
  return numbers


def Keras(args: Sequence[str]) -> Dict[str, Any]:
  """The `keras` subcommand: GPipeSequential against keras.Sequential.

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict with the flags, versions and one row per configuration.

  Raises:
    BenchmarkError: on bad flags or a failed measurement.
  """
  _NoPositionalArguments('keras', args)
  num_layers, dim, batch, steps, repeats = (
      _SubcommandFlag(name, _KERAS_DEFAULTS)
      for name in ('num_layers', 'dim', 'batch', 'steps', 'repeats'))
  modes = _Choices('keras_modes', keras_bench.MODES)
  runner_lib.CheckMicroBatches('keras_micro_batches',
                               [FLAGS.keras_micro_batches], batch)
  start = time.time()
  configs = keras_bench.Configs(num_layers, dim, batch, steps,
                                FLAGS.keras_micro_batches, modes)
  _Progress(f'Measuring {len(configs)} configurations x {repeats} rounds, '
            'each in a subprocess...')
  rows = keras_bench.Measure(configs, repeats, _Progress)
  print(f'One model.train_on_batch step of {num_layers} Dense({dim}, relu), '
        f'batch {batch}, one device, default threads (median of {repeats} '
        f'rounds x {steps} steps):')
  print(keras_bench.FormatTable(rows))
  print()
  first = rows[0]['runs'][0]
  numbers = {
      'subcommand': 'keras',
      'host': _Host(first),
      'flags': {
          'num_layers': num_layers, 'dim': dim, 'batch': batch,
          'steps': steps, 'warmups': keras_bench.WARMUPS, 'repeats': repeats,
          'keras_micro_batches': FLAGS.keras_micro_batches,
          'keras_modes': modes, 'json_out': FLAGS.json_out,
      },
      'tf_version': first['tf_version'],
      'keras_version': first['keras_version'],
      'rows': rows,
      'total_s': time.time() - start,
  }
  print(f'{len(configs) * repeats} subprocesses, {numbers["total_s"]:.0f} s.')
  return numbers


def Schedules(args: Sequence[str]) -> Dict[str, Any]:
  """The `schedules` subcommand: measured ratios against their targets.

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict with the rows and every measurement.

  Raises:
    BenchmarkError: on bad flags or a failed measurement.
  """
  _NoPositionalArguments('schedules', args)
  repeats = FLAGS.repeats if FLAGS['repeats'].present else _SCHEDULES_REPEATS
  start = time.time()
  runner = runner_lib.Runner(FLAGS.parallel, _Progress)
  comparisons = schedules.Comparisons(FLAGS.schedules_small)
  if FLAGS.schedules_match is not None:
    try:
      comparisons = schedules.Select(comparisons, FLAGS.schedules_match)
    except ValueError as e:
      raise BenchmarkError(str(e)) from e
  configs = schedules.Configs(comparisons)
  _Progress(f'Measuring {len(configs)} configurations x {repeats} rounds, '
            'each in a subprocess...')
  measured = runner_lib.MeasureTable(runner, configs, repeats)
  rows = schedules.Rows(comparisons, measured)
  print(f'Training steps (medians of {repeats} rounds); ratios of the first '
        'configuration to the second:')
  print(schedules.FormatTable(rows))
  total = time.time() - start
  print(f'{runner.num_runs} subprocesses, {total:.0f} s.')
  return {
      'subcommand': 'schedules',
      'host': _Host(measured[0]['runs'][0]),
      'repeats': repeats,
      'rows': rows,
      'measured': measured,
      'subprocesses': runner.num_runs,
      'total_s': total,
  }


# Subcommand name -> function(positional args) -> JSON-ready dict (or None).
SUBCOMMANDS: Dict[str, Callable[[Sequence[str]], Optional[Dict[str, Any]]]] = {
    'memory': Memory,
    'speed': Speed,
    'scale': Scale,
    'keras': Keras,
    'schedules': Schedules,
}

if __name__ == '__main__':
  cli.Run('benchmark.py', SUBCOMMANDS, (BenchmarkError,),
          'benchmark.py memory --num_layers=32')
