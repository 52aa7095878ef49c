"""Tables of a partition's stages, next to Lingvo's heuristic.

Pure Python and numpy, for logs and the planning tool:

    >>> names = ['emb', 'fc0', 'fc1', 'fc2', 'fc3', 'softmax']
    >>> print(PartitionReport([1, 4, 4, 4, 4, 8], [3, 2, 1], names=names))
    6 cells, 3 stages, total cost 25, ideal stage cost 8.333.
    Partition [3, 2, 1]:
      stage  cells         n        cost   share
          0  emb .. fc1    3           9   36.0%
          1  fc2 .. fc3    2           8   32.0%
          2  softmax       1           8   32.0%
      imbalance (largest stage / ideal): 1.080
    Lingvo's heuristic (PartitionSequentialLayers) [2, 2, 2]:
      stage  cells             n        cost   share
          0  emb .. fc0        2           5   20.0%
          1  fc1 .. fc2        2           8   32.0%
          2  fc3 .. softmax    2          12   48.0%
      imbalance (largest stage / ideal): 1.440

`PartitionSummary` gives the same numbers as a JSON-ready dict.
"""

import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from lingvo_gpipe.planning import partition as partition_lib


def _Number(x: float) -> str:
  return f'{x:.4g}'


def _CellRange(names: Sequence[str], start: int, count: int) -> str:
  if count == 0:
    return '(empty)'
  if count == 1:
    return names[start]
  return f'{names[start]} .. {names[start + count - 1]}'


def _Names(names: Optional[Sequence[str]], num_cells: int) -> List[str]:
  if names is None:
    return [f'cell{i}' for i in range(num_cells)]
  if len(names) != num_cells:
    raise ValueError(f'names has {len(names)} entries ({list(names)}) but '
                     f'there are {num_cells} cells; give one name per cell.')
  return [str(n) for n in names]


def PartitionSummary(costs: Sequence[float],
                     partition: Sequence[int],
                     memory: Optional[Sequence[float]] = None,
                     names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  """The numbers of one partition, as plain Python values (JSON-ready).

  Args:
    costs: One cost per cell.
    partition: Cells per stage; zeros (empty stages) are allowed here so that
      Lingvo's heuristic can be summarized too.
    memory: Optional memory per cell.
    names: Optional cell names (default 'cell0', 'cell1', ...).

  Returns:
    A dict with 'partition', 'cells' (first .. last name per stage, or
    '(empty)'), 'stage_costs', 'stage_shares' (fractions of the total),
    'stage_memory' (None without memory), 'imbalance' (largest stage cost /
    (total / K)) and 'empty_stages'.
  """
  names = _Names(names, len(costs))
  stage_costs = partition_lib.StageSums(costs, partition)
  total = sum(stage_costs)
  starts = np.cumsum([0] + list(partition))[:-1]
  return {
      'partition': [int(c) for c in partition],
      'cells': [
          _CellRange(names, int(s), int(c)) for s, c in zip(starts, partition)
      ],
      'stage_costs': stage_costs,
      'stage_shares': [c / total if total else 0.0 for c in stage_costs],
      'stage_memory': (None if memory is None else partition_lib.StageSums(
          memory, partition)),
      'imbalance': partition_lib.Imbalance(costs, partition),
      'empty_stages': sum(1 for c in partition if c == 0),
  }


def _FormatSummary(title: str, summary: Dict[str, Any],
                   memory_limit: Optional[float]) -> List[str]:
  """Table lines of one PartitionSummary."""
  has_memory = summary['stage_memory'] is not None
  width = max([len('cells')] + [len(c) for c in summary['cells']])
  header = f'  stage  {"cells":<{width}}  {"n":>3}  {"cost":>10}  {"share":>6}'
  if has_memory:
    header += f'  {"memory":>10}'
  lines = [f'{title} {summary["partition"]}:', header]
  for k, (cells, count, cost, share) in enumerate(
      zip(summary['cells'], summary['partition'], summary['stage_costs'],
          summary['stage_shares'])):
    line = (f'  {k:>5}  {cells:<{width}}  {count:>3}  {_Number(cost):>10}  '
            f'{share:>6.1%}')
    if has_memory:
      mem = summary['stage_memory'][k]
      line += f'  {_Number(mem):>10}'
      if memory_limit is not None and mem > memory_limit:
        line += '  over memory_limit'
    lines.append(line)
  tail = f'  imbalance (largest stage / ideal): {summary["imbalance"]:.3f}'
  if has_memory:
    tail += f', largest stage memory: {_Number(max(summary["stage_memory"]))}'
  if summary['empty_stages']:
    tail += f', {summary["empty_stages"]} empty stage(s)'
  lines.append(tail)
  return lines


def PartitionReport(costs: Sequence[float],
                    partition: Sequence[int],
                    memory: Optional[Sequence[float]] = None,
                    names: Optional[Sequence[str]] = None,
                    memory_limit: Optional[float] = None) -> str:
  """A table of the stages of `partition` next to Lingvo's heuristic.

  For each stage: its cells (first .. last name), their number, cost, share of
  the total and memory; then the imbalance (largest stage cost / ideal). The
  same follows for `partition.LingvoPartition(costs, K)`, whose empty stages
  show as '(empty)'.

  Args:
    costs: One non-negative cost per cell.
    partition: Cells per stage (K positive ints).
    memory: Optional memory per cell (e.g. `CellMemory(cells)`).
    names: Optional cell names.
    memory_limit: Optional; stages above it are marked.

  Returns:
    Multi-line text.

  Raises:
    ValueError: if the partition, memory or names do not match the costs.
  """
  costs = [float(c) for c in costs]
  if not costs or not all(math.isfinite(c) and c >= 0 for c in costs):
    raise ValueError(f'costs={costs} must be a non-empty list of finite '
                     'non-negative numbers.')
  counts = partition_lib.CheckPartition(partition, len(costs))
  if memory is not None and len(memory) != len(costs):
    raise ValueError(f'memory has {len(memory)} entries but there are '
                     f'{len(costs)} cells; give one per cell.')
  num_stages, total = len(counts), sum(costs)
  lines = [
      f'{len(costs)} cells, {num_stages} stages, total cost {_Number(total)}, '
      f'ideal stage cost {_Number(total / num_stages)}.'
  ]
  lines += _FormatSummary('Partition', PartitionSummary(
      costs, counts, memory, names), memory_limit)
  if total == 0:
    lines.append("Lingvo's heuristic: undefined (all costs are zero).")
  else:
    lingvo = partition_lib.LingvoPartition(costs, num_stages)
    lines += _FormatSummary("Lingvo's heuristic (PartitionSequentialLayers)",
                            PartitionSummary(costs, lingvo, memory, names),
                            memory_limit)
  return '\n'.join(lines)
