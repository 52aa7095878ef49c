"""The GPipe schedule: which stage runs which micro-batch at which clock tick.

Pure Python, no TensorFlow. The engine builds its graph in this order; the
arithmetic users plan with (bubble fraction, ticks per step) and the rule of
which calls re-materialize live here too.

    >>> GPipeSchedule(num_stages=2, num_micro_batches=3)
    [[(0, 0)], [(0, 1), (1, 0)], [(0, 2), (1, 1)], [(1, 2)]]
    >>> BubbleFraction(num_stages=4, num_micro_batches=12)
    0.2
"""

from typing import List, Tuple

from lingvo_gpipe.planning import checks

# Which stage calls recompute their forward pass in the backward pass.
REMAT_MODES = ('always', 'except_last', 'never')

# The phases of a stage call, in the order they run.
PHASES = ('forward', 'recompute', 'backward')


def GPipeSchedule(num_stages: int,
                  num_micro_batches: int) -> List[List[Tuple[int, int]]]:
  """The forward clock ticks of a GPipe step.

  At clock t, stage k works on micro-batch t - k (when that is in range), so the
  pipeline fills for K - 1 ticks, runs full, and drains for K - 1 ticks. The
  backward pass runs the same ticks in reverse.

  Args:
    num_stages: K, the number of pipeline stages.
    num_micro_batches: M, the number of micro-batches per mini-batch.

  Returns:
    A list of M + K - 1 ticks; tick t lists the (stage, micro_batch) pairs that
    run at clock t, by increasing stage.

  Raises:
    ValueError: if K or M is not a positive int.
  """
  checks.CheckPositiveInt('num_stages', num_stages)
  checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
  ticks = []
  for clock in range(num_micro_batches + num_stages - 1):
    ticks.append([(stage, clock - stage)
                  for stage in range(num_stages)
                  if 0 <= clock - stage < num_micro_batches])
  return ticks


def BubbleFraction(num_stages: int, num_micro_batches: int) -> float:
  """Idle fraction of a GPipe step with equal stages: (K - 1) / (M + K - 1).

  Args:
    num_stages: K, the number of pipeline stages.
    num_micro_batches: M, the number of micro-batches per mini-batch.

  Returns:
    The fraction of stage-ticks in which a stage has no work.

  Raises:
    ValueError: if K or M is not a positive int.
  """
  checks.CheckPositiveInt('num_stages', num_stages)
  checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
  return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def CheckRemat(remat: str) -> None:
  """Raises ValueError unless `remat` is one of `REMAT_MODES`."""
  if remat not in REMAT_MODES:
    raise ValueError(f'remat={remat!r} is not supported; use one of '
                     f'{list(REMAT_MODES)}.')


def Recomputes(remat: str, micro_batch: int, num_micro_batches: int) -> bool:
  """Whether a training call on `micro_batch` recomputes its forward pass.

  Args:
    remat: One of `REMAT_MODES`.
    micro_batch: The micro-batch index m, 0 <= m < M.
    num_micro_batches: M.

  Returns:
    True for 'always', for 'except_last' unless m is the last micro-batch,
    False for 'never'.

  Raises:
    ValueError: if `remat` is not one of `REMAT_MODES`.
  """
  CheckRemat(remat)
  return remat == 'always' or (remat == 'except_last' and
                               micro_batch < num_micro_batches - 1)

