"""schedule: the clock ticks of a GPipe step and the bubble arithmetic."""

import pytest

from lingvo_gpipe import schedule


@pytest.mark.parametrize('k,m', [(1, 1), (1, 5), (3, 1), (4, 8), (8, 3)])
def testEveryStageRunsEveryMicroBatchOnceInOrder(k, m):
  ticks = schedule.GPipeSchedule(k, m)
  assert len(ticks) == m + k - 1
  for t, tick in enumerate(ticks):
    for stage, micro in tick:
      assert stage + micro == t
  runs = [pair for tick in ticks for pair in tick]
  assert sorted(runs) == [(s, i) for s in range(k) for i in range(m)]


def testBubbleFraction():
  assert schedule.BubbleFraction(1, 7) == 0.0
  assert schedule.BubbleFraction(4, 12) == pytest.approx(3 / 15)
  # The bubble is the idle share of the K x (M + K - 1) stage-ticks.
  for k, m in [(2, 3), (4, 4), (8, 32)]:
    busy = sum(len(t) for t in schedule.GPipeSchedule(k, m))
    idle = k * (m + k - 1) - busy
    assert schedule.BubbleFraction(k, m) == pytest.approx(idle / (k * (m + k - 1)))


@pytest.mark.parametrize('k,m', [(0, 1), (1, 0), (2.0, 1), (True, 1)])
def testRejectsBadSizes(k, m):
  with pytest.raises(ValueError, match='must be a positive int'):
    schedule.GPipeSchedule(k, m)
