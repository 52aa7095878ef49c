"""Plans a GPipe pipeline before running it, and shows how a step runs.

    python tools/plan.py partition --costs=1,4,4,4,8 --num_stages=2
    python tools/plan.py partition --example=amoebanet --num_stages=4,8
    python tools/plan.py partition --example=transformer --json_out=/tmp/p.json
    python tools/plan.py simulate --forward_costs=1 --num_stages=4 \
        --num_micro_batches=8 --png_out=/tmp/sim.png
    python tools/plan.py timeline --num_stages=4 --num_micro_batches=8 \
        --png_out=/tmp/timeline.png --trace_out=/tmp/timeline.json

Subcommands (the first argument that is not a flag):
  partition  For each K, the stages chosen by `partition.PartitionCosts`
             (their cells, cost, share, memory, imbalance) next to Lingvo's
             heuristic (`gpipe.PartitionSequentialLayers`).
  simulate   Times one step from per-stage forward/backward costs with
             `schedule.Simulate`: step time, bubble fraction (next to the
             closed form), per-stage utilization and peak activation memory;
             optionally draws the schedule (--png_out, --trace_out).
  timeline   Runs a real training step of a small GPipeSequentialLayer (FC
             cells, K stages on K logical CPU devices, TF1 session with
             FULL_TRACE) and shows which stage ran which micro-batch and
             phase when: a table, and the same picture and trace as simulate.

Pictures (--png_out) have one row per stage and a box per call phase
(forward, recompute, backward), labelled with its micro-batch. Traces
(--trace_out) are Chrome trace JSON: open them in https://ui.perfetto.dev or
chrome://tracing.

TensorFlow, Lingvo and matplotlib are imported only by the subcommands that
need them, so that `simulate` answers in well under a second.
"""

import collections
import json
import math
import re
from typing import (Any, Callable, Dict, List, NamedTuple, Optional, Sequence,
                    Tuple)

from absl import flags

import cli  # tools/cli.py
from lingvo_gpipe import partition as partition_lib
from lingvo_gpipe import schedule

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
    'each stage, comma-separated (any unit, e.g. seconds), or one value for '
    'every stage of --num_stages.')
flags.DEFINE_list(
    'backward_costs', None, 'simulate: the backward time of one micro-batch '
    'on each stage, without the recompute (which costs the forward time), or '
    'one value for all. Default: twice the forward costs.')
flags.DEFINE_integer(
    'num_micro_batches', None, 'simulate, timeline: M, the number of '
    'micro-batches per step (required).', lower_bound=1)
flags.DEFINE_enum(
    'remat', 'always', schedule.REMAT_MODES, 'simulate, timeline: which calls '
    "recompute their forward pass in the backward pass: 'always', "
    "'except_last' (all but the last micro-batch) or 'never'.")
flags.DEFINE_float(
    'transfer_cost', 0.0, 'simulate: time to pass one micro-batch\'s '
    'activations or gradients from one stage to the next (same unit as the '
    'costs).', lower_bound=0.0)
flags.DEFINE_list(
    'input_memory', None, 'simulate: optional size (e.g. bytes) of one '
    'micro-batch input of each stage, or one value for all. Default 0: peak '
    'memory counts only full activations.')
flags.DEFINE_list(
    'activation_memory', None, 'simulate: optional size (e.g. bytes) of the '
    'activations one call of each stage keeps for its backward pass (without '
    'its input), or one value for all. Default 1: peak memory is in units of '
    "one micro-batch's stage activations.")
flags.DEFINE_integer(
    'cells_per_stage', 2, 'timeline: FC cells (Lingvo FCLayer) per stage.',
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

_DEFAULT_EXAMPLE_STAGES = (4, 8)

# Picture and trace colours of the phases of a stage call.
PHASE_COLORS = {
    'forward': '#4C72B0',
    'recompute': '#DD8452',
    'backward': '#55A868',
}
# Label boxes with their micro-batch only if there are at most this many.
_MAX_LABELLED_EVENTS = 600


class PlanError(ValueError):
  """A bad flag or argument; main prints it on one line and exits with 2."""


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


def _StageCounts(values: Optional[Sequence[str]]) -> Optional[List[int]]:
  """Parses --num_stages into positive ints."""
  if values is None:
    return None
  counts = []
  for v in values:
    if not v.strip().isdigit() or int(v) < 1:
      raise PlanError(f'--num_stages={",".join(values)}: {v!r} is not a '
                      'positive int.')
    counts.append(int(v))
  if not counts:
    raise PlanError('--num_stages is empty; give e.g. --num_stages=4,8.')
  return counts


def _PartitionInputs():
  """(costs, names, memory, memory_limit, stage counts, source) from flags."""
  if (FLAGS.costs is None) == (FLAGS.example is None):
    raise PlanError('give exactly one of --costs (e.g. --costs=1,4,4,8) and '
                    f'--example (one of {sorted(EXAMPLES)}).')
  stage_counts = _StageCounts(FLAGS.num_stages)
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
  # costs.py imports Lingvo (seconds); only this subcommand needs it.
  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe import costs as costs_lib
  # pylint: enable=g-import-not-at-top
  results = []
  for num_stages in stage_counts:
    try:
      ours = partition_lib.PartitionCosts(costs, num_stages, memory,
                                          memory_limit)
    except ValueError as e:
      raise PlanError(f'--num_stages={num_stages}: {e}') from e
    print(f'=== K={num_stages} ===')
    print(costs_lib.PartitionReport(costs, ours, memory, names, memory_limit))
    result = {
        'num_stages': num_stages,
        'ours': costs_lib.PartitionSummary(costs, ours, memory, names),
        'lingvo': None,
    }
    line = f'K={num_stages}: imbalance ours {result["ours"]["imbalance"]:.3f}'
    if sum(costs) > 0:
      lingvo = partition_lib.LingvoPartition(costs, num_stages)
      result['lingvo'] = costs_lib.PartitionSummary(costs, lingvo, memory,
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
  counts = _StageCounts(FLAGS.num_stages)
  if counts is not None and len(counts) != 1:
    raise PlanError(f'--num_stages={",".join(FLAGS.num_stages)}: {subcommand} '
                    'takes one K, e.g. --num_stages=4.')
  return None if counts is None else counts[0]


def _PerStage(flag: str, values: Optional[Sequence[str]],
              num_stages: int) -> Optional[List[float]]:
  """Parses a per-stage list flag; a single value is repeated K times."""
  numbers = _Numbers(flag, values)
  if numbers is None:
    return None
  if len(numbers) == 1:
    return numbers * num_stages
  if len(numbers) != num_stages:
    raise PlanError(f'--{flag} has {len(numbers)} entries but there are '
                    f'{num_stages} stages; give one per stage or a single '
                    'value for all.')
  return numbers


def _NumMicroBatches() -> int:
  if FLAGS.num_micro_batches is None:
    raise PlanError('--num_micro_batches (M) is required, e.g. '
                    '--num_micro_batches=8.')
  return FLAGS.num_micro_batches


def _TimeUnit(span: float) -> Tuple[float, str]:
  """(factor, unit name) to show times of a step lasting `span` seconds."""
  for factor, unit in ((1.0, 's'), (1e3, 'ms')):
    if span * factor >= 1.0:
      return factor, unit
  return 1e6, 'us'


def DrawTimeline(events: Sequence[schedule.Event], num_stages: int, path: str,
                 title: str, time_unit: Optional[Tuple[float, str]] = None
                ) -> None:
  """Draws a step as a PNG: one row per stage, one box per call phase.

  Boxes are coloured by phase (`PHASE_COLORS`) and, when there are few enough
  to read, labelled with their micro-batch, so the pipeline's fill, steady
  state and drain show at a glance.

  Args:
    events: The step's events (simulated or measured), times in seconds.
    num_stages: K, the number of rows.
    path: Where to write the PNG.
    title: The picture's title.
    time_unit: (factor, name) for the time axis; default: chosen from the
      step's length (s, ms or us).
  """
  # Only the subcommands that draw need matplotlib (it takes a while to load).
  # pylint: disable=g-import-not-at-top
  from matplotlib import figure
  from matplotlib import patches
  # pylint: enable=g-import-not-at-top
  end = max(e.end for e in events)
  factor, unit = time_unit or _TimeUnit(end)
  height = 1.5 + min(0.5 * num_stages, 6 + 0.12 * num_stages)
  fig = figure.Figure(figsize=(12, height), layout='constrained')
  ax = fig.add_subplot()
  boxes = collections.defaultdict(list)
  for e in events:
    boxes[e.stage, e.phase].append(
        (e.start * factor, (e.end - e.start) * factor))
  edge = 0.5 if len(events) <= _MAX_LABELLED_EVENTS * 4 else 0.0
  for (stage, phase), ranges in boxes.items():
    ax.broken_barh(ranges, (stage - 0.4, 0.8),
                   facecolors=PHASE_COLORS[phase], edgecolor='white',
                   linewidth=edge)
  if len(events) <= _MAX_LABELLED_EVENTS:
    min_width = end * factor / 120
    for e in events:
      width = (e.end - e.start) * factor
      if width >= min_width:
        ax.text((e.start * factor) + width / 2, e.stage, str(e.micro_batch),
                ha='center', va='center', fontsize=7, color='white')
  ax.set_ylim(num_stages - 0.5, -0.5)
  step = max(1, num_stages // 32)
  ax.set_yticks(range(0, num_stages, step))
  ax.set_yticklabels([f'stage {k}' for k in range(0, num_stages, step)])
  ax.set_xlim(0, end * factor)
  ax.set_xlabel(f'time ({unit})')
  ax.set_title(title, fontsize=10)
  ax.grid(axis='x', alpha=0.3)
  ax.legend(
      handles=[patches.Patch(color=c, label=p)
               for p, c in PHASE_COLORS.items()],
      loc='upper left', bbox_to_anchor=(1.0, 1.0), fontsize=8)
  fig.savefig(path, dpi=110)


def WriteChromeTrace(events: Sequence[schedule.Event], num_stages: int,
                     path: str, name: str) -> None:
  """Writes a step as a Chrome trace: one thread (row) per stage.

  Each call phase is a complete ('X') event named '<phase> <micro-batch>',
  with the phase as its category; times are microseconds.

  Args:
    events: The step's events, times in seconds.
    num_stages: K.
    path: Where to write the JSON.
    name: The process name shown above the rows.
  """
  trace = [{'name': 'process_name', 'ph': 'M', 'pid': 0,
            'args': {'name': name}}]
  for k in range(num_stages):
    trace.append({'name': 'thread_name', 'ph': 'M', 'pid': 0, 'tid': k,
                  'args': {'name': f'stage {k}'}})
    trace.append({'name': 'thread_sort_index', 'ph': 'M', 'pid': 0,
                  'tid': k, 'args': {'sort_index': k}})
  for e in events:
    trace.append({
        'name': f'{e.phase} {e.micro_batch}',
        'cat': e.phase,
        'ph': 'X',
        'ts': e.start * 1e6,
        'dur': (e.end - e.start) * 1e6,
        'pid': 0,
        'tid': e.stage,
        'args': {'stage': e.stage, 'micro_batch': e.micro_batch,
                 'phase': e.phase},
    })
  with open(path, 'w') as f:
    json.dump({'traceEvents': trace, 'displayTimeUnit': 'ms'}, f)


def _WriteOutputs(events: Sequence[schedule.Event], num_stages: int,
                  title: str,
                  time_unit: Optional[Tuple[float, str]] = None) -> None:
  """Writes --png_out and --trace_out if given."""
  if FLAGS.png_out:
    DrawTimeline(events, num_stages, FLAGS.png_out, title, time_unit)
    print(f'Wrote {FLAGS.png_out}')
  if FLAGS.trace_out:
    WriteChromeTrace(events, num_stages, FLAGS.trace_out, title)
    print(f'Wrote {FLAGS.trace_out}')


def _Bubble(num_stages: int, num_micro: int, bubble: float) -> str:
  """The bubble fraction next to the closed form (K - 1) / (M + K - 1)."""
  closed = schedule.BubbleFraction(num_stages, num_micro)
  return (f'bubble fraction: {bubble:.4f} (closed form (K-1)/(M+K-1) = '
          f'{closed:.4f}, exact for equal stages without transfer cost)')


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
  num_stages = _OneStageCount('simulate') or len(FLAGS.forward_costs)
  forward = _PerStage('forward_costs', FLAGS.forward_costs, num_stages)
  backward = (_PerStage('backward_costs', FLAGS.backward_costs, num_stages)
              or [2 * f for f in forward])
  input_memory = _PerStage('input_memory', FLAGS.input_memory, num_stages)
  activation_memory = _PerStage('activation_memory', FLAGS.activation_memory,
                                num_stages)
  num_micro = _NumMicroBatches()
  try:
    sim = schedule.Simulate(forward, backward, num_micro, FLAGS.remat,
                            FLAGS.transfer_cost, input_memory,
                            activation_memory)
  except ValueError as e:
    raise PlanError(str(e)) from e
  print(f'Simulated GPipe step: K={num_stages} stages, M={num_micro} '
        f'micro-batches, remat={FLAGS.remat}, transfer cost '
        f'{FLAGS.transfer_cost:g}')
  print(f'step time: {sim.step_time:.6g} (forward pass {sim.forward_time:.6g}'
        f', backward pass {sim.step_time - sim.forward_time:.6g})')
  print(_Bubble(num_stages, num_micro, sim.bubble_fraction))
  print('stage   forward  backward  utilization  peak memory (inputs + '
        'activations)')
  for k in range(num_stages):
    print(f'{k:5d}  {forward[k]:8.4g}  {backward[k]:8.4g}  '
          f'{sim.utilization[k]:11.3f}  {sim.peak_memory[k]:11.4g} '
          f'({sim.peak_inputs[k]} + {sim.peak_activations[k]})')
  if FLAGS.png_out or FLAGS.trace_out:  # Events are built on first use.
    _WriteOutputs(sim.events, num_stages,
                  f'Simulated GPipe step: K={num_stages}, M={num_micro}, '
                  f'remat={FLAGS.remat}, bubble {sim.bubble_fraction:.3f}',
                  (1.0, 'unit of the costs'))
  return {
      'subcommand': 'simulate',
      'forward_costs': forward,
      'backward_costs': backward,
      'num_micro_batches': num_micro,
      'remat': FLAGS.remat,
      'transfer_cost': FLAGS.transfer_cost,
      'input_memory': input_memory,
      'activation_memory': activation_memory,
      'step_time': sim.step_time,
      'forward_time': sim.forward_time,
      'bubble_fraction': sim.bubble_fraction,
      'closed_form_bubble_fraction': schedule.BubbleFraction(
          num_stages, num_micro),
      'utilization': sim.utilization,
      'peak_memory': sim.peak_memory,
      'peak_inputs': sim.peak_inputs,
      'peak_activations': sim.peak_activations,
  }


class Kernel(NamedTuple):
  """One kernel of a traced step."""
  name: str  # The node name.
  op: str  # The op type ('' if the trace does not say).
  device: str  # Where it ran.
  start: int  # Microseconds.
  end: int  # Microseconds.


# Name scope of the engine's ops (`GPipeSequentialLayer` passes 'gpipe'); the
# m-th call of stage k runs under 'stage{k}' (m = 0) or 'stage{k}_{m}'.
_STAGE_SCOPE = r'gpipe/stage(\d+)(?:_(\d+))?/'
_CALL = r'((?:Stateful)?PartitionedCall(?:_\d+)?)(?:/(.+))?$'
# Forward: the stage's tf.function call, inlined (its body kernels are named
# <scope>/StatefulPartitionedCall/<body node>) or not (the call node itself).
_FORWARD_RE = re.compile(r'(?:.*/)?' + _STAGE_SCOPE + _CALL)
# Backward: the gradient function of that call (recompute.py's or
# TensorFlow's), named gradients/.../<scope>/<op>_grad/StatefulPartitionedCall.
# Not inlined, its body kernels show their own names (e.g. 'fc0/MatMul' for
# the recompute, 'gradients/fc0/MatMul_grad/MatMul' for the backward).
_BACKWARD_RE = re.compile(r'gradients(?:_\d+)?/(?:.*/)?' + _STAGE_SCOPE +
                          r'[^/]+_grad/' + _CALL)
# Op types that do no work of a call (transfers, graph plumbing).
_PLUMBING_OPS = frozenset(['_Send', '_Recv', '_HostSend', '_HostRecv', 'NoOp',
                           '_Arg', '_Retval', 'Identity', 'IdentityN'])
_LABEL_RE = re.compile(r'^\S+ = ([\w.]+)\((.*)\)')
# Nodes the graph partitioner adds (transfers, control edges): '.../_<n>'.
_PARTITIONER_NODE_RE = re.compile(r'(^|/)_\d+$')


def StepKernels(step_stats: Any) -> List[Kernel]:
  """The kernels of a `RunMetadata.step_stats` that work on their inputs.

  Kernels without inputs (constants, variable handles, arguments) and the
  partitioner's transfer and control nodes (`.../_<n>`) are left out: they
  run whenever the executor gets to them, not when their call runs.

  Args:
    step_stats: A `tf.compat.v1.RunMetadata().step_stats`.

  Returns:
    The kernels, with times in microseconds.
  """
  kernels = []
  for dev_stats in step_stats.dev_stats:
    for node in dev_stats.node_stats:
      label = _LABEL_RE.match(node.timeline_label)
      op, inputs = label.groups() if label else ('', '?')
      if (not inputs or op in _PLUMBING_OPS or
          _PARTITIONER_NODE_RE.search(node.node_name)):
        continue
      kernels.append(
          Kernel(node.node_name, op, dev_stats.device, node.all_start_micros,
                 node.all_start_micros + node.all_end_rel_micros))
  return kernels


def _Window(kernels: Sequence[Kernel]) -> Tuple[int, int]:
  return min(k.start for k in kernels), max(k.end for k in kernels)


def StepEvents(kernels: Sequence[Kernel], num_stages: int, num_micro: int,
               remat: str) -> Tuple[List[schedule.Event], Dict[int, List[str]]]:
  """Which stage ran which micro-batch and phase when, in a traced step.

  A call's forward spans the kernels of its (inlined) forward function; its
  backward spans its gradient function call. For calls that recompute, the
  recompute is the part of the gradient call up to the end of the last kernel
  that repeats a forward kernel of the same stage (same node name inside the
  function), and the backward the rest (if no such kernel shows, the whole
  call counts as backward).

  Args:
    kernels: From `StepKernels`.
    num_stages: K.
    num_micro: M.
    remat: The pipeline's remat mode.

  Returns:
    (events, devices): the events with times in seconds from the step's first
    event, ordered by stage and start; and for each stage, the devices its
    kernels ran on.

  Raises:
    PlanError: if a call's kernels are missing from the trace.
  """
  forward = collections.defaultdict(list)
  backward = collections.defaultdict(list)
  inlined_backward = collections.defaultdict(list)
  body_names = collections.defaultdict(set)
  for kernel in kernels:
    match = _BACKWARD_RE.match(kernel.name)
    if match:
      key = (int(match.group(1)), int(match.group(2) or 0))
      backward[key].append(kernel)
      if match.group(4):
        inlined_backward[key].append((match.group(4), kernel))
      continue
    match = (None if kernel.name.startswith('gradients')
             else _FORWARD_RE.match(kernel.name))
    if match:
      k = int(match.group(1))
      forward[k, int(match.group(2) or 0)].append(kernel)
      if match.group(4):
        body_names[k].add(match.group(4))
  by_device = collections.defaultdict(list)
  for kernel in kernels:
    by_device[kernel.device].append(kernel)

  raw, devices = [], collections.defaultdict(set)
  for k in range(num_stages):
    for m in range(num_micro):
      for phase, calls in (('forward', forward), ('backward', backward)):
        if not calls.get((k, m)):
          raise PlanError(
              f'no {phase} kernels of stage {k}, micro-batch {m} in the step '
              "stats; the engine's op names may have changed (expected "
              "'gpipe/stage<k>_<m>/StatefulPartitionedCall...' and "
              "'gradients/.../gpipe/stage<k>_<m>/<op>_grad/"
              "StatefulPartitionedCall...').")
        devices[k].update(kernel.device for kernel in calls[k, m])
      raw.append((k, m, 'forward') + _Window(forward[k, m]))
      start, end = _Window(backward[k, m])
      if schedule.Recomputes(remat, m, num_micro):
        call_device = backward[k, m][0].device
        repeats = [kernel for name, kernel in inlined_backward[k, m]
                   if name in body_names[k]]
        repeats += [kernel for kernel in by_device[call_device]
                    if start <= kernel.start and kernel.end <= end and
                    kernel.name in body_names[k]]
        if repeats:
          split = max(kernel.end for kernel in repeats)
          raw.append((k, m, 'recompute', start, split))
          start = split
      raw.append((k, m, 'backward', start, end))
  first = min(r[3] for r in raw)
  events = [schedule.Event(k, m, phase, (s - first) * 1e-6, (e - first) * 1e-6)
            for k, m, phase, s, e in raw]
  events.sort(key=lambda e: (e.stage, e.start))
  return events, {k: sorted(d) for k, d in devices.items()}


def RecordStep(num_stages: int, num_micro: int, remat: str,
               cells_per_stage: int, dim: int, micro_batch_size: int,
               warmup_steps: int) -> Any:
  """Runs training steps of FC cells as a pipeline; traces the last one.

  Args:
    num_stages: K; stage k runs on logical CPU device k.
    num_micro: M.
    remat: The remat mode.
    cells_per_stage: Lingvo FCLayers per stage.
    dim: Their input and output size.
    micro_batch_size: Examples per micro-batch.
    warmup_steps: Untraced steps before the traced one.

  Returns:
    The traced step's `RunMetadata.step_stats`.
  """
  # Only this subcommand needs TensorFlow and Lingvo (seconds to import).
  # pylint: disable=g-import-not-at-top
  from lingvo.core import layers as lingvo_layers
  from lingvo.core import py_utils
  import numpy as np
  import tensorflow as tf
  from lingvo_gpipe import layers as gpipe_layers
  # pylint: enable=g-import-not-at-top
  devices = [f'/job:localhost/replica:0/task:0/device:CPU:{k}'
             for k in range(num_stages)]
  cells = [
      lingvo_layers.FCLayer.Params().Set(
          name=f'fc{i}', input_dim=dim, output_dim=dim)
      for i in range(num_stages * cells_per_stage)
  ]
  graph = tf.Graph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    layer = gpipe_layers.GPipeSequentialLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_stages=num_stages,
        num_micro_batches=num_micro, remat=remat,
        devices=devices).Instantiate()
    inputs = np.random.RandomState(0).standard_normal(
        [num_micro * micro_batch_size, dim]).astype(np.float32)
    outputs = layer.FProp(layer.theta, tf.constant(inputs))
    loss = tf.reduce_mean(tf.square(outputs))
    variables = layer.vars.Flatten()
    grads = tf.compat.v1.gradients(loss, variables,
                                   colocate_gradients_with_ops=True)
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.01)
    train_op = optimizer.apply_gradients(zip(grads, variables))
    config = tf.compat.v1.ConfigProto(device_count={'CPU': num_stages})
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(warmup_steps):
        sess.run(train_op)
      run_metadata = tf.compat.v1.RunMetadata()
      sess.run(train_op,
               options=tf.compat.v1.RunOptions(
                   trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
               run_metadata=run_metadata)
  return run_metadata.step_stats


def _MeanDuration(events: Sequence[schedule.Event], stage: int,
                  phase: str) -> float:
  """Mean duration of the stage's calls of one phase (0.0 if none)."""
  times = [e.end - e.start for e in events
           if e.stage == stage and e.phase == phase]
  return sum(times) / len(times) if times else 0.0


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
  remat = FLAGS.remat
  step_stats = RecordStep(num_stages, num_micro, remat, FLAGS.cells_per_stage,
                          FLAGS.fc_dim, FLAGS.micro_batch_size,
                          FLAGS.warmup_steps)
  events, devices = StepEvents(StepKernels(step_stats), num_stages, num_micro,
                               remat)
  occupancy = schedule.StageOccupancy(events, num_stages)
  factor, unit = _TimeUnit(occupancy.step_time)
  print(f'Traced GPipe step: K={num_stages} stages on {num_stages} CPU '
        f'devices, M={num_micro} micro-batches, remat={remat}, '
        f'{FLAGS.cells_per_stage} FC cells of {FLAGS.fc_dim} per stage, '
        f'micro-batch size {FLAGS.micro_batch_size}')
  print(f'step time (first to last stage call): '
        f'{occupancy.step_time * factor:.4g} {unit}')
  print(_Bubble(num_stages, num_micro, occupancy.bubble_fraction))
  print('Order of calls per stage (F forward, R recompute, B backward; '
        'micro-batch):')
  for k in range(num_stages):
    order = ' '.join(f'{e.phase[0].upper()}{e.micro_batch}'
                     for e in events if e.stage == k)
    print(f'  stage {k}: {order}')
  means = {phase: [_MeanDuration(events, k, phase) for k in range(num_stages)]
           for phase in schedule.PHASES}
  print(f'stage  utilization  mean forward  mean recompute  mean backward '
        f'({unit})  devices')
  for k in range(num_stages):
    cells = [f'{means[phase][k] * factor:.4g}' if means[phase][k] else '-'
             for phase in schedule.PHASES]
    print(f'{k:5d}  {occupancy.utilization[k]:11.3f}  {cells[0]:>12}  '
          f'{cells[1]:>14}  {cells[2]:>13}       '
          f'{", ".join(d.split("/")[-1] for d in devices[k])}')
  # The simulator fed with these means assumes one free device per stage;
  # here K logical devices share the host's cores. A recompute is timed as
  # part of its backward call (measured, it is not just another forward).
  sim = schedule.Simulate(
      means['forward'],
      [r + b for r, b in zip(means['recompute'], means['backward'])],
      num_micro, 'never')
  print(f'simulated from the mean call times: step '
        f'{sim.step_time * factor:.4g} {unit}, bubble fraction '
        f'{sim.bubble_fraction:.3f}; measured / simulated step: '
        f'{occupancy.step_time / sim.step_time:.2f}')
  _WriteOutputs(events, num_stages,
                f'Traced GPipe step: K={num_stages}, M={num_micro}, '
                f'remat={remat}, bubble {occupancy.bubble_fraction:.3f}',
                (factor, unit))
  return {
      'subcommand': 'timeline',
      'num_stages': num_stages,
      'num_micro_batches': num_micro,
      'remat': remat,
      'step_time': occupancy.step_time,
      'bubble_fraction': occupancy.bubble_fraction,
      'closed_form_bubble_fraction': schedule.BubbleFraction(
          num_stages, num_micro),
      'utilization': occupancy.utilization,
      'simulated_step_time': sim.step_time,
      'simulated_bubble_fraction': sim.bubble_fraction,
      'devices': {str(k): d for k, d in devices.items()},
      'events': [e._asdict() for e in events],
  }


# Subcommand name -> function(positional args) -> JSON-ready dict.
SUBCOMMANDS: Dict[str, Callable[[Sequence[str]], Dict[str, Any]]] = {
    'partition': Partition,
    'simulate': Simulate,
    'timeline': Timeline,
}


if __name__ == '__main__':
  cli.Run('plan.py', SUBCOMMANDS, (PlanError,),
          'plan.py partition --costs=1,4,4,8 --num_stages=2')
