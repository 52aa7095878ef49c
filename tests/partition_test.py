"""Tests of lingvo_gpipe.partition: optimum, limits, errors, Lingvo's rule."""

import itertools
import math

import numpy as np
import pytest

from lingvo_gpipe import partition

# Cost lists shaped like the two models of the GPipe paper (the same as
# `tools/plan.py --example=...`).
TRANSFORMER = [0.5] + [10.0] * 24 + [40.0]
AMOEBANET = [2.0] + ([1.0] * 6 + [3.0]) * 2 + [1.0] * 6 + [0.5]


def _AllPartitions(num_cells, num_stages):
  """Every way to cut num_cells cells into num_stages non-empty stages."""
  for cuts in itertools.combinations(range(1, num_cells), num_stages - 1):
    bounds = (0,) + cuts + (num_cells,)
    yield [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _Objective(costs, memory, counts):
  return (max(partition.StageSums(costs, counts)),
          max(partition.StageSums(memory, counts)))


def _BruteForce(costs, num_stages, memory, memory_limit=math.inf):
  """The best (max stage cost, max stage memory) under the limit, or None.

  Costs that differ only by float round-off (sums in another order) count as
  tied, so that memory decides between them.
  """
  objectives = [
      _Objective(costs, memory, counts)
      for counts in _AllPartitions(len(costs), num_stages)
  ]
  feasible = [o for o in objectives if o[1] <= memory_limit]
  if not feasible:
    return None
  best_cost = min(cost for cost, _ in feasible)
  return best_cost, min(mem for cost, mem in feasible
                        if cost <= best_cost * (1 + 1e-12))


def _RandomCase(rng, integer):
  num_cells = int(rng.integers(1, 13))
  num_stages = int(rng.integers(1, min(num_cells, 5) + 1))
  if integer:  # Exact sums; many ties and zeros.
    costs = rng.integers(0, 6, num_cells).astype(float)
    memory = rng.integers(0, 4, num_cells).astype(float)
  else:
    costs = rng.exponential(1.0, num_cells) * (rng.random(num_cells) > 0.2)
    memory = rng.random(num_cells)
  return costs.tolist(), num_stages, memory.tolist()


@pytest.mark.parametrize('integer', [True, False])
def testMatchesBruteForce(integer):
  rng = np.random.default_rng(1 if integer else 2)
  for _ in range(300):
    costs, num_stages, memory = _RandomCase(rng, integer)
    counts = partition.PartitionCosts(costs, num_stages, memory)
    assert len(counts) == num_stages and min(counts) >= 1
    assert sum(counts) == len(costs)
    got = _Objective(costs, memory, counts)
    want = _BruteForce(costs, num_stages, memory)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (costs,
                                                              num_stages)


def testMemoryLimitMatchesBruteForce():
  rng = np.random.default_rng(3)
  checked = {'fits': 0, 'impossible': 0}
  for _ in range(300):
    costs, num_stages, memory = _RandomCase(rng, integer=True)
    limit = float(rng.integers(1, 8))
    want = _BruteForce(costs, num_stages, memory, limit)
    if want is None:
      with pytest.raises(ValueError, match='memory_limit'):
        partition.PartitionCosts(costs, num_stages, memory, limit)
      checked['impossible'] += 1
      continue
    counts = partition.PartitionCosts(costs, num_stages, memory, limit)
    assert max(partition.StageSums(memory, counts)) <= limit
    assert _Objective(costs, memory, counts) == want, (costs, memory, limit)
    checked['fits'] += 1
  assert min(checked.values()) > 20, checked


def testDocstringExample():
  costs = [1, 4, 4, 4, 4, 8]
  assert partition.PartitionCosts(costs, 3) == [3, 2, 1]
  assert partition.Imbalance(costs, [3, 2, 1]) == pytest.approx(9 / (25 / 3))


def testEdgeStageCounts():
  costs = [3.0, 1.0, 2.0, 5.0]
  assert partition.PartitionCosts(costs, 4) == [1, 1, 1, 1]
  assert partition.PartitionCosts(costs, 1) == [4]
  assert partition.PartitionCosts([7.0], 1) == [1]


def testZeroCosts():
  assert sum(partition.PartitionCosts([0.0] * 5, 3)) == 5
  assert len(partition.PartitionCosts([0.0] * 5, 3)) == 3
  counts = partition.PartitionCosts([0, 0, 5, 0, 0, 5, 0], 2)
  assert partition.StageSums([0, 0, 5, 0, 0, 5, 0], counts) == [5, 5]
  assert partition.Imbalance([0.0, 0.0], [1, 1]) == 1.0


@pytest.mark.parametrize('num_stages', [0, -1, 5, 2.0, True, None])
def testBadNumStages(num_stages):
  with pytest.raises(ValueError, match=r'num_stages=.*\[1, 4\]'):
    partition.PartitionCosts([1, 2, 3, 4], num_stages)


@pytest.mark.parametrize('costs', [[1, -2, 3], [1, float('nan'), 3],
                                   [1, float('inf'), 3]])
def testBadCosts(costs):
  with pytest.raises(ValueError, match=r'costs=.*finite non-negative'):
    partition.PartitionCosts(costs, 2)


def testEmptyCostsAndBadMemory():
  with pytest.raises(ValueError, match='costs is empty'):
    partition.PartitionCosts([], 1)
  with pytest.raises(ValueError, match=r'memory=\[1\.0, 2\.0\] must be 3'):
    partition.PartitionCosts([1, 2, 3], 2, memory=[1, 2])
  with pytest.raises(ValueError, match='memory='):
    partition.PartitionCosts([1, 2, 3], 2, memory=[1, -2, 3])


def testMemoryLimitErrors():
  memory = [1, 5, 1, 1]
  with pytest.raises(ValueError, match=r'cells \[1\] .*memory_limit=4'):
    partition.PartitionCosts([1, 1, 1, 1], 2, memory, memory_limit=4)
  with pytest.raises(ValueError,
                     match=r'at least 4 stages .*memory_limit=5.*num_stages=2'):
    partition.PartitionCosts([1, 1, 1, 1], 2, [3, 3, 3, 3], memory_limit=5)
  # A limit that binds: the cost optimum [2, 2] would hold memory 6.
  counts = partition.PartitionCosts([1, 1, 1, 1], 2, [3, 3, 0, 0],
                                    memory_limit=5)
  assert counts == [1, 3]


def testMemoryBreaksTies():
  # Costs alone allow [1, 2] and [2, 1]; memory prefers the second.
  assert partition.PartitionCosts([1, 1, 1], 2, memory=[1, 1, 5]) == [2, 1]
  assert partition.PartitionCosts([1, 1, 1], 2, memory=[5, 1, 1]) == [1, 2]


def testCheckPartition():
  assert partition.CheckPartition([2, np.int64(1)], 3, 2) == [2, 1]
  with pytest.raises(ValueError, match=r'partition=\[2, 2\] sums to 4 .* 3'):
    partition.CheckPartition([2, 2], 3)
  with pytest.raises(ValueError, match=r'partition=\[3, 0\] .*positive ints'):
    partition.CheckPartition([3, 0], 3)
  with pytest.raises(ValueError, match=r'partition=\[\] .*positive ints'):
    partition.CheckPartition([], 3)
  with pytest.raises(ValueError, match=r'partition=\[1.5, 1.5\]'):
    partition.CheckPartition([1.5, 1.5], 3)
  with pytest.raises(ValueError,
                     match=r'partition=\[1, 2\] has 2 stages .*num_stages=3'):
    partition.CheckPartition([1, 2], 3, num_stages=3)


def testUniformPartition():
  assert partition.UniformPartition(10, 4) == [3, 3, 2, 2]
  assert partition.UniformPartition(4, 4) == [1, 1, 1, 1]
  assert partition.UniformPartition(5, 1) == [5]
  with pytest.raises(ValueError, match=r'num_stages=5 .*\[1, 4\]'):
    partition.UniformPartition(4, 5)


def testLingvoPartitionRule():
  # Cumulative fractions 0.1, 0.2, 0.6, 1.0 at K=2 -> stages 0, 0, 1, 1.
  assert partition.LingvoPartition([1, 1, 4, 4], 2) == [2, 2]
  # One dominant cell leaves stages empty.
  assert partition.LingvoPartition([1, 100, 1], 3) == [1, 0, 2]


def testNeverWorseThanLingvo():
  rng = np.random.default_rng(4)
  compared = 0
  for _ in range(500):
    costs, num_stages, _ = _RandomCase(rng, integer=bool(rng.integers(2)))
    if sum(costs) == 0:
      continue
    lingvo = partition.LingvoPartition(costs, num_stages)
    if 0 in lingvo:  # Not a valid K-stage partition: nothing to compare.
      continue
    ours = partition.PartitionCosts(costs, num_stages)
    assert (partition.Imbalance(costs, ours) <=
            partition.Imbalance(costs, lingvo) + 1e-12), (costs, num_stages)
    compared += 1
  assert compared > 200


@pytest.mark.parametrize(
    'costs, num_stages, ours, lingvo',
    [
        # Transformer-like: 1.005 vs 1.141 at K=4. At K=8 both hit the bound
        # max(cell) / ideal = 40 / 35.06 = 1.141: the softmax alone.
        (TRANSFORMER, 2, 1.0018, 1.0695),
        (TRANSFORMER, 4, 1.0053, 1.1408),
        (TRANSFORMER, 8, 1.1408, 1.1408),
        # AmoebaNet-like: reduction cells throw Lingvo's rounding off.
        (AMOEBANET, 4, 1.0566, 1.4340),
        (AMOEBANET, 8, 1.2075, 1.8113),
    ])
def testExamples(costs, num_stages, ours, lingvo):
  counts = partition.PartitionCosts(costs, num_stages)
  lingvo_counts = partition.LingvoPartition(costs, num_stages)
  assert 0 not in lingvo_counts
  assert partition.Imbalance(costs, counts) == pytest.approx(ours, abs=1e-4)
  assert partition.Imbalance(costs, lingvo_counts) == pytest.approx(
      lingvo, abs=1e-4)
  if ours < lingvo:
    assert (partition.Imbalance(costs, counts) <
            partition.Imbalance(costs, lingvo_counts))
  else:  # Equal only where a single cell bounds every partition.
    assert max(costs) / (sum(costs) / num_stages) == pytest.approx(ours,
                                                                   abs=1e-4)
