"""Plans a GPipe pipeline before running it: how to cut the cells into stages.

    python tools/plan.py partition --costs=1,4,4,4,8 --num_stages=2
    python tools/plan.py partition --example=amoebanet --num_stages=4,8
    python tools/plan.py partition --example=transformer --json_out=/tmp/p.json

Subcommands (the first argument that is not a flag):
  partition  For each K, the stages chosen by `partition.PartitionCosts`
             (their cells, cost, share, memory, imbalance) next to Lingvo's
             heuristic (`gpipe.PartitionSequentialLayers`).
"""

import json
import math
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import app
from absl import flags

from lingvo_gpipe import costs as costs_lib
from lingvo_gpipe import partition as partition_lib

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
    'with --example.')
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
flags.DEFINE_string(
    'json_out', None, 'Optional path: also write the numbers (partitions, '
    'stage costs, shares, memory, imbalance, ours and Lingvo) as JSON there.')

_DEFAULT_EXAMPLE_STAGES = (4, 8)


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


# Subcommand name -> function(positional args) -> JSON-ready dict.
SUBCOMMANDS: Dict[str, Callable[[Sequence[str]], Dict[str, Any]]] = {
    'partition': Partition,
}


def _Fail(message: str) -> None:
  """Prints one error line and exits with status 2."""
  print(f'plan.py: error: {" ".join(message.split())}', file=sys.stderr)
  sys.exit(2)


def _ParseFlags(argv: List[str]) -> List[str]:
  """absl flag parsing with a one-line error instead of absl's two."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    _Fail(str(e))


def main(argv: List[str]) -> None:
  if len(argv) < 2 or argv[1] not in SUBCOMMANDS:
    given = repr(argv[1]) if len(argv) > 1 else 'none'
    _Fail(f'subcommand {given} is not valid; use one of {sorted(SUBCOMMANDS)}, '
          'e.g. plan.py partition --costs=1,4,4,8 --num_stages=2.')
  try:
    numbers = SUBCOMMANDS[argv[1]](argv[2:])
  except PlanError as e:
    _Fail(f'{argv[1]}: {e}')
  if FLAGS.json_out:
    with open(FLAGS.json_out, 'w') as f:
      json.dump(numbers, f, indent=2)
    print(f'Wrote {FLAGS.json_out}')


if __name__ == '__main__':
  app.run(main, flags_parser=_ParseFlags)
