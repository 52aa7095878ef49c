"""Timing a piece of work for a 'profile' partition: warm up, then a median.

Pure Python: the front ends (Lingvo's `costs.py`, the Keras layer's
`keras/costs.py`) build and run their cells; this module only decides how a
cost is measured, so that both measure the same way. The work is any call
that blocks until done, e.g. `lambda: session.run(step)`:

    >>> runs = []
    >>> seconds = MedianSeconds(lambda: runs.append(1), num_warmup=2,
    ...                         num_runs=7)
    >>> len(runs), seconds > 0
    (9, True)
"""

import statistics
import time
from typing import Callable

# The first runs warm up caches and kernels; the median of the rest is the
# cell's cost.
PROFILE_WARMUP_RUNS = 2
PROFILE_TIMED_RUNS = 7


def CheckRuns(num_warmup: int, num_runs: int) -> None:
  """Raises ValueError unless num_runs >= 1 and num_warmup >= 0."""
  if num_runs < 1 or num_warmup < 0:
    raise ValueError(f'num_runs={num_runs} must be >= 1 and num_warmup='
                     f'{num_warmup} >= 0.')


def MedianSeconds(run: Callable[[], object],
                  num_warmup: int = PROFILE_WARMUP_RUNS,
                  num_runs: int = PROFILE_TIMED_RUNS) -> float:
  """Calls `run` num_warmup times untimed, then num_runs times timed.

  Args:
    run: The work; it must block until done (e.g. fetch numpy results).
    num_warmup: Untimed calls first (>= 0).
    num_runs: Timed calls (>= 1).

  Returns:
    The median wall time of the timed calls, at least 1e-9 s (a cost of
    zero would make a partition ignore the cell).

  Raises:
    ValueError: if num_runs < 1 or num_warmup < 0.
  """
  CheckRuns(num_warmup, num_runs)
  for _ in range(num_warmup):
    run()
  seconds = []
  for _ in range(num_runs):
    start = time.perf_counter()
    run()
    seconds.append(time.perf_counter() - start)
  return max(float(statistics.median(seconds)), 1e-9)
