"""Tests of planning.simulate: a table's timing, bubble and memory model."""

import math

import pytest

from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate


def testGradientMemoryInTheTable():
  # GPipe K=2 M=2, remat 'never'; chunk c: input 1, activations 100,
  # gradients 10. Device 1 runs F1.0 F1.1 B1.1 B1.0: after both forwards it
  # holds 2 inputs + 2 activations = 202; its first backward adds the
  # gradient sum (10): 212. Its second backward holds one input and one
  # activation (101), the sum and a fresh copy (20): 121.
  table = schedule.BuildTable('gpipe', 2, 2)

  def Simulate(remat, **memory):
    return simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0], remat,
                             input_memory=[1.0, 1.0],
                             activation_memory=[100.0, 100.0], **memory)

  sim = Simulate('never', gradient_memory=[10.0, 10.0])
  assert sim.peak_memory == [212.0, 212.0]
  assert sim.peak_gradients == [10.0, 10.0]
  assert sim.peak_inputs == [2, 2] and sim.peak_activations == [2, 2]
  # 'always': two inputs, one running call's activations, then the sum and
  # the fresh copy of the second backward: max(2 + 100 + 10, 1 + 100 + 20).
  always = Simulate('always', gradient_memory=[10.0, 10.0])
  assert always.peak_memory == [121.0, 121.0]
  assert always.peak_gradients == [20.0, 20.0]
  # Without gradient memory the model is the one before.
  plain = Simulate('never')
  assert plain.peak_memory == [202.0, 202.0]
  assert plain.peak_gradients == [0.0, 0.0]
  with pytest.raises(ValueError, match='gradient_memory'):
    simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0],
                      gradient_memory=[1.0])


def testWorkspaceOfTheBackwardRunningAtThePeak():
  # K=2 v=2 M=1 'never': device 0 runs F0 F2 B2 B0. The stage inputs are
  # each chunk's own (2 for chunk 0, 4 for chunk 2), not the largest times
  # their number.
  table = schedule.BuildTable('gpipe', 2, 1, 2)
  sim = simulate.Simulate(table, [1.0] * 4, [1.0] * 4, 'never',
                          input_memory=[2.0, 3.0, 4.0, 1.0],
                          activation_memory=[10.0] * 4,
                          backward_memory=[50.0, 0.0, 3.0, 0.0])
  # Device 0 at B2: inputs 2 + 4, activations 20, workspace 3: 29; at B0:
  # 2 + 10 + 50 = 62, the peak, with B0's backward running.
  assert sim.peak_memory[0] == 62.0
  assert sim.peak_input_memory[0] == 2.0
  assert sim.peak_backward_chunk[0] == 0
  # Device 1 (chunks 1 and 3) peaks after its forwards: 3 + 1 + 20, and at
  # B3 (nothing transient) holds the same: the first such tick, a forward.
  assert sim.peak_memory[1] == 24.0 and sim.peak_backward_chunk[1] is None
  with pytest.raises(ValueError, match='backward_memory'):
    simulate.Simulate(table, [1.0] * 4, [1.0] * 4, backward_memory=[1.0])


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


def _VShapedTable(num_micro):
  """K = 2, v = 2, chunks 0 and 3 on device 0, 1 and 2 on device 1; GPipe."""
  orders = []
  for chunks in ((0, 3), (1, 2)):
    forward = [schedule.Action(schedule.FORWARD, c, m) for c in chunks
               for m in range(num_micro)]
    orders.append(forward + [schedule.Action(schedule.BACKWARD, c, m)
                             for _, c, m in reversed(forward)])
  return schedule.TableFromOrders(
      'v-shape', num_devices=2, num_micro_batches=num_micro, virtual_stages=2,
      loss_outside=True, orders=orders, placement=(0, 1, 1, 0))


def testSimulateVShapedPlacementTransfersOnlyBetweenDevices():
  # Forward 1, backward 2, transfer 0.5, no recompute, M = 2. Micro-batch
  # 0: F0 [0, 1], a transfer, F1 [1.5, 2.5]; F2 on the same device needs no
  # transfer but waits for F1.1 [2.5, 3.5]; a transfer to F3 on device 0.
  table = _VShapedTable(2)
  sim = simulate.Simulate(table, [1.0] * 4, [2.0] * 4, 'never',
                          transfer_cost=0.5)
  assert all(e.stage == table.Device(e.chunk) for e in sim.events)
  calls = {(e.chunk, e.micro_batch, e.phase): (e.start, e.end)
           for e in sim.events}
  assert [calls[c, 0, 'forward'] for c in range(4)] == [
      (0, 1), (1.5, 2.5), (3.5, 4.5), (5, 6)]
  assert calls[2, 1, 'forward'] == (4.5, 5.5)
  # Backward: B3 after the loss on device 0, B2 and B1 on device 1 with one
  # transfer between them, B0 back on device 0.
  assert [calls[c, 1, 'backward'] for c in (3, 2, 1, 0)] == [
      (7, 9), (9.5, 11.5), (13.5, 15.5), (16, 18)]
  assert sim.step_time == 20
  # The transfers cost the step 2 crossings each way; with the default
  # placement, which crosses devices at every chunk boundary, 3.
  for step, crossings in ((table, 4),
                          (schedule.BuildTable('gpipe', 2, 2, 2), 6)):
    times = [simulate.Simulate(step, [1.0] * 4, [2.0] * 4, 'never',
                               transfer_cost=t).step_time for t in (0.0, 0.5)]
    assert times[1] - times[0] == crossings * 0.5
  # In lockstep: 6 forward ticks of 1 and 6 backward ticks of 2, plus the
  # transfer in the 8 whose action reads from the other device (all but
  # F0.0, F2.0 and B1.1, whose chunks 1 and 2 share device 1, and B3.1).
  lockstep = simulate.Simulate(table, [1.0] * 4, [2.0] * 4, 'never',
                               transfer_cost=0.5, lockstep=True)
  assert len(table.ticks) == 12
  assert lockstep.step_time == 6 * 1 + 6 * 2 + 8 * 0.5


def testBusyTransfersOccupyTheSenderAndTheReceiver():
  """K = 2, M = 2, forward 1, backward 2, transfer 0.5: device 0 sends each
  forward's outputs for 0.5 before its next call; device 1 receives for 0.5
  before each of its calls that reads them; the gradients go back alike."""
  table = schedule.BuildTable('gpipe', 2, 2)
  sim = simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0], 'never',
                          transfer_cost=0.5, transfers_busy=True)
  calls = {(e.chunk, e.micro_batch, e.phase): (e.start, e.end)
           for e in sim.events}
  assert [calls[0, m, 'forward'] for m in (0, 1)] == [(0, 1), (1.5, 2.5)]
  assert [calls[1, m, 'forward'] for m in (0, 1)] == [(2, 3), (3.5, 4.5)]
  # The last chunk's backwards after the loss (all its forwards), each sent
  # for 0.5; device 0 receives each for 0.5.
  assert [calls[1, m, 'backward'] for m in (1, 0)] == [(4.5, 6.5), (7, 9)]
  assert [calls[0, m, 'backward'] for m in (1, 0)] == [(7.5, 9.5), (10, 12)]
  assert sim.step_time == 12
  # Only delaying the receiver, the same transfers cost less.
  assert simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0], 'never',
                           transfer_cost=0.5).step_time == 10


def testSimulateVShapedMemoryCountsTheChunksOfEachDevice():
  """Device 0 holds the inputs of chunks 0 and 3; device 1 of 1 and 2."""
  table = _VShapedTable(2)
  sim = simulate.Simulate(table, [1.0] * 4, [2.0] * 4, 'always',
                          input_memory=[1, 10, 100, 1000],
                          activation_memory=[5, 5, 5, 5])
  assert sim.peak_inputs == [4, 4]
  assert sim.peak_memory == [2 * 1 + 2 * 1000 + 5, 2 * 10 + 2 * 100 + 5]


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


# Tables that split the backward (zero bubble): B and W timed and held apart.


def _ZeroBubble(name, k, m, remat='never', **kwargs):
  """A zero bubble step with F = B = W = 1 a stage (a chunk of zbv: 1/2)."""
  v = 2 if name == 'zbv' else 1
  table = schedule.BuildTable(name, k, m, v)
  unit = 1.0 / v
  return simulate.Simulate(table, [unit] * (k * v), [2 * unit] * (k * v),
                           remat, weight_costs=[unit] * (k * v), **kwargs)


def testZeroBubbleStepsAgainst1F1BWithUnitCosts():
  """K = 2, M = 4, F = B = W: 1F1B 15, ZB-H1 13 (the paper's), ZB-V 12.5.

  1F1B: (M + K - 1)(F + B + W) = 15. ZB-H1: every device works 3M = 12;
  device 0 idles one tick (F + B - W) waiting for the first backward, and
  its deferred weight gradients fill the drain: 13. ZB-V (chunks of half a
  stage): 12 of work on every device plus the ramp, device 1's first
  forward waits for device 0's: 12.5, against the ideal 12 (0.80 of 1F1B).
  """
  one_f_one_b = simulate.Simulate(schedule.BuildTable('1f1b', 2, 4),
                                  [1.0] * 2, [2.0] * 2, 'never')
  assert one_f_one_b.step_time == 15.0
  assert _ZeroBubble('zb1p', 2, 4).step_time == 13.0
  assert _ZeroBubble('zbv', 2, 4).step_time == 12.5


@pytest.mark.parametrize('k', [1, 2, 3, 4])
@pytest.mark.parametrize('m', range(1, 9))
def testZeroBubbleStepsByFormula(k, m):
  """ZB-H1: 3M + (K - 1)(F + B - W) once M >= K, the paper's bubble.

  ZB-V: 3M + (K - 1) chunk forwards (the ramp) once M >= 2K - 1 fills the
  V; never longer than ZB-H1 and 1F1B.
  """
  zb1p, zbv = _ZeroBubble('zb1p', k, m), _ZeroBubble('zbv', k, m)
  one_f_one_b = simulate.Simulate(schedule.BuildTable('1f1b', k, m),
                                  [1.0] * k, [2.0] * k, 'never')
  assert zb1p.step_time <= one_f_one_b.step_time
  if m >= k:
    assert zb1p.step_time == 3 * m + k - 1
  if m >= 2 * k - 1:
    assert zbv.step_time == 3 * m + (k - 1) / 2
  assert zbv.step_time <= zb1p.step_time


def testWeightEventsAreTimedFromTheirOwnCosts():
  """B takes backward - weight, W takes weight, after its B, on its device."""
  table = schedule.BuildTable('zb1p', 2, 2)
  sim = simulate.Simulate(table, [1.0, 1.0], [3.0, 3.0], 'always',
                          weight_costs=[1.0, 2.0])
  by = {(e.phase, e.chunk, e.micro_batch): e for e in sim.events}
  for c, weight in enumerate([1.0, 2.0]):
    for m in range(2):
      w, b = by['weight', c, m], by['backward', c, m]
      assert w.end - w.start == weight and b.end - b.start == 3.0 - weight
      assert w.start >= b.end and w.stage == b.stage == c
      # remat 'always': the recompute belongs to B, never to W.
      assert by['recompute', c, m].end == b.start
  assert sum(e.end - e.start for e in sim.events if e.phase == 'weight') == 6
  lockstep = simulate.Simulate(table, [1.0, 1.0], [3.0, 3.0], 'never',
                               weight_costs=[1.0, 2.0], lockstep=True)
  # Lockstep: each tick lasts as long as its longest action.
  cost = {schedule.FORWARD: [1.0, 1.0], schedule.BACKWARD: [2.0, 1.0],
          schedule.WEIGHT: [1.0, 2.0]}
  assert lockstep.step_time == sum(
      max(cost[a.phase][a.chunk] for a in tick if a) for tick in table.ticks)
  assert {e.phase for e in lockstep.events} == {'forward', 'backward',
                                                'weight'}


@pytest.mark.parametrize('kwargs,message', [
    ({}, 'weight_costs is required: the zb1p table splits the backward'),
    ({'weight_costs': [1.0, 3.0]}, r'weight_costs\[1\]=3.0 is above '
     r'backward_costs\[1\]=2.0'),
    ({'weight_costs': [1.0]}, 'weight_costs has 1 entries'),
    ({'weight_costs': [1.0, 1.0], 'weight_memory': [-1.0, 0.0]},
     r'weight_memory\[0\]=-1.0 must be a finite number >= 0'),
])
def testSimulateRejectsBadWeightArguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    simulate.Simulate(schedule.BuildTable('zb1p', 2, 2), [1.0, 1.0],
                      [2.0, 2.0], **kwargs)


def testWeightCostsAreIgnoredByTablesThatDoNotSplit():
  table = schedule.BuildTable('1f1b', 2, 2)
  assert simulate.Simulate(table, [1.0] * 2, [2.0] * 2,
                           weight_costs=[1.0] * 2).step_time == (
                               simulate.Simulate(table, [1.0] * 2,
                                                 [2.0] * 2).step_time)


def testMemoryWalkHoldsTheWeightStashFromBToW():
  """zb1p K=2 M=4, remat 'never', activations 1, W stash 0.5.

  Device 0 (F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 W0.1 ...) holds 1F1B's two calls'
  activations at most; its stash never meets two activations. Device 1
  (F1.0 B1.0 F1.1 B1.1 W1.0 ...) defers one W: after F1.1 it holds one
  call's activations and one stash, 1.5, where 1F1B holds 1.
  """
  sim = _ZeroBubble('zb1p', 2, 4, weight_memory=[0.5, 0.5])
  assert sim.peak_memory == [2.0, 1.5]
  assert sim.peak_weight_stash == [0.0, 0.5]
  assert sim.peak_weights_waiting == [0, 1]
  assert sim.peak_activations == [2, 1]
  # Without a stash size, the split holds what 1F1B holds.
  assert _ZeroBubble('zb1p', 2, 4).peak_memory == [2.0, 1.0]


def testWeightGradientsAppearAtW():
  """K = M = 1: F B W. Gradients 10, activations 1, W stash 0.5, workspace 2.

  Split: B holds the activations and its workspace (3), then the stash
  alone; W adds the gradient sum: 10.5. Unsplit (1F1B), the backward holds
  activations, workspace and gradients at once: 13.
  """
  memory = {'activation_memory': [1.0], 'gradient_memory': [10.0],
            'backward_memory': [2.0]}
  split = _ZeroBubble('zb1p', 1, 1, weight_memory=[0.5], **memory)
  assert split.peak_memory == [10.5]
  assert split.peak_gradients == [10.0] and split.peak_weight_stash == [0.5]
  assert split.peak_backward_chunk == [None]
  whole = simulate.Simulate(schedule.BuildTable('1f1b', 1, 1), [1.0], [2.0],
                            'never', **memory)
  assert whole.peak_memory == [13.0] and whole.peak_backward_chunk == [0]
