"""schedule: the clock ticks of a GPipe step, the bubble and the simulator."""

import math
import time

import pytest

from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate


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


# The simulator.


def _StepFormula(forward, backward, num_micro, remat, transfer=0.0):
  """Flow-shop makespan of identical micro-batches: sum + (M - 1) * max."""
  calls = [f + b if remat == 'always' else b
           for f, b in zip(forward, backward)]
  return sum(
      sum(costs) + (num_micro - 1) * max(costs) + (len(costs) - 1) * transfer
      for costs in (forward, calls))


@pytest.mark.parametrize('remat', ['always', 'never'])
@pytest.mark.parametrize('k,m', [(1, 1), (1, 4), (2, 3), (4, 8), (8, 32),
                                 (16, 4)])
def testSimulateEqualStagesMatchClosedForm(k, m, remat):
  sim = simulate.Simulate([1.0] * k, [2.0] * k, m, remat=remat)
  assert sim.bubble_fraction == pytest.approx(schedule.BubbleFraction(k, m))
  call = 3.0 if remat == 'always' else 2.0
  assert sim.forward_time == m + k - 1
  assert sim.step_time == (m + k - 1) * (1.0 + call)
  assert sim.utilization == pytest.approx([m / (m + k - 1)] * k)


def testSimulateUnevenStagesByHand():
  # K = 2, M = 2, forward 1 and 3, backward 2 and 4, no recompute:
  #   stage 0: F0 [0, 1], F1 [1, 2],                   B1 [11, 13], B0 [15, 17]
  #   stage 1:   F0 [1, 4], F1 [4, 7], B1 [7, 11], B0 [11, 15]
  sim = simulate.Simulate([1, 3], [2, 4], num_micro_batches=2, remat='never')
  E = simulate.Event  # pylint: disable=invalid-name
  assert sim.events == [
      E(0, 0, 'forward', 0, 1), E(0, 1, 'forward', 1, 2),
      E(0, 1, 'backward', 11, 13), E(0, 0, 'backward', 15, 17),
      E(1, 0, 'forward', 1, 4), E(1, 1, 'forward', 4, 7),
      E(1, 1, 'backward', 7, 11), E(1, 0, 'backward', 11, 15),
  ]
  assert sim.forward_time == 7 and sim.step_time == 17
  assert sim.utilization == pytest.approx([6 / 17, 14 / 17])
  assert sim.bubble_fraction == pytest.approx(1 - 20 / 34)
  # With remat every backward call first recomputes its forward.
  sim = simulate.Simulate([1, 3], [2, 4], num_micro_batches=2)
  assert [e for e in sim.events if e.stage == 1 and e.phase != 'forward'] == [
      E(1, 1, 'recompute', 7, 10), E(1, 1, 'backward', 10, 14),
      E(1, 0, 'recompute', 14, 17), E(1, 0, 'backward', 17, 21),
  ]
  assert sim.step_time == 24


@pytest.mark.parametrize('remat', ['always', 'never'])
def testSimulateUnevenStagesFollowFlowShopFormula(remat):
  forward = [0.5, 2.0, 1.25, 0.75, 3.0]
  backward = [1.0, 3.5, 2.0, 2.5, 1.0]
  for m in (1, 2, 7):
    for transfer in (0.0, 0.3):
      sim = simulate.Simulate(forward, backward, m, remat, transfer)
      assert sim.step_time == pytest.approx(
          _StepFormula(forward, backward, m, remat, transfer))
  # The slowest stage sets the pace: the bubble exceeds the closed form.
  sim = simulate.Simulate(forward, backward, 8, remat)
  assert sim.bubble_fraction > schedule.BubbleFraction(5, 8)


def testSimulateTransferCost():
  k, m = 4, 8
  base = simulate.Simulate([1.0] * k, [2.0] * k, m)
  slow = simulate.Simulate([1.0] * k, [2.0] * k, m, transfer_cost=0.5)
  # Each of the forward and backward passes crosses K - 1 stage boundaries.
  assert slow.step_time == pytest.approx(base.step_time + 2 * (k - 1) * 0.5)
  assert slow.bubble_fraction > base.bubble_fraction
  stage1 = [e for e in slow.events if e.stage == 1 and e.phase == 'forward']
  assert stage1[0].start == 1.5  # Stage 0's forward ends at 1, + transfer.


@pytest.mark.parametrize('remat, inputs, activations', [
    ('always', 4, 1),  # M inputs + one call's activations while it runs.
    ('except_last', 4, 1),  # M - 1 inputs + the kept last call (input too).
    ('never', 4, 4),  # Every call keeps its input and activations.
])
def testSimulateMemoryModel(remat, inputs, activations):
  sim = simulate.Simulate([1, 1], [2, 2], 4, remat)
  assert sim.peak_inputs == [inputs, inputs]
  assert sim.peak_activations == [activations, activations]
  assert sim.peak_memory == [activations, activations]  # Inputs count 0.
  sim = simulate.Simulate([1, 1], [2, 2], 4, remat, input_memory=[10, 20],
                          activation_memory=[100, 300])
  assert sim.peak_memory == [inputs * 10 + activations * 100,
                             inputs * 20 + activations * 300]


def testSimulateOneMicroBatchHoldsOneCall():
  for remat in schedule.REMAT_MODES:
    sim = simulate.Simulate([1], [1], 1, remat, input_memory=[1])
    assert (sim.peak_inputs, sim.peak_activations, sim.peak_memory) == (
        [1], [1], [2])


@pytest.mark.parametrize('remat', schedule.REMAT_MODES)
def testSimulatedEventsFollowTheGPipeOrder(remat):
  k, m, transfer = 3, 5, 0.25
  sim = simulate.Simulate([1.0, 2.0, 0.5], [2.0, 1.0, 3.0], m, remat, transfer)
  events = {(e.stage, e.micro_batch, e.phase): e for e in sim.events}
  assert len(events) == len(sim.events)

  def CallStart(stage, i):  # The backward call begins with its recompute.
    return events.get((stage, i, 'recompute'), events[stage, i,
                                                      'backward']).start

  for stage in range(k):
    own = [e for e in sim.events if e.stage == stage]
    assert all(a.end <= b.start for a, b in zip(own, own[1:]))  # Serial.
    assert [e.micro_batch for e in own if e.phase == 'forward'] == list(
        range(m))
    assert [e.micro_batch for e in own if e.phase == 'backward'] == list(
        reversed(range(m)))
    for i in range(m):
      recompute = events.get((stage, i, 'recompute'))
      assert (recompute is not None) == schedule.Recomputes(remat, i, m)
      if recompute:
        assert recompute.end == events[stage, i, 'backward'].start
      assert CallStart(stage, i) >= sim.forward_time
      if stage:  # Activations flow up, gradients down, each with a transfer.
        assert events[stage, i, 'forward'].start >= (
            events[stage - 1, i, 'forward'].end + transfer)
        assert CallStart(stage - 1, i) >= (
            events[stage, i, 'backward'].end + transfer)
  occupancy = simulate.StageOccupancy(sim.events, k)
  assert occupancy.step_time == pytest.approx(sim.step_time)
  assert occupancy.bubble_fraction == pytest.approx(sim.bubble_fraction)
  assert occupancy.utilization == pytest.approx(sim.utilization)


def testSimulateLargePipelineIsFast():
  """docs/planning.md: K = 128, M = 1024 in under a second (about 0.02 s).

  Timed in CPU seconds of this thread: the wall clock also counts the time
  the thread waits for a core, which on 2 cores shared with the other pytest
  worker and other jobs reached 0.8-1.07 s (3 runs in 30 over the limit under
  a load of 6), for 0.025 s of CPU.
  """
  start = time.thread_time()
  sim = simulate.Simulate([1.0] * 128, [2.0] * 128, 1024)
  elapsed = time.thread_time() - start
  assert elapsed < 1.0, elapsed
  assert len(sim.events) == 3 * 128 * 1024  # Forward, recompute, backward.
  assert sim.bubble_fraction == pytest.approx(
      schedule.BubbleFraction(128, 1024))


@pytest.mark.parametrize('kwargs, message', [
    (dict(forward_costs=[]), 'forward_costs is empty'),
    (dict(forward_costs='12'), "forward_costs='12' must be a list"),
    (dict(forward_costs=[1, -1]), r'forward_costs\[1\]=-1 must be a finite'),
    (dict(forward_costs=[1, math.inf]), r'forward_costs\[1\]=inf must be'),
    (dict(backward_costs=[1]), 'backward_costs has 1 entries .* expected 2'),
    (dict(backward_costs=[1, True]), r'backward_costs\[1\]=True must be'),
    (dict(num_micro_batches=0), 'num_micro_batches=0 must be a positive int'),
    (dict(remat='sometimes'), "remat='sometimes' is not supported; use one "
     r"of \['always', 'except_last', 'never'\]"),
    (dict(transfer_cost=-0.5), 'transfer_cost=-0.5 must be a finite number'),
    (dict(input_memory=[1]), 'input_memory has 1 entries'),
    (dict(activation_memory=[1, 'x']), r"activation_memory\[1\]='x' must"),
    (dict(forward_costs=[0, 0], backward_costs=[0, 0]), 'all zero'),
])
def testSimulateRejectsBadArguments(kwargs, message):
  args = dict(forward_costs=[1, 1], backward_costs=[2, 2], num_micro_batches=2)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    simulate.Simulate(**args)


def testStageOccupancy():
  events = [simulate.Event(0, 0, 'forward', 1.0, 2.0),
            simulate.Event(1, 0, 'forward', 2.0, 5.0)]
  occupancy = simulate.StageOccupancy(events, 2)
  assert occupancy.step_time == 4.0
  assert occupancy.utilization == [0.25, 0.75]
  assert occupancy.bubble_fraction == 0.5
  with pytest.raises(ValueError, match=r'stage=1, outside \[0, 1\)'):
    simulate.StageOccupancy(events, 1)
  with pytest.raises(ValueError, match='events is empty'):
    simulate.StageOccupancy([], 1)


def testRecomputes():
  assert [schedule.Recomputes('always', m, 3) for m in range(3)] == [True] * 3
  assert [schedule.Recomputes('except_last', m, 3) for m in range(3)] == [
      True, True, False]
  assert [schedule.Recomputes('never', m, 3) for m in range(3)] == [False] * 3


@pytest.mark.parametrize('k,m', [(1, 1), (2, 3), (4, 8), (3, 1)])
def testGPipeTicksAreTheForwardTicksThenTheirReverse(k, m):
  ticks = schedule.GPipeTicks(k, m)
  assert len(ticks) == 2 * (m + k - 1)
  assert all(len(tick) == k for tick in ticks)
  forward = schedule.PhaseTable(ticks, 'forward')
  backward = schedule.PhaseTable(ticks, 'backward')
  assert backward == forward[::-1]
  for t, row in enumerate(forward):
    assert row == [t - s if 0 <= t - s < m else schedule.IDLE
                   for s in range(k)]
  # Every stage runs every micro-batch once per phase.
  for table in (forward, backward):
    for s in range(k):
      assert sorted(r[s] for r in table if r[s] != schedule.IDLE) == list(
          range(m))


def testPhaseTableRejectsMixedTicks():
  one_f_one_b = [[schedule.Slot('forward', 0), None],
                 [schedule.Slot('forward', 1), schedule.Slot('forward', 0)],
                 [schedule.Slot('forward', 2), schedule.Slot('backward', 0)]]
  assert schedule.PhaseTable(one_f_one_b[:2], 'forward') == [[0, -1], [1, 0]]
  with pytest.raises(ValueError, match=r"tick 2 mixes phases \['backward', "
                     r"'forward'\]"):
    schedule.PhaseTable(one_f_one_b, 'forward')


@pytest.mark.parametrize('engine,k,m,remat,xla,expected', [
    ('auto', 8, 15, 'always', False, 'unrolled'),
    ('auto', 2, 16, 'always', False, 'loop'),
    ('auto', 1, 32, 'always', False, 'loop'),
    ('auto', 2, 2, 'always', True, 'loop'),
    ('auto', 8, 64, 'never', False, 'unrolled'),
    ('auto', 8, 64, 'except_last', True, 'unrolled'),
    ('unrolled', 8, 64, 'always', True, 'unrolled'),
    ('loop', 1, 1, 'always', False, 'loop'),
])
def testChooseEngine(engine, k, m, remat, xla, expected):
  assert schedule.AUTO_LOOP_MIN_MICRO_BATCHES == 16
  assert schedule.ChooseEngine(engine, k, m, remat, xla) == expected


@pytest.mark.parametrize('engine,remat,message', [
    ('fast', 'always', r"engine='fast' is not supported; use one of \['auto', "
     r"'unrolled', 'loop'\]"),
    ('loop', 'never', "remat='never' is not supported with engine='loop'"),
    ('auto', 'often', "remat='often' is not supported"),
])
def testChooseEngineErrors(engine, remat, message):
  with pytest.raises(ValueError, match=message):
    schedule.ChooseEngine(engine, 2, 2, remat)
