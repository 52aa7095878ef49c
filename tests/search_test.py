"""Tests of planning.search: partitions under a budget, the search, ranks."""

import pytest

from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import profile as profile_lib
from lingvo_gpipe.planning import search
from planning_util import Affine
from planning_util import Cell
from planning_util import Profile
from planning_util import Shape
from planning_util import TWO_CELLS


def testSearchFindsTheHandOptimum():
  # Pure per-example costs plus 1 s per call: K=1 with R=2 replicas and one
  # micro-batch of 2 examples costs 6 s forward + 10 s backward = 16 s, no
  # recompute; K=2 (R=1) is at best 24 s (M=2, see predict_test.py);
  # recomputing costs 6 s more.
  result = search.Search(Profile(TWO_CELLS), num_devices=2,
                         memory_per_device=1e9)
  best = result.candidates[result.chosen]
  assert result.chosen == 0
  assert (best.num_stages, best.replicas, best.num_micro_batches) == (1, 2, 1)
  assert best.remat in ('except_last', 'never')  # The same at M=1.
  assert best.predicted_step_s == 16.0
  steps = [c.predicted_step_s for c in result.candidates]
  assert steps == sorted(steps)  # All fit: ranked by step time.
  # K in {1, 2}; M in the divisors of 2 (R=2) or 4 (R=1); v = 1 on one
  # device, v in {1} for K=2 (2 cells); 3 remat modes.
  assert len(result.candidates) == (2 + 3) * 3


def testSearchUnderABudgetPicksTheFastestThatFits():
  # 150 bytes per device: K=1 holds both cells' 200 bytes of weights.
  result = search.Search(Profile(TWO_CELLS), num_devices=2,
                         memory_per_device=150)
  best = result.candidates[result.chosen]
  assert (best.num_stages, best.num_micro_batches, best.remat) == (
      2, 2, 'never')
  assert best.predicted_step_s == 24.0
  assert best.predicted_peak_bytes == 100.0
  fits = [c.fits for c in result.candidates]
  assert fits == sorted(fits, reverse=True)  # Those that fit come first.
  assert not any(c.fits for c in result.candidates if c.num_stages == 1)
  assert [search.RankKey(c) for c in result.candidates] == sorted(
      search.RankKey(c) for c in result.candidates)


def testNothingFits():
  result = search.Search(Profile(TWO_CELLS), num_devices=2,
                         memory_per_device=50)
  assert result.chosen is None and result.candidates
  assert min(c.predicted_peak_bytes for c in result.candidates) == 100


def testMemoryLimitedPartition():
  # Equal costs: the fastest partition is [2, 2], whose first stage holds
  # 310 bytes of weights; under 305 the partitioner moves cells: [1, 3].
  cells = [Cell(f'c{i}', weight=w) for i, w in enumerate([300, 10, 10, 10])]
  profile = Profile(cells, batch_size=2)
  free = search.PlanPartition(profile, Shape(2, 1, 'never'))
  assert free.partition == [2, 2] and free.partition_rule == 'fastest'
  limited = search.PlanPartition(profile, Shape(2, 1, 'never'),
                                 memory_per_device=305)
  assert limited.partition == [1, 3]
  assert limited.partition_rule == 'memory_limit'
  assert limited.fits and limited.predicted_peak_bytes == 300


def testSchedulesComeFromTheTables(monkeypatch):
  # A schedule added to the tables is searched without planner code.
  monkeypatch.setitem(schedule.SCHEDULES, 'copy', schedule.Schedule(
      schedule.GPipeTable, False, 'GPipe under another name'))
  result = search.Search(Profile(TWO_CELLS), num_devices=2,
                         memory_per_device=1e9)
  assert {c.schedule for c in result.candidates} == {'gpipe', 'copy'}
  # One whose loss is inside the pipeline needs a last cell with the loss.
  monkeypatch.setitem(schedule.SCHEDULES, 'inside', schedule.Schedule(
      schedule.GPipeTable, True, 'needs the loss inside'))
  result = search.Search(Profile(TWO_CELLS), num_devices=2,
                         memory_per_device=1e9)
  assert 'inside' not in {c.schedule for c in result.candidates}
  assert ("schedule 'inside': needs the loss inside the pipeline; the last "
          'cell does not compute the loss.') in result.skipped


def testBadSearchArguments():
  with pytest.raises(ValueError, match='memory_per_device'):
    search.Search(Profile(TWO_CELLS), num_devices=2, memory_per_device=0)
  with pytest.raises(ValueError, match="schedule='nope'"):
    search.Search(Profile(TWO_CELLS), num_devices=2, memory_per_device=1.0,
                  schedules=['nope'])
  with pytest.raises(TypeError):  # N and the budget are keywords.
    search.Search(Profile(TWO_CELLS), 2, 1.0)


def _WithWeightParts(cells):
  return [profile_lib.CellProfile(**{
      **c.__dict__, 'weight_s': Affine(0.0, 1.0), 'weight_stash_bytes': 0.0})
          for c in cells]


def testSearchPlansZeroBubbleWhenTheProfileHasTheWeightPart():
  cells = [Cell(f'c{i}') for i in range(4)]
  result = search.Search(Profile(_WithWeightParts(cells), loss_inside=True),
                         num_devices=2, memory_per_device=1e9)
  found = {(c.schedule, c.virtual_stages) for c in result.candidates}
  assert {('zb1p', 1), ('zbv', 2)} <= found
  assert ('zb1p', 2) not in found and ('zbv', 1) not in found
  assert any("schedule 'zbv':" in s and 'virtual_stages=1 is not supported'
             in s for s in result.skipped)
  # The same K, M, remat: the zero bubble step is never slower than 1F1B's.
  by = {(c.schedule, c.num_stages, c.virtual_stages, c.num_micro_batches,
         c.remat): c.predicted_step_s for c in result.candidates}
  for (name, k, v, m, remat), step in by.items():
    if name == 'zb1p':
      assert step <= by['1f1b', k, v, m, remat]


def testSearchSaysWhyZeroBubbleIsNotPlannedWithoutTheWeightPart():
  result = search.Search(Profile([Cell(f'c{i}') for i in range(4)],
                                 loss_inside=True),
                         num_devices=2, memory_per_device=1e9)
  assert {c.schedule for c in result.candidates} == {'1f1b'}
  assert any(s.startswith("schedule 'zb1p': splits the backward") and
             'no weight_s / weight_stash_bytes' in s for s in result.skipped)
