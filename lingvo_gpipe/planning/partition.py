"""Cutting a sequence of cells into K contiguous stages.

Pure Python and numpy. A partition is a list of K positive ints, the number of
cells in each stage, in order. `PartitionCosts` finds the partition whose most
expensive stage is as cheap as possible (exactly, not heuristically); ties go
to the partition whose largest stage memory is smallest.

    >>> PartitionCosts([1, 4, 4, 4, 4, 8], num_stages=3)  # Costs 9, 8, 8.
    [3, 2, 1]
    >>> round(Imbalance([1, 4, 4, 4, 4, 8], [3, 2, 1]), 2)  # 9 / (25 / 3)
    1.08
"""

from typing import List, Optional, Sequence

import numpy as np


def CheckNumStages(num_cells: int, num_stages: int) -> None:
  """Raises ValueError unless 1 <= num_stages <= num_cells."""
  if (not isinstance(num_stages, (int, np.integer)) or
      isinstance(num_stages, bool) or not 1 <= num_stages <= num_cells):
    raise ValueError(f'num_stages={num_stages!r} must be an int in '
                     f'[1, {num_cells}] (the number of cells).')


def UniformPartition(num_cells: int, num_stages: int) -> List[int]:
  """Equal cell counts; the first `num_cells % num_stages` stages get one more.

  Args:
    num_cells: n >= 1.
    num_stages: K in [1, n].

  Returns:
    K positive ints summing to n.

  Raises:
    ValueError: if K is not in [1, n].
  """
  CheckNumStages(num_cells, num_stages)
  base, extra = divmod(num_cells, num_stages)
  return [base + (k < extra) for k in range(num_stages)]


def CheckPartition(partition: Sequence[int], num_cells: int,
                   num_stages: Optional[int] = None) -> List[int]:
  """Validates an explicit partition.

  Args:
    partition: Cells per stage.
    num_cells: The number of cells it must cover.
    num_stages: If given, the number of stages it must have.

  Returns:
    The partition as a list of ints.

  Raises:
    ValueError: if an entry is not a positive int, the sum is not num_cells,
      or the length is not num_stages.
  """
  counts = list(partition)
  if not counts or any(
      not isinstance(c, (int, np.integer)) or isinstance(c, bool) or c < 1
      for c in counts):
    raise ValueError(f'partition={counts} must be a non-empty list of '
                     'positive ints (cells per stage).')
  if sum(counts) != num_cells:
    raise ValueError(f'partition={counts} sums to {sum(counts)} but there are '
                     f'{num_cells} cells; the counts must sum to {num_cells}.')
  if num_stages is not None and len(counts) != num_stages:
    raise ValueError(f'partition={counts} has {len(counts)} stages but '
                     f'num_stages={num_stages}; give one count per stage.')
  return [int(c) for c in counts]


def StageSums(values: Sequence[float], partition: Sequence[int]) -> List[float]:
  """Sums `values` (one per cell) over the cells of each stage."""
  bounds = np.cumsum([0] + list(partition))
  values = np.asarray(values, dtype=np.float64)
  return [float(values[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]


def Imbalance(costs: Sequence[float], partition: Sequence[int]) -> float:
  """Largest stage cost divided by the ideal total / K (1.0 is perfect)."""
  total = float(np.sum(costs))
  if total == 0:
    return 1.0
  return max(StageSums(costs, partition)) / (total / len(partition))


def LingvoPartition(costs: Sequence[float], num_stages: int) -> List[int]:
  """Lingvo's `PartitionSequentialLayers` rule, for comparison.

  Cell i goes to stage min(int(cumulative_cost_fraction_i * K), K - 1). Stages
  may come out empty; such a result is returned as is (with zeros).

  Args:
    costs: One non-negative cost per cell.
    num_stages: K.

  Returns:
    K cell counts (possibly zero).
  """
  costs = np.asarray(costs, dtype=np.float64)
  total = costs.sum()
  if total == 0:  # All cells free: treat them as equally expensive.
    costs, total = np.ones_like(costs), len(costs)
  cumulative = np.cumsum(costs) / total
  counts = [0] * num_stages
  for fraction in cumulative:
    counts[min(int(fraction * num_stages), num_stages - 1)] += 1
  return counts


def _MinSegments(prefix: np.ndarray, limit: float, mem_prefix: np.ndarray,
                 mem_limit: float) -> List[int]:
  """Greedy: the fewest contiguous segments with sum <= limit, mem <= limit.

  Args:
    prefix: Prefix sums of costs (length n + 1).
    limit: Largest allowed segment cost.
    mem_prefix: Prefix sums of memory (length n + 1).
    mem_limit: Largest allowed segment memory.

  Returns:
    Segment end indices (exclusive), or [] if some single cell exceeds a limit.
  """
  n = len(prefix) - 1
  ends, start = [], 0
  for i in range(1, n + 1):
    if (prefix[i] - prefix[start] > limit or
        mem_prefix[i] - mem_prefix[start] > mem_limit):
      if i - 1 == start:
        return []
      ends.append(i - 1)
      start = i - 1
      if (prefix[i] - prefix[start] > limit or
          mem_prefix[i] - mem_prefix[start] > mem_limit):
        return []
  ends.append(n)
  return ends


def _SmallestFeasible(candidates: np.ndarray, feasible) -> float:
  """The smallest candidate value for which `feasible(value)` holds."""
  values = np.unique(candidates)
  lo, hi = 0, len(values) - 1
  while lo < hi:
    mid = (lo + hi) // 2
    if feasible(values[mid]):
      hi = mid
    else:
      lo = mid + 1
  return float(values[lo])


def _SegmentSums(prefix: np.ndarray) -> np.ndarray:
  """All contiguous segment sums prefix[i] - prefix[j], j < i."""
  diffs = prefix[None, :] - prefix[:, None]
  return diffs[np.triu_indices(len(prefix), k=1)]


def PartitionCosts(costs: Sequence[float],
                   num_stages: int,
                   memory: Optional[Sequence[float]] = None,
                   memory_limit: Optional[float] = None) -> List[int]:
  """The contiguous partition that minimizes the largest stage cost.

  Exact: the optimum is one of the O(n^2) segment sums; a binary search over
  them with a greedy O(n) feasibility test finds it in O(n^2 log n) with tiny
  constants (n = 1000 cells takes milliseconds). Splitting a segment never
  raises a segment's cost or memory, so a threshold is feasible for exactly K
  stages iff the greedy needs at most K. Among optimal partitions, the one
  whose largest stage memory is smallest is chosen.

  Args:
    costs: One non-negative cost per cell (flops, parameters, seconds, ...).
    num_stages: K in [1, n].
    memory: One non-negative memory figure per cell (default: all zero).
    memory_limit: If given, no stage may hold more memory than this.

  Returns:
    K positive ints: cells per stage.

  Raises:
    ValueError: on K out of range, negative or non-finite costs or memory,
      mismatched lengths, or cells that cannot fit `memory_limit` in K stages.
  """
  costs = np.asarray(costs, dtype=np.float64)
  num_cells = len(costs)
  if num_cells == 0:
    raise ValueError('costs is empty; there must be at least one cell.')
  CheckNumStages(num_cells, num_stages)
  memory = (np.zeros(num_cells) if memory is None else
            np.asarray(memory, dtype=np.float64))
  for name, values in (('costs', costs), ('memory', memory)):
    if len(values) != num_cells or not np.all(np.isfinite(values)) or np.any(
        values < 0):
      raise ValueError(f'{name}={values.tolist()} must be {num_cells} finite '
                       'non-negative numbers.')
  prefix = np.concatenate([[0.0], np.cumsum(costs)])
  mem_prefix = np.concatenate([[0.0], np.cumsum(memory)])
  mem_limit = np.inf if memory_limit is None else float(memory_limit)

  if memory_limit is not None:
    too_big = [i for i in range(num_cells) if memory[i] > mem_limit]
    if too_big:
      raise ValueError(f'cells {too_big} each need more memory than '
                       f'memory_limit={memory_limit}; no partition fits.')
    needed = len(_MinSegments(prefix, np.inf, mem_prefix, mem_limit))
    if needed > num_stages:
      raise ValueError(f'the cells need at least {needed} stages to fit '
                       f'memory_limit={memory_limit}, num_stages={num_stages}.')

  def Fits(cost_limit, memory_cap):
    ends = _MinSegments(prefix, cost_limit, mem_prefix, memory_cap)
    return bool(ends) and len(ends) <= num_stages

  best_cost = _SmallestFeasible(_SegmentSums(prefix),
                                lambda c: Fits(c, mem_limit))
  best_memory = _SmallestFeasible(_SegmentSums(mem_prefix),
                                  lambda m: Fits(best_cost, m))
  ends = _MinSegments(prefix, best_cost, mem_prefix, best_memory)
  counts = list(np.diff([0] + ends))
  while len(counts) < num_stages:  # Any split keeps both limits.
    k = int(np.argmax(counts))
    counts[k:k + 1] = [counts[k] - 1, 1]
  return [int(c) for c in counts]
