"""Plans a GPipe pipeline before running it, and shows how a step runs.

    python tools/plan.py partition --costs=1,4,4,4,8 --num_stages=2
    python tools/plan.py partition --example=amoebanet --num_stages=4,8
    python tools/plan.py partition --example=transformer --json_out=/tmp/p.json
    python tools/plan.py simulate --forward_costs=1 --num_stages=4 \
        --num_micro_batches=8 --png_out=/tmp/sim.png
    python tools/plan.py simulate --forward_costs=0.5 --num_stages=2 \
        --virtual_stages=2 --num_micro_batches=2
    python tools/plan.py timeline --num_stages=4 --num_micro_batches=8 \
        --png_out=/tmp/timeline.png --trace_out=/tmp/timeline.json
    python tools/plan.py auto --model=lm.GPipeCharLm --num_devices=2 \
        --memory_per_device=64MiB --verify=2 --json_out=/tmp/auto.json

Subcommands (the first argument that is not a flag):
  partition  For each K, the stages chosen by `partition.PartitionCosts`
             (their cells, cost, share, memory, imbalance) next to Lingvo's
             heuristic (`gpipe.PartitionSequentialLayers`).
  simulate   Times one step of a schedule table (`schedule.BuildTable`:
             --schedule, K, M, --virtual_stages) from per-chunk
             forward/backward costs with `simulate.Simulate`, as the chosen
             --engine runs it: step time, bubble fraction (next to the
             closed form), per-device utilization and peak activation
             memory; optionally draws the step (--png_out, --trace_out).
  timeline   Runs a real training step of a small GPipeSequentialLayer (FC
             cells, and a loss cell for a schedule with the loss inside;
             --schedule, K devices on K logical CPU devices, TF1 session
             with FULL_TRACE, as training runs it: the loop engine's
             per-device executor, its loops lowered so that the trace shows
             them) and shows which chunk ran which micro-batch and phase
             when: a table, the simulator fed with the measured call times
             (timed as the executor runs), and the same picture and trace as
             simulate.
  auto       Chooses K, M, schedule, virtual stages, remat and partition of
             a registered model for N devices of --memory_per_device bytes
             (`planning.search`): profiles every cell once (a worker
             process, `benchmarks.plan_worker`), measures a pipelined and a
             data-parallel step to calibrate the cost of a call and of
             replicas, predicts the step time and per-device peak of every
             configuration, prints them ranked, why the winner won and the
             --model_params_override lines that select it; --verify=V
             trains the V best for a few steps and prints predicted against
             measured. Exit status 1 if nothing fits.

Pictures (--png_out) have one row per stage and a box per call phase
(forward, recompute, backward), labelled with its micro-batch. Traces
(--trace_out) are Chrome trace JSON: open them in https://ui.perfetto.dev or
chrome://tracing.

The partitions, reports and simulation come from `lingvo_gpipe.planning`,
the traced step from `benchmarks.traced_step`; this tool checks flags and
prints. TensorFlow, Lingvo and matplotlib are imported only by the
subcommands that need them, so that `simulate` answers in well under a
second.

Runs from any directory; tools/__init__.py says how it finds the repository.
"""

import os
import sys

if __name__ == '__main__':  # Run as a script: see tools/__init__.py.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import json
import math
import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import flags

from benchmarks import host
from benchmarks import plan_worker
from benchmarks import traced_step
from lingvo_gpipe.planning import calibrate
from lingvo_gpipe.planning import partition as partition_lib
from lingvo_gpipe.planning import predict
from lingvo_gpipe.planning import profile as profile_lib
from lingvo_gpipe.planning import report
from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import search
from lingvo_gpipe.planning import search_report
from lingvo_gpipe.planning import simulate
from lingvo_gpipe.planning import timeline
from tools import cli
# pylint: enable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS

flags.DEFINE_list(
    'costs', None, 'partition: comma-separated cost of each cell, in order '
    '(flops, parameters, seconds, ...: any non-negative unit). Exactly one of '
    '--costs and --example.')
flags.DEFINE_enum(
    'example', None, ['transformer', 'amoebanet'],
    'partition: a built-in cost list instead of --costs. transformer: a cheap '
    'embedding (0.5), 24 equal layers (10) and a softmax costing four layers '
    '(40). amoebanet: AmoebaNet-D-like, a stem (2), then 3 blocks of 6 normal '
    'cells (1) with a reduction cell (3) between blocks, and a head (0.5).')
flags.DEFINE_list(
    'num_stages', None, 'partition: K, the number of stages, or several '
    'comma-separated values (e.g. 4,8). Required with --costs; default 4,8 '
    'with --example. simulate: one K, to repeat a single --forward_costs '
    'value K times. timeline: K (required), the stages and CPU devices.')
flags.DEFINE_list(
    'memory', None, 'partition: optional comma-separated memory of each cell '
    '(e.g. parameter bytes), same length as the costs. Breaks ties between '
    'equally fast partitions and is checked against --memory_limit.')
flags.DEFINE_float(
    'memory_limit', None, 'partition: optional largest memory one stage may '
    'hold (same unit as --memory); the partition respects it and Lingvo '
    'stages above it are marked.')
flags.DEFINE_list(
    'names', None, 'partition: optional comma-separated cell names for the '
    "tables (default 'cell0', 'cell1', ...; the examples name their cells).")
flags.DEFINE_list(
    'forward_costs', None, 'simulate: the forward time of one micro-batch on '
    'each chunk (K v values; K stages when v = 1), comma-separated (any '
    'unit, e.g. seconds), or one value for every chunk of --num_stages.')
flags.DEFINE_list(
    'backward_costs', None, 'simulate: the backward time of one micro-batch '
    'on each chunk, without the recompute (which costs the forward time), or '
    'one value for all. Default: twice the forward costs.')
flags.DEFINE_list(
    'weight_costs', None, 'simulate, for a schedule that splits the '
    'backward (zb1p, zbv): the part of each chunk\'s backward cost that the '
    'weight gradient (W) takes, the input gradient (B) taking the rest; or '
    'one value for all. Default: half the backward costs (F = B = W when '
    'the backward costs twice the forward).')
flags.DEFINE_integer(
    'num_micro_batches', None, 'simulate, timeline: M, the number of '
    'micro-batches per step (required).', lower_bound=1)
flags.DEFINE_integer(
    'virtual_stages', 1, 'simulate, timeline: v, the chunks per device (K v '
    'chunks, chunk c on device c mod K: a circular pipeline when v > 1).',
    lower_bound=1)
flags.DEFINE_enum(
    'schedule', 'gpipe', list(schedule.SCHEDULES), 'simulate, timeline: the '
    'schedule table of the step.')
flags.DEFINE_enum(
    'engine', 'auto', ['auto'] + list(schedule.ENGINES), 'simulate: the '
    "engine whose timing to model: 'unrolled' (each call starts as soon as it "
    "can) or 'loop' (ticks in lockstep: a tick ends when its slowest call "
    "ends). timeline: the engine that builds the traced step. 'auto': the "
    "one GPipeSequentialLayer's engine='auto' picks for K, M and --remat.")
flags.DEFINE_enum(
    'executor', 'lockstep', ['lockstep', 'per_device'], 'simulate with the '
    "loop engine: how its loops run. 'lockstep': one loop for all devices, as "
    'inside tf.function and under XLA (a tick ends when its slowest call '
    "ends, plus --tick_overhead); 'per_device': a loop per device, as in a "
    "TF1 graph such as Lingvo's trainer (dataflow: a call starts once its "
    'inputs and its device are ready).')
flags.DEFINE_float(
    'tick_overhead', 0.0, 'simulate with --engine=loop --executor=lockstep: '
    'the cost of one tick beyond its work (same unit as the costs).',
    lower_bound=0.0)
flags.DEFINE_enum(
    'remat', 'always', schedule.REMAT_MODES, 'simulate, timeline: which calls '
    "recompute their forward pass in the backward pass: 'always', "
    "'except_last' (all but the last micro-batch) or 'never'.")
flags.DEFINE_float(
    'transfer_cost', 0.0, 'simulate: time to pass one micro-batch\'s '
    'activations or gradients from one stage to the next (same unit as the '
    'costs).', lower_bound=0.0)
flags.DEFINE_bool(
    'transfers_busy', False, 'simulate, timed as dataflow (the unrolled '
    'engine, or --executor=per_device): a transfer occupies the sending '
    'stage for --transfer_cost after its call and the receiving one as long '
    'before its own (CPU processes serialize and parse what they pass), '
    'instead of only delaying the receiver.')
flags.DEFINE_list(
    'input_memory', None, 'simulate: optional size (e.g. bytes) of one '
    'micro-batch input of each chunk, or one value for all. Default 0: peak '
    'memory counts only full activations.')
flags.DEFINE_list(
    'activation_memory', None, 'simulate: optional size (e.g. bytes) of the '
    'activations one call of each chunk keeps for its backward pass (without '
    'its input), or one value for all. Default 1: peak memory is in units of '
    "one micro-batch's chunk activations.")
flags.DEFINE_integer(
    'cells_per_stage', 2, 'timeline: FC cells (Lingvo FCLayer) per chunk '
    '(per stage when v = 1).',
    lower_bound=1)
flags.DEFINE_integer(
    'fc_dim', 256, 'timeline: input and output size of every FC cell.',
    lower_bound=1)
flags.DEFINE_integer(
    'micro_batch_size', 16, 'timeline: examples per micro-batch; the batch '
    'is M times this.', lower_bound=1)
flags.DEFINE_integer(
    'warmup_steps', 2, 'timeline: untraced training steps before the traced '
    'one (the first runs optimize the graph and warm up kernels).',
    lower_bound=0)
flags.DEFINE_string(
    'png_out', None, 'simulate, timeline: optional path of a PNG picture of '
    'the step: one row per stage, a box per micro-batch and phase.')
flags.DEFINE_string(
    'trace_out', None, 'simulate, timeline: optional path of a Chrome trace '
    '(JSON) of the step, for https://ui.perfetto.dev or chrome://tracing.')

flags.DEFINE_string(
    'model', None, 'auto: a registered Lingvo model whose task has a '
    'GPipeSequentialLayer, e.g. lm.GPipeCharLm or '
    'benchmarks.fc_model.FcStack (required).')
flags.DEFINE_integer(
    'num_devices', None, 'auto: N, the devices to use (required). Each '
    'configuration is a pipeline of K devices (K divides N) and R = N / K '
    'data-parallel replicas.', lower_bound=1)
flags.DEFINE_string(
    'memory_per_device', None, 'auto: the memory of one device (required): '
    'bytes, or a number with a unit B, KiB, MiB or GiB (e.g. 512MiB). A '
    "configuration fits if its predicted peak on each device is at most "
    'this.')
flags.DEFINE_float(
    'memory_margin', 0.1, 'auto: the fraction of --memory_per_device kept '
    'free for what the model of memory does not see (docs/planning.md, '
    'measured accuracy: peaks up to 1.21x the prediction): a configuration '
    'fits if its predicted peak is at most (1 - margin) x memory_per_device.',
    lower_bound=0.0, upper_bound=0.9)
flags.DEFINE_integer(
    'batch_size', None, 'auto: B, the examples of one training step over '
    "all replicas. Default: the model's input batch_size. Each replica "
    'trains on B / R examples.', lower_bound=1)
flags.DEFINE_integer(
    'verify', 0, 'auto: train the V best configurations a few steps each (a '
    'fresh worker process each, on N logical CPU devices) and print their '
    'measured step time and per-device peak next to the predicted ones.',
    lower_bound=0)
flags.DEFINE_integer(
    'verify_steps', 10, 'auto: timed training steps per verified '
    'configuration, after 3 untimed ones. The fastest is compared with the '
    'prediction (the profile takes the fastest runs too: on a shared machine '
    'they are the least slowed by other processes); the JSON has the median '
    'too.', lower_bound=1)
flags.DEFINE_integer(
    'verify_workers', 1, 'auto: worker processes per verified configuration '
    '(and for the two steps it measures after profiling: a pipelined one '
    'for the cost of a call, the data-parallel one). The '
    'fastest step over all of them is compared and the largest peak: on a '
    '2-core machine the fastest step of one process moves by up to 2x from '
    'process to process on millisecond steps.', lower_bound=1)
flags.DEFINE_list(
    'schedules', None, 'auto: schedules to consider (default: every '
    f'schedule of the tables, now {list(schedule.SCHEDULES)}).')
flags.DEFINE_list(
    'remat_modes', list(schedule.REMAT_MODES), 'auto: remat modes to '
    'consider.')
flags.DEFINE_integer(
    'max_micro_batches', None, 'auto: the largest M to consider (default: '
    "every divisor of a replica's batch).", lower_bound=1)
flags.DEFINE_integer(
    'max_virtual_stages', None, 'auto: the largest v to consider (default: '
    'as many as the cells allow).', lower_bound=1)
flags.DEFINE_integer(
    'top', 20, 'auto: ranked configurations to print (every one is in '
    '--json_out).', lower_bound=1)
flags.DEFINE_bool(
    'processes', False, 'timeline: stage k in a server process of its own '
    'pinned to core k (benchmarks/loopback.py) instead of on logical CPU '
    'device k, so that each stage has exactly one core (on logical devices '
    "a stage's independent ops run on every core).")
flags.DEFINE_integer(
    'intra_op_threads', 1, 'auto, timeline: threads of one TensorFlow op in '
    'the profile and verification workers, or the traced step. 1 makes each '
    'logical CPU device act as one core, so that stages overlap as they '
    'would on separate devices; 0: TensorFlow\'s default (all cores).',
    lower_bound=0)
flags.DEFINE_string(
    'profile_out', None, 'auto: write the model profile (JSON) there, to '
    'plan again without profiling (--profile_in).')
flags.DEFINE_string(
    'profile_in', None, 'auto: read the profile from this file (written by '
    '--profile_out for the same --model, --num_devices and --batch_size) '
    'instead of profiling.')
flags.DEFINE_bool(
    'baselines', False, 'auto: also predict (and with --verify, measure) '
    'the defaults (K = N, uniform partition, M = 1, remat always) and '
    "Lingvo's heuristic partition for the chosen K, M and remat.")

_DEFAULT_EXAMPLE_STAGES = (4, 8)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_UNITS = {'B': 1, 'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30}
# Untimed steps of a verified configuration before the timed ones.
_VERIFY_WARMUPS = 3


class PlanError(ValueError):
  """A bad flag or argument; main prints it on one line and exits with 2."""


class NothingFits(Exception):
  """No configuration fits the memory; main prints why and exits with 1."""


def TransformerExample() -> Tuple[List[float], List[str]]:
  """A Transformer-like cost list: embedding, 24 layers, softmax."""
  costs = [0.5] + [10.0] * 24 + [40.0]
  names = ['embedding'] + [f'layer{i}' for i in range(24)] + ['softmax']
  return costs, names


def AmoebaNetExample() -> Tuple[List[float], List[str]]:
  """An AmoebaNet-D-like cost list: stem, 3 x 6 normal cells, 2 reductions."""
  costs, names = [2.0], ['stem']
  for block in range(3):
    costs += [1.0] * 6
    names += [f'normal{6 * block + i}' for i in range(6)]
    if block < 2:
      costs.append(3.0)
      names.append(f'reduction{block}')
  return costs + [0.5], names + ['head']


EXAMPLES: Dict[str, Callable[[], Tuple[List[float], List[str]]]] = {
    'transformer': TransformerExample,
    'amoebanet': AmoebaNetExample,
}


def _Numbers(flag: str,
             values: Optional[Sequence[str]]) -> Optional[List[float]]:
  """Parses a list flag of non-negative numbers."""
  if values is None:
    return None
  numbers = []
  for v in values:
    try:
      x = float(v)
    except ValueError:
      x = math.nan
    if not math.isfinite(x) or x < 0:
      raise PlanError(f'--{flag}={",".join(values)}: {v!r} is not a finite '
                      'non-negative number.')
    numbers.append(x)
  if not numbers:
    raise PlanError(f'--{flag} is empty; give comma-separated numbers.')
  return numbers


def _PartitionInputs():
  """(costs, names, memory, memory_limit, stage counts, source) from flags."""
  if (FLAGS.costs is None) == (FLAGS.example is None):
    raise PlanError('give exactly one of --costs (e.g. --costs=1,4,4,8) and '
                    f'--example (one of {sorted(EXAMPLES)}).')
  stage_counts = cli.PositiveIntsFlag('num_stages', PlanError)
  if FLAGS.example is not None:
    costs, names = EXAMPLES[FLAGS.example]()
    stage_counts = stage_counts or list(_DEFAULT_EXAMPLE_STAGES)
    source = FLAGS.example
  else:
    costs, names, source = _Numbers('costs', FLAGS.costs), None, 'costs'
    if stage_counts is None:
      raise PlanError('--num_stages is required with --costs, e.g. '
                      '--num_stages=2 or --num_stages=2,4.')
  if FLAGS.names is not None:
    if len(FLAGS.names) != len(costs):
      raise PlanError(f'--names has {len(FLAGS.names)} entries but there are '
                      f'{len(costs)} cells; give one name per cell.')
    names = list(FLAGS.names)
  names = names or [f'cell{i}' for i in range(len(costs))]
  memory = _Numbers('memory', FLAGS.memory)
  if memory is not None and len(memory) != len(costs):
    raise PlanError(f'--memory has {len(memory)} entries but there are '
                    f'{len(costs)} cells; give one per cell.')
  if FLAGS.memory_limit is not None and memory is None:
    raise PlanError(f'--memory_limit={FLAGS.memory_limit} needs --memory (the '
                    'memory of each cell).')
  return costs, names, memory, FLAGS.memory_limit, stage_counts, source


def Partition(args: Sequence[str]) -> Dict[str, Any]:
  """The `partition` subcommand: prints reports, returns the numbers.

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict of the inputs and, per K, both partitions' summaries.

  Raises:
    PlanError: on bad flags or a partition that cannot be made.
  """
  if args:
    raise PlanError(f'partition takes no positional arguments, got {args}.')
  costs, names, memory, memory_limit, stage_counts, source = (
      _PartitionInputs())
  results = []
  for num_stages in stage_counts:
    try:
      ours = partition_lib.PartitionCosts(costs, num_stages, memory,
                                          memory_limit)
    except ValueError as e:
      raise PlanError(f'--num_stages={num_stages}: {e}') from e
    print(f'=== K={num_stages} ===')
    print(report.PartitionReport(costs, ours, memory, names, memory_limit))
    result = {
        'num_stages': num_stages,
        'ours': report.PartitionSummary(costs, ours, memory, names),
        'lingvo': None,
    }
    line = f'K={num_stages}: imbalance ours {result["ours"]["imbalance"]:.3f}'
    if sum(costs) > 0:
      lingvo = partition_lib.LingvoPartition(costs, num_stages)
      result['lingvo'] = report.PartitionSummary(costs, lingvo, memory,
                                                    names)
      line += f', Lingvo {result["lingvo"]["imbalance"]:.3f}'
    print(line + '\n')
    results.append(result)
  return {
      'subcommand': 'partition',
      'source': source,
      'costs': costs,
      'names': names,
      'memory': memory,
      'memory_limit': memory_limit,
      'results': results,
  }


def _OneStageCount(subcommand: str) -> Optional[int]:
  """--num_stages as one K, or None if not given."""
  counts = cli.PositiveIntsFlag('num_stages', PlanError)
  if counts is not None and len(counts) != 1:
    raise PlanError(f'--num_stages={",".join(FLAGS.num_stages)}: {subcommand} '
                    'takes one K, e.g. --num_stages=4.')
  return None if counts is None else counts[0]


def _PerChunk(flag: str, values: Optional[Sequence[str]],
              num_chunks: int) -> Optional[List[float]]:
  """Parses a per-chunk list flag; a single value is repeated K v times."""
  numbers = _Numbers(flag, values)
  if numbers is None:
    return None
  if len(numbers) == 1:
    return numbers * num_chunks
  if len(numbers) != num_chunks:
    raise PlanError(f'--{flag} has {len(numbers)} entries but there are '
                    f'{num_chunks} chunks (K x --virtual_stages); give one '
                    'per chunk or a single value for all.')
  return numbers


def _NumMicroBatches() -> int:
  if FLAGS.num_micro_batches is None:
    raise PlanError('--num_micro_batches (M) is required, e.g. '
                    '--num_micro_batches=8.')
  return FLAGS.num_micro_batches


def _WriteOutputs(events: Sequence[simulate.Event], num_stages: int,
                  title: str,
                  time_unit: Optional[Tuple[float, str]] = None) -> None:
  """Writes --png_out and --trace_out if given."""
  if FLAGS.png_out:
    timeline.DrawTimeline(events, num_stages, FLAGS.png_out, title, time_unit)
    print(f'Wrote {FLAGS.png_out}')
  if FLAGS.trace_out:
    timeline.WriteChromeTrace(events, num_stages, FLAGS.trace_out, title)
    print(f'Wrote {FLAGS.trace_out}')


def _Bubble(num_stages: int, num_micro: int, bubble: float) -> str:
  """The bubble fraction next to GPipe's closed form (K - 1) / (M v + K - 1).
  """
  if schedule.CheckSchedule(FLAGS.schedule).split_backward:
    return (f'bubble fraction: {bubble:.4f} (GPipe\'s closed form does not '
            f'hold: {FLAGS.schedule} moves weight gradients into the bubble)')
  closed = schedule.BubbleFraction(num_stages, num_micro,
                                   FLAGS.virtual_stages)
  return (f'bubble fraction: {bubble:.4f} (closed form (K-1)/(M v+K-1) = '
          f'{closed:.4f}, exact for equal chunks without transfer cost)')


def _Engine(num_stages: int, num_micro: int) -> str:
  """--engine, with 'auto' resolved as the layer resolves it on CPU."""
  try:
    return schedule.ChooseEngine(FLAGS.engine, num_stages, num_micro,
                                 FLAGS.remat, schedule=FLAGS.schedule,
                                 virtual_stages=FLAGS.virtual_stages)
  except ValueError as e:
    raise PlanError(str(e)) from e


def _Lockstep(engine: str) -> bool:
  """Whether `simulate` times ticks in lockstep (--executor), checked.

  Args:
    engine: The resolved engine.

  Returns:
    True for the loop engine with --executor=lockstep.

  Raises:
    PlanError: on --executor with the unrolled engine, --tick_overhead
      without lockstep ticks or --transfers_busy with them.
  """
  if engine == 'unrolled' and FLAGS['executor'].present:
    raise PlanError(f'--executor={FLAGS.executor} says how the loop engine '
                    'runs its loops; the unrolled engine runs none (its calls '
                    'are timed as dataflow). Drop it or use --engine=loop.')
  lockstep = engine == 'loop' and FLAGS.executor == 'lockstep'
  if FLAGS.tick_overhead and not lockstep:
    raise PlanError(f'--tick_overhead={FLAGS.tick_overhead:g} is the cost of '
                    'a lockstep tick; the step is timed as dataflow here '
                    f'(the {engine} engine'
                    f'{", --executor=per_device" if engine == "loop" else ""}'
                    '). Drop it or use --engine=loop --executor=lockstep.')
  if FLAGS.transfers_busy and lockstep:
    raise PlanError('--transfers_busy times transfers as dataflow; a lockstep '
                    'tick counts a transfer in its own time. Add '
                    '--executor=per_device or drop it.')
  return lockstep


def _Table(num_stages: int, num_micro: int) -> schedule.Table:
  """The --schedule table for K, M and --virtual_stages."""
  try:
    return schedule.BuildTable(FLAGS.schedule, num_stages, num_micro,
                               FLAGS.virtual_stages)
  except ValueError as e:
    raise PlanError(str(e)) from e


def _MemoryUnit() -> str:
  """The line that says in what unit `simulate` prints peak memory."""
  if FLAGS.input_memory is None and FLAGS.activation_memory is None:
    return ("peak memory in units of one call's activations (inputs count "
            '0); give --input_memory and --activation_memory, e.g. in MiB, for '
            'sizes')
  return ('peak memory in the unit of --input_memory and --activation_memory '
          '(defaults 0 and 1)')


def Simulate(args: Sequence[str]) -> Dict[str, Any]:
  """The `simulate` subcommand: prints the simulated step, returns numbers.

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict of the inputs and the simulated step's numbers.

  Raises:
    PlanError: on bad flags.
  """
  if args:
    raise PlanError(f'simulate takes no positional arguments, got {args}.')
  if FLAGS.forward_costs is None:
    raise PlanError('--forward_costs is required, e.g. --forward_costs=1,1,2 '
                    'or --forward_costs=1 --num_stages=4.')
  virtual = FLAGS.virtual_stages
  num_stages = _OneStageCount('simulate')
  if num_stages is None:
    if len(FLAGS.forward_costs) % virtual:
      raise PlanError(f'--forward_costs has {len(FLAGS.forward_costs)} '
                      f'entries, not a multiple of --virtual_stages={virtual}'
                      '; give one per chunk, or --num_stages.')
    num_stages = len(FLAGS.forward_costs) // virtual
  num_chunks = num_stages * virtual
  forward = _PerChunk('forward_costs', FLAGS.forward_costs, num_chunks)
  backward = (_PerChunk('backward_costs', FLAGS.backward_costs, num_chunks)
              or [2 * f for f in forward])
  input_memory = _PerChunk('input_memory', FLAGS.input_memory, num_chunks)
  activation_memory = _PerChunk('activation_memory', FLAGS.activation_memory,
                                num_chunks)
  num_micro = _NumMicroBatches()
  table = _Table(num_stages, num_micro)
  engine = _Engine(num_stages, num_micro)
  lockstep = _Lockstep(engine)
  weight = None
  if table.split_backward:
    weight = (_PerChunk('weight_costs', FLAGS.weight_costs, num_chunks) or
              [b / 2 for b in backward])
  elif FLAGS.weight_costs is not None:
    raise PlanError(f'--weight_costs: schedule {FLAGS.schedule!r} does not '
                    "split the backward; only 'zb1p' and 'zbv' run weight "
                    'gradients apart.')
  try:
    sim = simulate.Simulate(table, forward, backward, FLAGS.remat,
                            FLAGS.transfer_cost, input_memory,
                            activation_memory, lockstep=lockstep,
                            tick_overhead=FLAGS.tick_overhead,
                            weight_costs=weight,
                            transfers_busy=FLAGS.transfers_busy)
  except ValueError as e:
    raise PlanError(str(e)) from e
  shape = (f'K={num_stages}, v={virtual}, M={num_micro}, remat={FLAGS.remat},'
           f' {engine} engine'
           f'{f" ({FLAGS.executor} loops)" if engine == "loop" else ""}')
  print(f'Simulated {FLAGS.schedule} step: {shape}, transfer cost '
        f'{FLAGS.transfer_cost:g}'
        f'{" (busy on both stages)" if FLAGS.transfers_busy else ""}')
  if weight is not None:
    print('backward split: weight gradients (W) cost '
          f'{",".join(f"{w:g}" for w in weight)} of the backward costs '
          f'{",".join(f"{b:g}" for b in backward)} per chunk'
          f'{"" if FLAGS.weight_costs else " (default: half)"}')
  print(f'step time: {sim.step_time:.6g} (forwards end at '
        f'{sim.forward_time:.6g})')
  print(_Bubble(num_stages, num_micro, sim.bubble_fraction))
  print('stage  chunks  utilization  peak memory  held then')
  for k in range(num_stages):
    chunks = ','.join(str(c) for c in table.device_chunks[k])
    print(f'{k:5d}  {chunks:>6}  {sim.utilization[k]:11.3f}  '
          f'{sim.peak_memory[k]:11.4g}  '
          f'{sim.peak_inputs[k]} inputs + activations of '
          f'{sim.peak_activations[k]} call'
          f'{"" if sim.peak_activations[k] == 1 else "s"}'
          + (f' + {sim.peak_weights_waiting[k]} W stashes'
             if table.split_backward else ''))
  print(_MemoryUnit())
  _WriteOutputs(sim.events, num_stages,
                f'Simulated {FLAGS.schedule} step: {shape}, bubble '
                f'{sim.bubble_fraction:.3f}', (1.0, 'unit of the costs'))
  return {
      'subcommand': 'simulate',
      'schedule': FLAGS.schedule,
      'num_stages': num_stages,
      'virtual_stages': virtual,
      'engine': engine,
      'executor': FLAGS.executor if engine == 'loop' else None,
      'forward_costs': forward,
      'backward_costs': backward,
      'weight_costs': weight,
      'num_micro_batches': num_micro,
      'remat': FLAGS.remat,
      'transfer_cost': FLAGS.transfer_cost,
      'transfers_busy': FLAGS.transfers_busy,
      'tick_overhead': FLAGS.tick_overhead,
      'input_memory': input_memory,
      'activation_memory': activation_memory,
      'step_time': sim.step_time,
      'forward_time': sim.forward_time,
      'bubble_fraction': sim.bubble_fraction,
      'closed_form_bubble_fraction': schedule.BubbleFraction(
          num_stages, num_micro, virtual),
      'utilization': sim.utilization,
      'peak_memory': sim.peak_memory,
      'peak_inputs': sim.peak_inputs,
      'peak_activations': sim.peak_activations,
  }


def Timeline(args: Sequence[str]) -> Dict[str, Any]:
  """The `timeline` subcommand: traces a real step, prints and draws it.

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict of the configuration, the measured numbers and events.

  Raises:
    PlanError: on bad flags, or if the trace cannot be mapped to the calls.
  """
  if args:
    raise PlanError(f'timeline takes no positional arguments, got {args}.')
  num_stages = _OneStageCount('timeline')
  if num_stages is None:
    raise PlanError('--num_stages (K) is required, e.g. --num_stages=4.')
  num_micro = _NumMicroBatches()
  remat, virtual = FLAGS.remat, FLAGS.virtual_stages
  engine = _Engine(num_stages, num_micro)
  _Table(num_stages, num_micro)  # Checks the sizes before building anything.
  if FLAGS.processes and len(os.sched_getaffinity(0)) < num_stages:
    raise PlanError(f'--processes pins stage k to a core of its own, and '
                    f'--num_stages={num_stages} is more than the '
                    f'{len(os.sched_getaffinity(0))} cores this process may '
                    'run on.')
  try:
    traced = traced_step.TraceStep(num_stages, num_micro, remat,
                                   FLAGS.cells_per_stage, FLAGS.fc_dim,
                                   FLAGS.micro_batch_size, FLAGS.warmup_steps,
                                   engine, virtual, FLAGS.intra_op_threads,
                                   FLAGS.schedule, FLAGS.processes)
  except ValueError as e:
    raise PlanError(str(e)) from e
  events, devices = traced.events, traced.devices
  occupancy, means, sim = (traced.occupancy, traced.mean_durations,
                           traced.simulated)
  factor, unit = timeline.TimeUnit(occupancy.step_time)
  shape = f'K={num_stages}, v={virtual}, M={num_micro}, remat={remat}'
  # The loop engine's executor, as the trace shows it ran.
  runs_as = f'{engine} engine' + (f', {traced.executor} executor'
                                  if engine == 'loop' else '')
  where = ('processes pinned to a core each' if FLAGS.processes else
           'CPU devices')
  print(f'Traced {FLAGS.schedule} step, {runs_as}'
        f'{" (loops lowered)" if engine == "loop" else ""}: {shape}, '
        f'{num_stages} {where}, {FLAGS.cells_per_stage} FC cells of '
        f'{FLAGS.fc_dim} per chunk, micro-batch size {FLAGS.micro_batch_size}')
  measured_on = host.Describe()
  print(f'Measured on {host.Summary(measured_on)}.')
  print(f'step time (first to last call): '
        f'{occupancy.step_time * factor:.4g} {unit}')
  print(_Bubble(num_stages, num_micro, occupancy.bubble_fraction))
  print('Order of calls per stage (F forward, R recompute, B backward, W '
        'weight gradient; <chunk>.<micro-batch>):')
  for k in range(num_stages):
    order = ' '.join(f'{e.phase[0].upper()}{e.chunk}.{e.micro_batch}'
                     for e in events if e.stage == k)
    print(f'  stage {k}: {order}')
  print(f'chunk  stage  mean forward  mean recompute  mean backward  '
        f'mean weight ({unit})')
  for c in range(traced.table.num_chunks):
    cells = [f'{means[phase][c] * factor:.4g}' if means[phase][c] else '-'
             for phase in schedule.PHASES]
    print(f'{c:5d}  {traced.table.Device(c):5d}  {cells[0]:>12}  '
          f'{cells[1]:>14}  {cells[2]:>13}  {cells[3]:>11}')
  print('stage  utilization  devices')
  for k in range(num_stages):
    print(f'{k:5d}  {occupancy.utilization[k]:11.3f}  '
          f'{", ".join(d.split("/")[-1] for d in devices[k])}')
  if FLAGS.processes:
    print(f'a transfer of one micro-batch between the processes costs each '
          f'{traced.transfer_s * factor:.4g} {unit} (simulated so)')
  print(f'simulated from the mean call times ({runs_as}): step '
        f'{sim.step_time * factor:.4g} {unit}, bubble fraction '
        f'{sim.bubble_fraction:.3f}; measured / simulated step: '
        f'{occupancy.step_time / sim.step_time:.2f}')
  _WriteOutputs(events, num_stages,
                f'Traced {FLAGS.schedule} step, {runs_as}: {shape}, '
                f'bubble {occupancy.bubble_fraction:.3f}', (factor, unit))
  return {
      'subcommand': 'timeline',
      'host': measured_on,
      'schedule': FLAGS.schedule,
      'engine': engine,
      'executor': traced.executor,
      'num_stages': num_stages,
      'virtual_stages': virtual,
      'num_micro_batches': num_micro,
      'remat': remat,
      'processes': FLAGS.processes,
      'transfer_s': traced.transfer_s,
      'step_time': occupancy.step_time,
      'bubble_fraction': occupancy.bubble_fraction,
      'closed_form_bubble_fraction': schedule.BubbleFraction(
          num_stages, num_micro, virtual),
      'utilization': occupancy.utilization,
      'simulated_step_time': sim.step_time,
      'simulated_bubble_fraction': sim.bubble_fraction,
      'devices': {str(k): d for k, d in devices.items()},
      'events': [e._asdict() for e in events],
  }


def ParseBytes(flag: str, text: Optional[str]) -> float:
  """'512MiB' -> 536870912.0; PlanError naming the flag unless valid."""
  if text is None:
    raise PlanError(f'--{flag} is required, e.g. --{flag}=512MiB.')
  value = text.strip()
  unit = 'B'
  for name in _UNITS:
    if value.endswith(name) and name != 'B':
      value, unit = value[:-len(name)], name
      break
  else:
    if value.endswith('B'):
      value = value[:-1]
  try:
    number = float(value)
  except ValueError:
    number = math.nan
  if not math.isfinite(number) or number <= 0:
    raise PlanError(f'--{flag}={text}: give a positive number of bytes, '
                    f'optionally with a unit of {list(_UNITS)} (e.g. 512MiB).')
  return number * _UNITS[unit]


def _LoadProfile() -> Tuple[profile_lib.Profile, Dict[str, Any]]:
  """The profile: from --profile_in, or measured in a worker."""
  if FLAGS.profile_in:
    try:
      with open(FLAGS.profile_in) as f:
        raw = json.load(f)
      profile = profile_lib.Profile.FromJson(raw)
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise PlanError(f'--profile_in={FLAGS.profile_in}: cannot read a '
                      f'profile ({type(e).__name__}: {e}).') from e
    if raw.get('model') != FLAGS.model:
      raise PlanError(f'--profile_in={FLAGS.profile_in} profiles '
                      f'{raw.get("model")!r}, not --model={FLAGS.model!r}.')
    if FLAGS.batch_size and profile.batch_size != FLAGS.batch_size:
      raise PlanError(f'--profile_in={FLAGS.profile_in} was made with batch '
                      f'size {profile.batch_size}, not --batch_size='
                      f'{FLAGS.batch_size}.')
    return profile, raw
  config = {
      'action': 'profile',
      'model': FLAGS.model,
      'batch_size': FLAGS.batch_size,
      'intra_op_threads': FLAGS.intra_op_threads,
  }
  config['num_devices'] = FLAGS.num_devices
  print(f'Profiling {FLAGS.model} (a worker process: every cell on two '
        'micro-batch sizes, and the task around the pipeline) ...',
        flush=True)
  try:
    raw = plan_worker.RunWorker(config, _ROOT)
  except plan_worker.WorkerError as e:
    raise PlanError(str(e)) from e
  profile = profile_lib.Profile.FromJson(raw)
  calibration = calibrate.CalibrationCandidate(profile, FLAGS.num_devices)
  if calibration is not None:
    # What a chunk call costs in a pipeline beyond its cells: one pipelined
    # step, measured.
    print(f'Measuring a pipelined step ({calibration.Describe()}) ...',
          flush=True)
    _Measure(profile, calibration, FLAGS.num_devices)
    profile = dataclasses.replace(
        profile,
        call_overhead_s=calibrate.CalibrateCallOverhead(
            profile, calibration, calibration.measured_step_s))
    raw['call_overhead_s'] = profile.call_overhead_s
  if FLAGS.num_devices > 1 and profile.batch_size % FLAGS.num_devices == 0:
    # What data parallelism costs beyond the model: its step and its peak,
    # measured.
    replicated = predict.Predict(
        profile,
        profile_lib.PipelineShape(num_stages=1, num_micro_batches=1,
                                  remat='never', replicas=FLAGS.num_devices),
        [profile.num_cells])
    print(f'Measuring the data-parallel step ({replicated.Describe()}) ...',
          flush=True)
    _Measure(profile, replicated, FLAGS.num_devices)
    profile = dataclasses.replace(
        profile,
        replica_overhead_s=max(
            replicated.measured_step_s - replicated.predicted_step_s, 0.0),
        replica_overhead_bytes=max(
            replicated.measured_peak_bytes - replicated.predicted_peak_bytes,
            0.0))
    raw['replica_overhead_s'] = profile.replica_overhead_s
    raw['replica_overhead_bytes'] = profile.replica_overhead_bytes
    raw['replica_step'] = replicated.ToJson()  # What they were derived from.
  if FLAGS.profile_out:
    with open(FLAGS.profile_out, 'w') as f:
      json.dump(raw, f, indent=2)
    print(f'Wrote {FLAGS.profile_out}')
  return profile, raw


def _CheckAutoFlags() -> None:
  if not FLAGS.model:
    raise PlanError('--model is required, e.g. --model=lm.GPipeCharLm.')
  if FLAGS.num_devices is None:
    raise PlanError('--num_devices (N) is required, e.g. --num_devices=2.')
  for name in FLAGS.schedules or []:
    if name not in schedule.SCHEDULES:
      raise PlanError(f'--schedules={",".join(FLAGS.schedules)}: {name!r} is '
                      f'not a schedule; use some of {list(schedule.SCHEDULES)}.')
  for remat in FLAGS.remat_modes:
    if remat not in schedule.REMAT_MODES:
      raise PlanError(f'--remat_modes={",".join(FLAGS.remat_modes)}: '
                      f'{remat!r} is not a remat mode; use some of '
                      f'{list(schedule.REMAT_MODES)}.')


def _Measure(profile: profile_lib.Profile, candidate: profile_lib.Candidate,
             num_devices: int) -> None:
  """Trains `candidate` a few steps in workers; fills its measured fields."""
  config = {
      'action': 'measure',
      'model': profile.model,
      'overrides': '; '.join(search_report.OverrideLines(profile, candidate)),
      'num_devices': num_devices,
      'split_size': candidate.num_stages,
      'warmups': _VERIFY_WARMUPS,
      'steps': FLAGS.verify_steps,
      'intra_op_threads': FLAGS.intra_op_threads,
  }
  try:
    runs = [plan_worker.RunWorker(config, _ROOT)
            for _ in range(FLAGS.verify_workers)]
  except plan_worker.WorkerError as e:
    raise PlanError(f'verifying {candidate.Describe()}: {e}') from e
  # Device j of the machine is device j mod K of its replica's pipeline.
  per_stage = [0.0] * candidate.num_stages
  for measured in runs:
    for j, size in enumerate(measured['device_peak_bytes']):
      k = j % candidate.num_stages
      per_stage[k] = max(per_stage[k], size)
  candidate.measured_step_s = min(m['step_s'] for m in runs)
  candidate.measured_median_step_s = statistics.median(
      m['median_step_s'] for m in runs)
  candidate.measured_device_peak_bytes = per_stage
  candidate.measured_peak_bytes = max(per_stage)


def _VerifyTable(candidates: Sequence[profile_lib.Candidate],
                 labels: Sequence[str], budget: float) -> str:
  """Predicted against measured, one line per candidate and per device."""
  lines = [f'{"":<10} {"configuration":<44} {"step ms pred":>12} '
           f'{"meas":>8} {"ratio":>6}  {"peak pred":>10} {"meas":>10} '
           f'{"ratio":>6}  fits (meas)']
  for label, c in zip(labels, candidates):
    if c.measured_step_s is None:
      continue
    fits = 'yes' if c.measured_peak_bytes <= budget else 'NO'
    lines.append(
        f'{label:<10} {c.Describe():<44} {c.predicted_step_s * 1e3:>12.2f} '
        f'{c.measured_step_s * 1e3:>8.2f} '
        f'{c.measured_step_s / c.predicted_step_s:>6.2f}  '
        f'{search_report.FormatBytes(c.predicted_peak_bytes):>10} '
        f'{search_report.FormatBytes(c.measured_peak_bytes):>10} '
        f'{c.measured_peak_bytes / c.predicted_peak_bytes:>6.2f}  {fits}')
    for k, (pred, meas) in enumerate(zip(c.device_peak_bytes,
                                         c.measured_device_peak_bytes)):
      lines.append(f'{"":<10}   device {k}: peak predicted '
                   f'{search_report.FormatBytes(pred)}, measured '
                   f'{search_report.FormatBytes(meas)} ({meas / pred:.2f})')
  return '\n'.join(lines)


def _Baselines(
    profile: profile_lib.Profile, best: Optional[profile_lib.Candidate],
    num_devices: int, budget: float,
    schedule_name: str) -> List[Tuple[str, profile_lib.Candidate]]:
  """The defaults and Lingvo's heuristic partition, predicted."""
  baselines = []
  num_stages = min(num_devices, profile.num_cells)
  while num_devices % num_stages:
    num_stages -= 1
  replicas = num_devices // num_stages
  defaults = predict.Predict(
      profile,
      profile_lib.PipelineShape(num_stages=num_stages, num_micro_batches=1,
                                remat='always', schedule=schedule_name,
                                replicas=replicas),
      partition_lib.UniformPartition(profile.num_cells, num_stages),
      memory_per_device=budget, partition_rule='uniform')
  baselines.append(('defaults', defaults))
  if best is not None:
    micro = best.shape.MicroBatchSize(profile.batch_size)
    costs = [c.forward_s(micro) + c.backward_s(micro) for c in profile.cells]
    lingvo = partition_lib.LingvoPartition(
        costs, best.num_stages * best.virtual_stages)
    if 0 in lingvo:
      print(f"Lingvo's heuristic partition for {best.Describe()} is {lingvo}, "
            'with an empty stage: it cannot run.')
    else:
      baselines.append(('lingvo', predict.Predict(
          profile, best.shape, lingvo, memory_per_device=budget,
          partition_rule='lingvo_heuristic')))
  return baselines


def Auto(args: Sequence[str]) -> Dict[str, Any]:
  """The `auto` subcommand: plans a registered model; returns the numbers.

  Args:
    args: Positional arguments after the subcommand (must be empty).

  Returns:
    A JSON-ready dict: {"candidates": [...], "chosen": index, ...}.

  Raises:
    PlanError: on bad flags or a failed worker.
    NothingFits: if no configuration fits (after writing --json_out).
  """
  if args:
    raise PlanError(f'auto takes no positional arguments, got {args}.')
  _CheckAutoFlags()
  budget = ParseBytes('memory_per_device', FLAGS.memory_per_device)
  planned = budget * (1.0 - FLAGS.memory_margin)
  num_devices = FLAGS.num_devices
  profile, raw = _LoadProfile()
  print(f'{profile.model}: {profile.num_cells} cells '
        f'({", ".join(c.name for c in profile.cells)}), batch '
        f'{profile.batch_size}, {num_devices} devices of '
        f'{search_report.FormatBytes(budget)} (planned to '
        f'{search_report.FormatBytes(planned)}: --memory_margin='
        f'{FLAGS.memory_margin:g}); cells profiled on micro-batches of '
        f'{list(profile.profiled_sizes)}.')
  if raw.get('host'):
    print(f'Profiled on {host.Summary(raw["host"])}.')
  try:
    result = search.Search(profile, num_devices=num_devices,
                           memory_per_device=planned,
                           schedules=FLAGS.schedules,
                           remats=FLAGS.remat_modes,
                           max_micro_batches=FLAGS.max_micro_batches,
                           max_virtual_stages=FLAGS.max_virtual_stages)
  except ValueError as e:
    raise PlanError(str(e)) from e
  print(search_report.FormatTable(result, FLAGS.top))
  for line in result.skipped:
    print(f'not searched: {line}')
  numbers = {
      'subcommand': 'auto',
      'model': profile.model,
      'num_devices': num_devices,
      'memory_per_device': budget,
      'memory_margin': FLAGS.memory_margin,
      'batch_size': profile.batch_size,
      'host': raw.get('host'),
      'candidates': result.candidates,
      'chosen': result.chosen,
      'skipped': result.skipped,
      'reason': search_report.Reason(result),
      'overrides': None,
      'baselines': [],
      'profile': raw,
  }
  best = (result.candidates[result.chosen] if result.chosen is not None
          else None)
  verified = []
  if best is not None:
    overrides = search_report.OverrideLines(profile, best)
    numbers['overrides'] = overrides
    print(f'\nChosen: {numbers["reason"]}')
    print('Select it with:')
    print(f"  --model_params_override='{'; '.join(overrides)}'")
    print(f'  python tools/train.py --model={profile.model} '
          f'--num_devices={num_devices} --split_size={best.num_stages} '
          f"--model_params_override='{'; '.join(overrides)}' --logdir=...")
    verified = [(f'#{i}', c) for i, c in
                enumerate(result.candidates[:FLAGS.verify])]
  elif FLAGS.verify:
    print('Nothing fits: nothing to verify.')
  if FLAGS.baselines:
    usable = [c.schedule for c in result.candidates] or ['gpipe']
    baselines = _Baselines(profile, best, num_devices, planned, usable[0])
    print('\nBaselines (predicted):')
    for label, c in baselines:
      print(f'  {label:<9} {c.Describe()}: step '
            f'{c.predicted_step_s * 1e3:.2f} ms, peak '
            f'{search_report.FormatBytes(c.predicted_peak_bytes)}'
            f'{"" if c.fits else " (over budget)"}')
    numbers['baselines'] = [dict(label=label, **c.ToJson())
                            for label, c in baselines]
    if FLAGS.verify:
      verified += baselines
  if verified:
    print(f'\nVerifying {len(verified)} configuration(s), each '
          f'{_VERIFY_WARMUPS} + {FLAGS.verify_steps} training steps in '
          f'{FLAGS.verify_workers} fresh worker(s) ...', flush=True)
    for label, c in verified:
      _Measure(profile, c, num_devices)
      print(f'  {label}: {c.Describe()}: step '
            f'{c.measured_step_s * 1e3:.2f} ms, peak '
            f'{search_report.FormatBytes(c.measured_peak_bytes)}', flush=True)
    print(_VerifyTable([c for _, c in verified], [l for l, _ in verified],
                       budget))
    if FLAGS.baselines:
      numbers['baselines'] = [dict(label=label, **c.ToJson())
                              for label, c in verified
                              if not label.startswith('#')]
    if best is not None and best.measured_peak_bytes > budget:
      print(f'warning: the chosen configuration measured '
            f'{search_report.FormatBytes(best.measured_peak_bytes)}, over the '
            f'budget of {search_report.FormatBytes(budget)}.')
  numbers['candidates'] = [c.ToJson() for c in result.candidates]
  if best is None:
    if FLAGS.json_out:
      with open(FLAGS.json_out, 'w') as f:
        json.dump(numbers, f, indent=2)
      print(f'Wrote {FLAGS.json_out}')
    raise NothingFits(search_report.NothingFits(
        result, f'{search_report.FormatBytes(planned)} (memory_per_device='
        f'{budget:.0f}, {search_report.FormatBytes(budget)}, less '
        f'--memory_margin={FLAGS.memory_margin:g})'))
  return numbers


# Subcommand name -> function(positional args) -> JSON-ready dict.
SUBCOMMANDS: Dict[str, Callable[[Sequence[str]], Dict[str, Any]]] = {
    'partition': Partition,
    'simulate': Simulate,
    'timeline': Timeline,
    'auto': Auto,
}


if __name__ == '__main__':
  try:
    cli.Run('plan.py', SUBCOMMANDS, (PlanError,),
            'plan.py partition --costs=1,4,4,8 --num_stages=2')
  except NothingFits as e:
    print(f'plan.py: auto: {e}', file=sys.stderr)
    sys.exit(1)
