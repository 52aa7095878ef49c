"""schedule and simulate: tables, their validator, the bubble, the simulator."""

import math

import pytest

from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate

F, B = schedule.FORWARD, schedule.BACKWARD
A = schedule.Action


def _Table(ticks, num_devices=2, virtual_stages=1, num_micro=2,
           loss_outside=True):
  return schedule.Table('hand', num_devices, virtual_stages, num_micro,
                        loss_outside, tuple(tuple(t) for t in ticks))


@pytest.mark.parametrize('k,m', [(1, 1), (1, 5), (3, 1), (4, 8), (8, 3)])
def testGPipeTableIsTheForwardTicksThenTheirMirror(k, m):
  table = schedule.BuildTable('gpipe', k, m)
  assert len(table.ticks) == 2 * (m + k - 1)
  forward, backward = table.ticks[:m + k - 1], table.ticks[m + k - 1:]
  for t, tick in enumerate(forward):  # Device k runs micro-batch t - k.
    assert list(tick) == [A(F, s, t - s) if 0 <= t - s < m else None
                          for s in range(k)]
  assert [[a and a.micro_batch for a in tick] for tick in backward] == [
      [a and a.micro_batch for a in tick] for tick in reversed(forward)]
  assert all(a.phase == B for tick in backward for a in tick if a)
  assert [phase for phase, _ in table.PhaseRuns()] == [F, B]


@pytest.mark.parametrize('k,v,m', [(2, 2, 2), (2, 2, 4), (4, 2, 8), (2, 4, 6),
                                   (4, 3, 4), (1, 3, 2)])
def testCircularTableWhenKDividesM(k, v, m):
  """v passes over the devices; M v + K - 1 forward ticks; chunk c on c % K."""
  table = schedule.BuildTable('gpipe', k, m, v)
  assert table.num_chunks == k * v
  runs = dict(table.PhaseRuns())
  assert len(runs[F]) == m * v + k - 1 == len(runs[B])
  for t, tick in enumerate(table.ticks):
    for device, action in enumerate(tick):
      if action:
        assert action.chunk % k == device
        if action.phase == F and action.chunk + 1 < k * v:
          # The next chunk takes the micro-batch at the next tick.
          assert table.tick_of[A(F, action.chunk + 1,
                                 action.micro_batch)] == t + 1
  # Busy M v ticks of each phase per device: the bubble is the closed form.
  busy = sum(1 for tick in runs[F] for a in tick if a)
  assert 1 - busy / (k * len(runs[F])) == pytest.approx(
      schedule.BubbleFraction(k, m, v))


def testCircularTableWithAPartialGroup():
  """K = 3 does not divide M = 4: still valid, with idle ticks in the middle."""
  table = schedule.BuildTable('gpipe', 3, 4, 2)
  assert str(table).splitlines()[1].split()[2:9] == [
      'F0.0', 'F0.1', 'F0.2', 'F3.0', 'F3.1', 'F3.2', 'F0.3']
  assert len(dict(table.PhaseRuns())[F]) > 4 * 2 + 3 - 1


def testBubbleFraction():
  assert schedule.BubbleFraction(1, 7) == 0.0
  assert schedule.BubbleFraction(4, 12) == pytest.approx(3 / 15)
  assert schedule.BubbleFraction(2, 2, 2) == pytest.approx(1 / 5)
  with pytest.raises(ValueError, match='virtual_stages=0 must be a positive'):
    schedule.BubbleFraction(2, 2, 0)


@pytest.mark.parametrize('k,m,v', [(0, 1, 1), (1, 0, 1), (2.0, 1, 1),
                                   (True, 1, 1), (2, 2, 0)])
def testGPipeTableRejectsBadSizes(k, m, v):
  with pytest.raises(ValueError, match='must be a positive int'):
    schedule.GPipeTable(k, m, v)


def testUnknownSchedule():
  with pytest.raises(ValueError, match=r"schedule='zigzag' is not supported; "
                     r"use one of \['gpipe'"):
    schedule.BuildTable('zigzag', 2, 2)


# The validator: a malformed table fails with the tick, device and action.
_GOOD = [[A(F, 0, 0), None], [A(F, 0, 1), A(F, 1, 0)], [None, A(F, 1, 1)],
         [None, A(B, 1, 1)], [A(B, 0, 1), A(B, 1, 0)], [A(B, 0, 0), None]]


def testValidatorAcceptsTheGPipeTable():
  assert schedule.Validate(_Table(_GOOD)).ticks == schedule.BuildTable(
      'gpipe', 2, 2).ticks


def _Broken(t, k, action):
  ticks = [list(tick) for tick in _GOOD]
  ticks[t][k] = action
  return ticks


@pytest.mark.parametrize('ticks,message', [
    (_Broken(1, 1, A(F, 0, 1)), r"tick 1, device 1: Action\(phase='forward', "
     r'chunk=0, micro_batch=1\): chunk 0 does not run on device 1'),
    (_Broken(2, 1, A(F, 1, 5)), 'tick 2, device 1: .* micro-batch 5 is '
     r'outside \[0, 2\)'),
    (_Broken(2, 1, A('sideways', 1, 1)), 'tick 2, device 1: .* is not an '
     'Action with a phase in'),
    (_Broken(2, 1, A(F, 1, 0)), r"tick 2, device 1: Action\(phase='forward', "
     r'chunk=1, micro_batch=0\) runs again \(first at tick 1\)'),
    (_Broken(2, 1, None), r"Action\(phase='forward', chunk=1, "
     r'micro_batch=1\) never runs'),
    ([[A(F, 0, 0), A(F, 1, 0)], [A(F, 0, 1), None], [None, A(F, 1, 1)]] +
     _GOOD[3:],
     r"tick 0, device 1: Action\(phase='forward', chunk=1, micro_batch=0\) "
     r"runs before Action\(phase='forward', chunk=0, micro_batch=0\) "
     r'\(tick 0\), which it needs'),
    ([[A(F, 0, 0), None], [A(F, 0, 1), A(B, 1, 0)], [None, A(F, 1, 0)],
      [None, A(F, 1, 1)], [None, A(B, 1, 1)], [A(B, 0, 1), None],
      [A(B, 0, 0), None]],
     r"tick 1, device 1: Action\(phase='backward', chunk=1, micro_batch=0\) "
     r"runs before Action\(phase='forward', chunk=1, micro_batch=0\) "
     r'\(tick 2\), which it needs'),
    ([[A(F, 0, 0), None], [A(F, 0, 1), A(F, 1, 0)], [None, A(B, 1, 0)],
      [A(B, 0, 0), A(F, 1, 1)], [None, A(B, 1, 1)], [A(B, 0, 1), None]],
     r"tick 2, device 1: Action\(phase='backward', chunk=1, micro_batch=0\) "
     'runs before the last forward of the last chunk'),
    ([[A(F, 0, 0)]], 'tick 0 has 1 entries, expected one per device'),
])
def testValidatorRejectsMalformedTables(ticks, message):
  with pytest.raises(schedule.TableError, match=message):
    schedule.Validate(_Table(ticks))


def testValidatorAllowsEarlyBackwardWithTheLossInside():
  ticks = [[A(F, 0, 0), None], [A(F, 0, 1), A(F, 1, 0)], [None, A(B, 1, 0)],
           [A(B, 0, 0), A(F, 1, 1)], [None, A(B, 1, 1)], [A(B, 0, 1), None]]
  schedule.Validate(_Table(ticks, loss_outside=False))


def testTableFromOrdersPlacesEachActionAtItsEarliestTick():
  orders = [[A(F, 0, 0), A(F, 0, 1), A(B, 0, 0), A(B, 0, 1)],
            [A(F, 1, 0), A(B, 1, 0), A(F, 1, 1), A(B, 1, 1)]]
  table = schedule.TableFromOrders('1f1b-like', num_devices=2,
                                   num_micro_batches=2, virtual_stages=1,
                                   loss_outside=False, orders=orders)
  assert str(table).splitlines()[1:] == [
      'device 0: F0.0 F0.1    - B0.0    - B0.1',
      'device 1:    - F1.0 B1.0 F1.1 B1.1    -']
  with pytest.raises(schedule.TableError, match='orders deadlock'):
    schedule.TableFromOrders(
        'bad', num_devices=2, num_micro_batches=2, virtual_stages=1,
        loss_outside=False,
        orders=[[A(B, 0, 0), A(F, 0, 0)] + orders[0][1::2], orders[1]])


def testPhaseRunsRejectsMixedTicks():
  ticks = [[A(F, 0, 0), None], [A(F, 0, 1), A(F, 1, 0)], [None, A(B, 1, 0)],
           [A(B, 0, 0), A(F, 1, 1)], [None, A(B, 1, 1)], [A(B, 0, 1), None]]
  with pytest.raises(schedule.TableError, match=r"tick 3: mixes phases "
                     r"\['backward', 'forward'\]"):
    _Table(ticks, loss_outside=False).PhaseRuns()


def testRecomputedCalls():
  table = schedule.BuildTable('gpipe', 2, 3)
  assert set(schedule.RecomputedCalls(table, 'always').values()) == {True}
  assert set(schedule.RecomputedCalls(table, 'never').values()) == {False}
  # 'except_last': the calls whose backward directly follows their forward
  # on the device: the last micro-batch of each device's last chunk.
  kept = [key for key, recomputes in schedule.RecomputedCalls(
      table, 'except_last').items() if not recomputes]
  assert kept == [(0, 2), (1, 2)]
  circular = schedule.BuildTable('gpipe', 2, 4, 2)
  kept = [key for key, recomputes in schedule.RecomputedCalls(
      circular, 'except_last').items() if not recomputes]
  assert kept == [(2, 3), (3, 3)]
  with pytest.raises(ValueError, match="remat='often' is not supported"):
    schedule.RecomputedCalls(table, 'often')


# The simulator.


def _Simulate(forward, backward, num_micro, remat='always', transfer=0.0,
              **kwargs):
  table = schedule.BuildTable('gpipe', len(forward), num_micro)
  return simulate.Simulate(table, forward, backward, remat, transfer,
                           **kwargs)


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
  sim = _Simulate([1.0] * k, [2.0] * k, m, remat=remat)
  assert sim.bubble_fraction == pytest.approx(schedule.BubbleFraction(k, m))
  call = 3.0 if remat == 'always' else 2.0
  assert sim.forward_time == m + k - 1
  assert sim.step_time == (m + k - 1) * (1.0 + call)
  assert sim.utilization == pytest.approx([m / (m + k - 1)] * k)


@pytest.mark.parametrize('lockstep', [False, True])
@pytest.mark.parametrize('k,v,m', [(2, 2, 2), (2, 2, 4), (4, 2, 8), (2, 4, 8)])
def testSimulateCircularEqualChunksMatchClosedForm(k, v, m, lockstep):
  """Chunks a v-th the size: the step is (M v + K - 1) chunk ticks a phase."""
  table = schedule.BuildTable('gpipe', k, m, v)
  sim = simulate.Simulate(table, [1.0 / v] * (k * v), [2.0 / v] * (k * v),
                          'never', lockstep=lockstep)
  assert sim.bubble_fraction == pytest.approx(
      schedule.BubbleFraction(k, m, v))
  assert sim.step_time == pytest.approx((m * v + k - 1) * 3.0 / v)
  # K = 2, M = 2: v = 2 takes 2.5 / 3 of GPipe's step (the ideal 0.83).
  if (k, m) == (2, 2):
    gpipe = _Simulate([1.0] * k, [2.0] * k, m, 'never')
    assert sim.step_time / gpipe.step_time == pytest.approx(
        (2 * v + 1) / v / 3)


def testSimulateUnevenStagesByHand():
  # K = 2, M = 2, forward 1 and 3, backward 2 and 4, no recompute:
  #   stage 0: F0 [0, 1], F1 [1, 2],                   B1 [11, 13], B0 [15, 17]
  #   stage 1:   F0 [1, 4], F1 [4, 7], B1 [7, 11], B0 [11, 15]
  sim = _Simulate([1, 3], [2, 4], 2, remat='never')
  E = simulate.Event  # pylint: disable=invalid-name
  assert sim.events == [
      E(0, 0, 0, 'forward', 0, 1), E(0, 0, 1, 'forward', 1, 2),
      E(0, 0, 1, 'backward', 11, 13), E(0, 0, 0, 'backward', 15, 17),
      E(1, 1, 0, 'forward', 1, 4), E(1, 1, 1, 'forward', 4, 7),
      E(1, 1, 1, 'backward', 7, 11), E(1, 1, 0, 'backward', 11, 15),
  ]
  assert sim.forward_time == 7 and sim.step_time == 17
  assert sim.utilization == pytest.approx([6 / 17, 14 / 17])
  assert sim.bubble_fraction == pytest.approx(1 - 20 / 34)
  # With remat every backward call first recomputes its forward.
  sim = _Simulate([1, 3], [2, 4], 2)
  assert [e for e in sim.events if e.stage == 1 and e.phase != 'forward'] == [
      E(1, 1, 1, 'recompute', 7, 10), E(1, 1, 1, 'backward', 10, 14),
      E(1, 1, 0, 'recompute', 14, 17), E(1, 1, 0, 'backward', 17, 21),
  ]
  assert sim.step_time == 24


def testSimulateLockstepTicksWaitForTheSlowestDevice():
  """The loop engine ends a tick on every device before the next begins.

  K = 2, M = 2, forward 1 and 3, backward 2 and 4, no recompute: ticks of
  1, 3, 3 (forward) and 4, 4, 2 (backward), 17 as in dataflow; a tick
  overhead of 0.5 adds 6 x 0.5. K = 3, M = 4, forward and backward 3, 1, 3:
  dataflow lets the cheap middle stage run ahead, 2 x (7 + 3 x 3) = 32, where
  each of the 2 x 6 lockstep ticks lasts 3: 36.
  """
  table = schedule.BuildTable('gpipe', 2, 2)
  dataflow = simulate.Simulate(table, [1, 3], [2, 4], 'never')
  lockstep = simulate.Simulate(table, [1, 3], [2, 4], 'never', lockstep=True)
  assert dataflow.step_time == lockstep.step_time == 17
  overhead = simulate.Simulate(table, [1, 3], [2, 4], 'never', lockstep=True,
                               tick_overhead=0.5)
  assert overhead.step_time == 17 + 6 * 0.5
  table = schedule.BuildTable('gpipe', 3, 4)
  dataflow = simulate.Simulate(table, [3, 1, 3], [3, 1, 3], 'never')
  lockstep = simulate.Simulate(table, [3, 1, 3], [3, 1, 3], 'never',
                               lockstep=True)
  assert (dataflow.step_time, lockstep.step_time) == (32, 36)


@pytest.mark.parametrize('remat', ['always', 'never'])
def testSimulateUnevenStagesFollowFlowShopFormula(remat):
  forward = [0.5, 2.0, 1.25, 0.75, 3.0]
  backward = [1.0, 3.5, 2.0, 2.5, 1.0]
  for m in (1, 2, 7):
    for transfer in (0.0, 0.3):
      sim = _Simulate(forward, backward, m, remat, transfer)
      assert sim.step_time == pytest.approx(
          _StepFormula(forward, backward, m, remat, transfer))
  # The slowest stage sets the pace: the bubble exceeds the closed form.
  sim = _Simulate(forward, backward, 8, remat)
  assert sim.bubble_fraction > schedule.BubbleFraction(5, 8)


def testSimulateTransferCost():
  k, m = 4, 8
  base = _Simulate([1.0] * k, [2.0] * k, m)
  slow = _Simulate([1.0] * k, [2.0] * k, m, transfer=0.5)
  # Each of the forward and backward passes crosses K - 1 stage boundaries.
  assert slow.step_time == pytest.approx(base.step_time + 2 * (k - 1) * 0.5)
  assert slow.bubble_fraction > base.bubble_fraction
  stage1 = [e for e in slow.events if e.stage == 1 and e.phase == 'forward']
  assert stage1[0].start == 1.5  # Stage 0's forward ends at 1, + transfer.


@pytest.mark.parametrize('remat, inputs, activations', [
    ('always', 4, 1),  # M inputs + one call's activations while it runs.
    ('except_last', 4, 1),  # The last call keeps its activations (+ M inputs).
    ('never', 4, 4),  # Every call keeps its input and activations.
])
def testSimulateMemoryModel(remat, inputs, activations):
  sim = _Simulate([1, 1], [2, 2], 4, remat)
  assert sim.peak_inputs == [inputs, inputs]
  assert sim.peak_activations == [activations, activations]
  assert sim.peak_memory == [activations, activations]  # Inputs count 0.
  sim = _Simulate([1, 1], [2, 2], 4, remat, input_memory=[10, 20],
                  activation_memory=[100, 300])
  assert sim.peak_memory == [inputs * 10 + activations * 100,
                             inputs * 20 + activations * 300]


def testSimulateCircularMemoryCountsEveryChunkOfADevice():
  """Device 0 of K = 2, v = 2 holds chunk 0's and chunk 2's inputs at once."""
  table = schedule.BuildTable('gpipe', 2, 4, 2)
  sim = simulate.Simulate(table, [1.0] * 4, [2.0] * 4, 'always',
                          input_memory=[1, 10, 100, 1000],
                          activation_memory=[5, 5, 5, 5])
  # At the last forward (chunk 2 or 3 on micro-batch 3): 4 inputs of each
  # chunk of the device + the running call's activations.
  assert sim.peak_inputs == [8, 8]
  assert sim.peak_activations == [1, 1]
  assert sim.peak_memory == [4 * 1 + 4 * 100 + 5, 4 * 10 + 4 * 1000 + 5]
  never = simulate.Simulate(table, [1.0] * 4, [2.0] * 4, 'never')
  assert never.peak_activations == [8, 8]


def testSimulateOneMicroBatchHoldsOneCall():
  for remat in schedule.REMAT_MODES:
    sim = _Simulate([1], [1], 1, remat, input_memory=[1])
    assert (sim.peak_inputs, sim.peak_activations, sim.peak_memory) == (
        [1], [1], [2])


@pytest.mark.parametrize('remat', schedule.REMAT_MODES)
def testSimulatedEventsFollowTheTable(remat):
  k, m, transfer = 3, 5, 0.25
  sim = _Simulate([1.0, 2.0, 0.5], [2.0, 1.0, 3.0], m, remat, transfer)
  events = {(e.stage, e.micro_batch, e.phase): e for e in sim.events}
  assert len(events) == len(sim.events)
  recomputes = schedule.RecomputedCalls(sim.table, remat)

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
      assert (recompute is not None) == recomputes[stage, i]
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


def testSimulateLargePipeline():
  """K = 128, M = 1024: every call simulated (timed in docs/planning.md)."""
  sim = _Simulate([1.0] * 128, [2.0] * 128, 1024)
  assert len(sim.events) == 3 * 128 * 1024  # Forward, recompute, backward.
  assert sim.bubble_fraction == pytest.approx(
      schedule.BubbleFraction(128, 1024))


@pytest.mark.parametrize('kwargs, message', [
    (dict(forward_costs=[]), 'forward_costs has 0 entries'),
    (dict(forward_costs='12'), "forward_costs='12' must be a list"),
    (dict(forward_costs=[1, -1]), r'forward_costs\[1\]=-1 must be a finite'),
    (dict(forward_costs=[1, math.inf]), r'forward_costs\[1\]=inf must be'),
    (dict(backward_costs=[1]), r'backward_costs has 1 entries .* expected 2 '
     r'\(one per chunk'),
    (dict(backward_costs=[1, True]), r'backward_costs\[1\]=True must be'),
    (dict(remat='sometimes'), "remat='sometimes' is not supported; use one "
     r"of \['always', 'except_last', 'never'\]"),
    (dict(transfer_cost=-0.5), 'transfer_cost=-0.5 must be a finite number'),
    (dict(tick_overhead=math.nan), 'tick_overhead=nan must be a finite'),
    (dict(input_memory=[1]), 'input_memory has 1 entries'),
    (dict(activation_memory=[1, 'x']), r"activation_memory\[1\]='x' must"),
    (dict(forward_costs=[0, 0], backward_costs=[0, 0]), 'all zero'),
])
def testSimulateRejectsBadArguments(kwargs, message):
  args = dict(table=schedule.BuildTable('gpipe', 2, 2), forward_costs=[1, 1],
              backward_costs=[2, 2])
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    simulate.Simulate(**args)


def testStageOccupancy():
  events = [simulate.Event(0, 0, 0, 'forward', 1.0, 2.0),
            simulate.Event(1, 1, 0, 'forward', 2.0, 5.0)]
  occupancy = simulate.StageOccupancy(events, 2)
  assert occupancy.step_time == 4.0
  assert occupancy.utilization == [0.25, 0.75]
  assert occupancy.bubble_fraction == 0.5
  with pytest.raises(ValueError, match=r'stage=1, outside \[0, 1\)'):
    simulate.StageOccupancy(events, 1)
  with pytest.raises(ValueError, match='events is empty'):
    simulate.StageOccupancy([], 1)


@pytest.mark.parametrize('engine,k,m,v,remat,xla,schedule_name,expected', [
    ('auto', 8, 64, 1, 'always', False, 'gpipe', 'unrolled'),
    ('auto', 2, 128, 1, 'never', False, 'gpipe', 'unrolled'),
    ('auto', 2, 128, 4, 'always', False, 'gpipe', 'loop'),
    ('auto', 1, 512, 1, 'except_last', False, 'gpipe', 'loop'),
    ('auto', 2, 2, 1, 'always', True, 'gpipe', 'loop'),
    ('auto', 2, 2, 1, 'never', False, '1f1b', 'loop'),
    ('unrolled', 8, 64, 1, 'always', True, 'gpipe', 'unrolled'),
    ('loop', 1, 1, 1, 'except_last', False, 'gpipe', 'loop'),
])
def testChooseEngine(engine, k, m, v, remat, xla, schedule_name, expected):
  assert schedule.ChooseEngine(engine, k, m, remat, xla, schedule_name,
                               virtual_stages=v) == expected


def testEngineCostsOfTheMeasuredCase():
  """K=8, M=64: the unrolled engine starts ~16 s later, steps ~7 ms faster."""
  assert schedule.AUTO_TRAINING_STEPS == 10_000
  unrolled, loop = schedule.EngineCosts(8, 64)
  assert unrolled == pytest.approx(4e-3 * 64**2)  # 16.4 s.
  assert loop == pytest.approx(10_000 * 5e-5 * 2 * 71)  # 7.1 ms x 10,000.
  # Where the two meet at K = 2 (v M calls per device).
  assert [schedule.ChooseEngine('auto', 2, m, 'always')
          for m in (250, 251)] == ['unrolled', 'loop']


@pytest.mark.parametrize('engine,remat,schedule_name,message', [
    ('fast', 'always', 'gpipe', r"engine='fast' is not supported; use one of "
     r"\['auto', 'unrolled', 'loop'\]"),
    ('unrolled', 'never', '1f1b', "schedule='1f1b' is not supported with "
     "engine='unrolled'"),
    ('auto', 'often', 'gpipe', "remat='often' is not supported"),
    ('auto', 'always', 'zigzag', "schedule='zigzag' is not supported"),
])
def testChooseEngineErrors(engine, remat, schedule_name, message):
  with pytest.raises(ValueError, match=message):
    schedule.ChooseEngine(engine, 2, 2, remat, schedule=schedule_name)


# 1F1B.


def _InFlight(table, device):
  """The most micro-batches (of any chunk) a device has begun, not ended."""
  live, most = set(), 0
  for action in table.device_orders[device]:
    key = (action.chunk, action.micro_batch)
    if action.phase == F:
      live.add(key)
      most = max(most, len(live))
    else:
      live.remove(key)
  return most


@pytest.mark.parametrize('k,m', [(1, 1), (2, 2), (4, 2), (4, 8), (4, 32),
                                 (8, 64)])
def testOneFOneBHoldsAtMostKMinusKMicroBatches(k, m):
  """Device k: at most K - k in flight (GPipe: M); GPipe's bubble."""
  table = schedule.BuildTable('1f1b', k, m)
  assert not table.loss_outside
  assert [_InFlight(table, d) for d in range(k)] == [
      min(k - d, m) for d in range(k)]
  gpipe = schedule.BuildTable('gpipe', k, m)
  assert [_InFlight(gpipe, d) for d in range(k)] == [m] * k
  # Equal calls (forward 1, backward 2): the same step as GPipe's.
  sim = simulate.Simulate(table, [1.0] * k, [2.0] * k, 'never')
  assert sim.step_time == simulate.Simulate(gpipe, [1.0] * k, [2.0] * k,
                                            'never').step_time
  assert sim.bubble_fraction == pytest.approx(schedule.BubbleFraction(k, m))
  # Each device alternates one forward and one backward in steady state.
  order = ''.join(a.phase[0] for a in table.device_orders[0])
  assert order == 'f' * min(k, m) + 'bf' * (m - min(k, m)) + 'b' * min(k, m)


@pytest.mark.parametrize('k,v,m', [(2, 2, 2), (2, 2, 4), (4, 2, 8),
                                   (2, 4, 8)])
def testInterleavedOneFOneBCutsTheBubble(k, v, m):
  """Megatron's order: chunks a v-th the size, less idle time than v = 1."""
  table = schedule.BuildTable('1f1b', k, m, v)
  assert table.num_chunks == k * v
  plain = simulate.Simulate(schedule.BuildTable('1f1b', k, m), [1.0] * k,
                            [2.0] * k, 'never')
  interleaved = simulate.Simulate(table, [1.0 / v] * (k * v),
                                  [2.0 / v] * (k * v), 'never')
  assert interleaved.step_time < plain.step_time
  assert interleaved.bubble_fraction < plain.bubble_fraction
  # Megatron: every device's in-flight count does not grow with M.
  bigger = schedule.BuildTable('1f1b', k, 4 * m, v)
  assert [_InFlight(bigger, d) for d in range(k)] == [
      _InFlight(table, d) for d in range(k)] or m == k


def testInterleavedOneFOneBNeedsKToDivideM():
  with pytest.raises(ValueError, match=r"num_micro_batches=3 with "
                     r"schedule='1f1b' and virtual_stages=2 must be a "
                     'multiple of num_stages=2'):
    schedule.BuildTable('1f1b', 2, 3, 2)
