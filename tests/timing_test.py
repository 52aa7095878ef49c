"""Tests of planning.timing: the median of timed runs after warm-up ones."""

from unittest import mock

import pytest

from lingvo_gpipe.planning import timing


def testMedianSecondsTimesOnlyTheRunsAfterTheWarmup():
  runs = []
  # Three timed runs of 1 s, 3 s and 2 s: the median is 2 s.
  clock = iter([10.0, 11.0, 20.0, 23.0, 30.0, 32.0])
  with mock.patch.object(timing.time, 'perf_counter', lambda: next(clock)):
    seconds = timing.MedianSeconds(lambda: runs.append(1), num_warmup=2,
                                   num_runs=3)
  assert seconds == 2.0 and len(runs) == 5
  # A run faster than the clock still costs something.
  clock = iter([5.0, 5.0])
  with mock.patch.object(timing.time, 'perf_counter', lambda: next(clock)):
    assert timing.MedianSeconds(lambda: None, num_warmup=0,
                                num_runs=1) == 1e-9


def testCheckRuns():
  timing.CheckRuns(0, 1)
  for num_warmup, num_runs in ((0, 0), (-1, 1)):
    with pytest.raises(ValueError, match=f'num_runs={num_runs} must be >= 1 '
                       f'and num_warmup={num_warmup} >= 0'):
      timing.CheckRuns(num_warmup, num_runs)
