"""The GPipe schedule: which stage runs which micro-batch at which clock tick.

Pure Python, no TensorFlow. The engine builds its graph in this order; the
arithmetic users plan with (bubble fraction, ticks per step) and the rule of
which calls re-materialize live here too.

    >>> GPipeSchedule(num_stages=2, num_micro_batches=3)
    [[(0, 0)], [(0, 1), (1, 0)], [(0, 2), (1, 1)], [(1, 2)]]
    >>> BubbleFraction(num_stages=4, num_micro_batches=12)
    0.2
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

from lingvo_gpipe.planning import checks

# Which stage calls recompute their forward pass in the backward pass.
REMAT_MODES = ('always', 'except_last', 'never')

# The phases of a stage call, in the order they run.
PHASES = ('forward', 'recompute', 'backward')

# Idle: no micro-batch at this tick (a `PhaseTable` entry).
IDLE = -1

# The engines that build a step (see lingvo_gpipe.engine), and 'auto'.
ENGINES = ('unrolled', 'loop')
# The remat modes the loop engine supports: it always re-materializes.
LOOP_REMAT_MODES = ('always',)
# 'auto' builds the loop engine from this many micro-batches on. Measured
# (docs/benchmarks.md, scale): starting and training 100 steps, the unrolled
# engine was cheaper at every K in {2, 4, 8} up to M = 8, the loop engine at
# every K from M = 16 on; the unrolled engine's start-up grows with M.
AUTO_LOOP_MIN_MICRO_BATCHES = 16


class Slot(NamedTuple):
  """What one stage does at one clock tick: a phase on a micro-batch.

  A 'backward' slot includes the recompute of the forward pass when the call
  re-materializes.
  """
  phase: str  # 'forward' or 'backward'.
  micro_batch: int


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


def GPipeTicks(num_stages: int,
               num_micro_batches: int) -> List[List[Optional[Slot]]]:
  """A whole GPipe training step as data: what every stage does at every tick.

  The M + K - 1 forward ticks of `GPipeSchedule`, then the same ticks in
  reverse as backward ticks. Engines read a step from this table (the loop
  engine through `PhaseTable`), so another schedule is another table.

  Args:
    num_stages: K.
    num_micro_batches: M.

  Returns:
    2 (M + K - 1) ticks of K entries; ticks[t][k] is stage k's `Slot` at tick
    t, or None when the stage is idle.

  Raises:
    ValueError: if K or M is not a positive int.
  """
  forward = GPipeSchedule(num_stages, num_micro_batches)
  ticks = []
  for phase, order in (('forward', forward), ('backward', forward[::-1])):
    for tick in order:
      row = [None] * num_stages
      for stage, micro_batch in tick:
        row[stage] = Slot(phase, micro_batch)
      ticks.append(row)
  return ticks


def PhaseTable(ticks: Sequence[Sequence[Optional[Slot]]],
               phase: str) -> List[List[int]]:
  """The ticks of one phase as micro-batch numbers, `IDLE` where idle.

  Args:
    ticks: A step from e.g. `GPipeTicks`.
    phase: 'forward' or 'backward'.

  Returns:
    One row per tick that has work of `phase`, in order: row[k] is the
    micro-batch stage k works on, or IDLE.

  Raises:
    ValueError: if a tick mixes the phase with another one (an engine that
      runs the phases as separate loops cannot run such a schedule).
  """
  table = []
  for t, tick in enumerate(ticks):
    phases = {slot.phase for slot in tick if slot is not None}
    if phase not in phases:
      continue
    if len(phases) > 1:
      raise ValueError(f'tick {t} mixes phases {sorted(phases)}; the loop '
                       'engine runs all forward ticks, then all backward '
                       'ticks.')
    table.append([IDLE if slot is None else slot.micro_batch for slot in tick])
  return table


def CheckEngine(engine: str, remat: str) -> None:
  """Raises ValueError unless `engine` ('auto' too) supports `remat`."""
  if engine != 'auto' and engine not in ENGINES:
    raise ValueError(f'engine={engine!r} is not supported; use one of '
                     f'{["auto"] + list(ENGINES)}.')
  CheckRemat(remat)
  if engine == 'loop' and remat not in LOOP_REMAT_MODES:
    raise ValueError(
        f"remat={remat!r} is not supported with engine='loop', which always "
        "re-materializes; use remat='always', or engine='unrolled' for "
        f'remat={remat!r}.')


def ChooseEngine(engine: str,
                 num_stages: int,
                 num_micro_batches: int,
                 remat: str,
                 compiled_by_xla: bool = False) -> str:
  """The engine that builds a step: `engine` itself unless it is 'auto'.

  'auto' is 'loop' when remat is 'always' and either M >=
  AUTO_LOOP_MIN_MICRO_BATCHES or the step is compiled by XLA; else
  'unrolled'. Under XLA the unrolled engine's recompute is merged back into
  the forward pass and saves no memory, the loop engine's is not
  (docs/engines.md).

  Args:
    engine: 'auto', 'unrolled' or 'loop'.
    num_stages: K.
    num_micro_batches: M.
    remat: One of `REMAT_MODES`.
    compiled_by_xla: Whether XLA compiles the step (e.g. on TPU).

  Returns:
    'unrolled' or 'loop'.

  Raises:
    ValueError: on an unknown engine or remat mode, a remat mode the engine
      does not support, or K or M that is not a positive int.
  """
  CheckEngine(engine, remat)
  checks.CheckPositiveInt('num_stages', num_stages)
  checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
  if engine != 'auto':
    return engine
  if remat in LOOP_REMAT_MODES and (
      compiled_by_xla or
      num_micro_batches >= AUTO_LOOP_MIN_MICRO_BATCHES):
    return 'loop'
  return 'unrolled'
