"""Tests of planning.schedule: tables, their validator, the bubble, engines.

(The simulator, which runs the tables, is tested in simulate_test.py.)
"""

import pytest

from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate

F, B, W = schedule.FORWARD, schedule.BACKWARD, schedule.WEIGHT
A = schedule.Action


def _Table(ticks, num_devices=2, num_micro=2, virtual_stages=1,
           loss_outside=True, placement=()):
  return schedule.Table(
      schedule='hand', num_devices=num_devices, num_micro_batches=num_micro,
      virtual_stages=virtual_stages, loss_outside=loss_outside,
      ticks=tuple(tuple(t) for t in ticks), placement=placement)


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


# Placement: V-shaped, K = 2, v = 2, M = 1 (chunks 0 and 3 on device 0).
_V_SHAPE = (0, 1, 1, 0)
_V_TICKS = [[A(F, 0, 0), None], [None, A(F, 1, 0)], [None, A(F, 2, 0)],
            [A(F, 3, 0), None], [A(B, 3, 0), None], [None, A(B, 2, 0)],
            [None, A(B, 1, 0)], [A(B, 0, 0), None]]


def _VTable(placement=_V_SHAPE, ticks=None, num_devices=2):
  return _Table(_V_TICKS if ticks is None else ticks,
                num_devices=num_devices, num_micro=1, virtual_stages=2,
                placement=placement)


def testDefaultPlacementIsChunkModK():
  table = schedule.BuildTable('gpipe', 3, 2, 2)
  assert table.placement == (0, 1, 2, 0, 1, 2)
  assert table.device_chunks == ((0, 3), (1, 4), (2, 5))
  assert [table.Device(c) for c in range(6)] == [0, 1, 2, 0, 1, 2]
  assert _Table(_GOOD) == _Table(_GOOD, placement=(0, 1))
  assert 'placement' not in str(table)


def testValidatorAcceptsAVShapedPlacement():
  table = schedule.Validate(_VTable())
  assert table.placement == _V_SHAPE
  assert table.device_chunks == ((0, 3), (1, 2))
  assert [table.Device(c) for c in range(4)] == [0, 1, 1, 0]
  assert str(table).splitlines() == [
      'hand: K=2 v=2 M=1 placement=(0, 1, 1, 0), 8 ticks',
      'device 0: F0.0    -    - F3.0 B3.0    -    - B0.0',
      'device 1:    - F1.0 F2.0    -    - B2.0 B1.0    -']


@pytest.mark.parametrize('placement,message', [
    ((0, 1, 1), r'placement=\(0, 1, 1\) must be a tuple of 4 devices, one '
     r'per chunk'),
    ([0, 1, 1, 0], r'placement=\[0, 1, 1, 0\] must be a tuple of 4'),
    ((0, 1, 2, 0), r'placement=\(0, 1, 2, 0\): chunk 2 is on device 2; a '
     r'device is an int in \[0, 2\)'),
    ((0, 1, -1, 0), 'chunk 2 is on device -1; a device is an int'),
    ((0, 1, True, 0), 'chunk 2 is on device True; a device is an int'),
    ((0, 1, 1.0, 0), 'chunk 2 is on device 1.0; a device is an int'),
])
def testValidatorRejectsBadPlacements(placement, message):
  with pytest.raises(schedule.TableError, match=message):
    schedule.Validate(_VTable(placement))


def testValidatorRejectsADeviceWithoutChunks():
  ticks = [[A(F, c, 0), None, None] for c in range(6)] + [
      [A(B, c, 0), None, None] for c in reversed(range(6))]
  with pytest.raises(schedule.TableError, match=r'placement=\(0, 0, 0, 0, 0, '
                     r'0\) gives device 1 no chunk; every device'):
    schedule.Validate(_Table(ticks, num_devices=3, num_micro=1,
                             virtual_stages=2, placement=(0,) * 6))


def testValidatorRejectsAnActionOffItsPlacedDevice():
  # Chunk 2 on device 0, where the default placement would put it.
  ticks = [list(tick) for tick in _V_TICKS]
  ticks[2] = [A(F, 2, 0), None]
  with pytest.raises(schedule.TableError, match=r"tick 2, device 0: "
                     r"Action\(phase='forward', chunk=2, micro_batch=0\): "
                     r'chunk 2 does not run on device 0: placement=\(0, 1, '
                     r'1, 0\) puts it on device 1'):
    schedule.Validate(_VTable(ticks=ticks))
  with pytest.raises(schedule.TableError, match='chunk 2 does not run on '
                     r'device 1: placement=\(0, 1, 0, 1\) puts it on device '
                     '0'):
    schedule.Validate(_VTable(placement=()))


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


def testTableFromOrdersWithAPlacement():
  orders = [[a for tick in _V_TICKS for a in tick[k:k + 1] if a]
            for k in range(2)]
  table = schedule.TableFromOrders('hand', num_devices=2, num_micro_batches=1,
                                   virtual_stages=2, loss_outside=True,
                                   orders=orders, placement=[0, 1, 1, 0])
  assert table == _VTable()
  with pytest.raises(schedule.TableError, match='chunk 2 does not run on '
                     'device 1'):
    schedule.TableFromOrders('hand', num_devices=2, num_micro_batches=1,
                             virtual_stages=2, loss_outside=True,
                             orders=orders)


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


def _MostHeld(table, device, begin, end):
  """The most calls of a device between their `begin` and `end` actions."""
  live, most = set(), 0
  for action in table.device_orders[device]:
    key = (action.chunk, action.micro_batch)
    if action.phase == begin:
      live.add(key)
      most = max(most, len(live))
    elif action.phase == end:
      live.remove(key)
  return most


def _InFlight(table, device):
  """The most micro-batches (of any chunk) a device has begun, not ended.

  Ended: backward (input gradients) done; see `_WeightsWaiting` for what a
  table that splits the backward keeps after that.
  """
  return _MostHeld(table, device, F, B)


def _WeightsWaiting(table, device):
  """The most calls of a device whose backward ran and weight gradient not."""
  return _MostHeld(table, device, B, W)


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


# Zero bubble: the backward split into B (input gradients) and W (weights).


def _SplitTable(ticks, schedule_name='hand', num_micro=1):
  return schedule.Table(
      schedule=schedule_name, num_devices=2, num_micro_batches=num_micro,
      virtual_stages=1, loss_outside=False,
      ticks=tuple(tuple(t) for t in ticks))


# K = 2, M = 1, the backward split: a valid table to break.
_SPLIT = [[A(F, 0, 0), None], [None, A(F, 1, 0)], [None, A(B, 1, 0)],
          [A(B, 0, 0), A(W, 1, 0)], [A(W, 0, 0), None]]


def testWeightActions():
  assert str(A(W, 0, 1)) == 'W0.1'
  assert schedule.ACTION_PHASES == (F, B, W)
  table = schedule.Validate(_SplitTable(_SPLIT))
  assert table.split_backward
  assert not schedule.BuildTable('1f1b', 2, 2).split_backward
  assert str(table).splitlines()[1:] == [
      'device 0: F0.0    -    - B0.0 W0.0',
      'device 1:    - F1.0 B1.0 W1.0    -']
  # Remat concerns the forward and backward pair: each device's B follows
  # its F directly (idle ticks between do not count), the W after it does
  # not matter.
  assert schedule.RecomputedCalls(table, 'except_last') == {
      (0, 0): False, (1, 0): False}


@pytest.mark.parametrize('ticks,name,message', [
    # One call without its W, in a table that splits the backward.
    (_SPLIT[:4], 'hand', r"Action\(phase='weight', chunk=0, micro_batch=0\) "
     'never runs; .* weight gradient once'),
    # W before its B.
    ([_SPLIT[0], _SPLIT[1], [None, A(W, 1, 0)], [None, A(B, 1, 0)],
      [A(B, 0, 0), None], [A(W, 0, 0), None]], 'hand',
     r"tick 2, device 1: .*'weight', chunk=1.* runs before .*'backward', "
     'chunk=1'),
    # W on the same tick as its B (another device may not run it either).
    ([_SPLIT[0], _SPLIT[1], [A(W, 0, 0), A(B, 1, 0)], [A(B, 0, 0),
                                                       A(W, 1, 0)]], 'hand',
     "runs before"),
    # W on another device than its chunk's.
    ([*_SPLIT[:4], [None, A(W, 0, 0)]], 'hand',
     'chunk 0 does not run on device 1'),
    # W in the table of a schedule that does not split the backward.
    (_SPLIT, '1f1b', "W1.0|weight-gradient action, but schedule '1f1b' does "
     'not split the backward'),
    # A schedule that splits it, without W.
    ([_SPLIT[0], _SPLIT[1], [None, A(B, 1, 0)], [A(B, 0, 0), None]], 'zb1p',
     "no weight-gradient action, but schedule 'zb1p' splits the backward"),
])
def testValidatorRulesOfWeightActions(ticks, name, message):
  with pytest.raises(schedule.TableError, match=message):
    schedule.Validate(_SplitTable(ticks, name))


def testTableFromOrdersPlacesWeightActions():
  orders = [[A(F, 0, 0), A(B, 0, 0), A(W, 0, 0)],
            [A(F, 1, 0), A(B, 1, 0), A(W, 1, 0)]]
  table = schedule.TableFromOrders('hand', 2, 1, 1, False, orders)
  assert table.tick_of[A(W, 1, 0)] == 3 and table.tick_of[A(W, 0, 0)] == 4
  with pytest.raises(schedule.TableError, match='deadlock'):
    schedule.TableFromOrders('hand', 2, 1, 1, False,
                             [[A(F, 0, 0), A(W, 0, 0), A(B, 0, 0)],
                              orders[1]])


def testZeroBubbleTablesPrint():
  assert str(schedule.BuildTable('zb1p', 2, 4)) == (
      'zb1p: K=2 v=1 M=4, 13 ticks\n'
      'device 0: F0.0 F0.1    - B0.0 W0.0 F0.2 B0.1 W0.1 F0.3 B0.2 W0.2 '
      'B0.3 W0.3\n'
      'device 1:    - F1.0 B1.0 F1.1 B1.1 W1.0 F1.2 B1.2 W1.1 F1.3 B1.3 '
      'W1.2 W1.3')
  zbv = str(schedule.BuildTable('zbv', 2, 4, 2)).splitlines()
  assert zbv[0] == 'zbv: K=2 v=2 M=4 placement=(0, 1, 1, 0), 25 ticks'


@pytest.mark.parametrize('k', [1, 2, 3, 4])
@pytest.mark.parametrize('m', range(1, 9))
def testZB1PKeeps1F1BsInFlightCount(k, m):
  """Valid for every K, M; 1F1B's F/B order and in-flight micro-batches."""
  table = schedule.BuildTable('zb1p', k, m)
  one_f_one_b = schedule.BuildTable('1f1b', k, m)
  assert table.split_backward and not table.loss_outside
  assert schedule.SCHEDULES['zb1p'].loss_inside
  for d in range(k):
    assert _InFlight(table, d) == _InFlight(one_f_one_b, d) == min(k - d, m)
    # Device d defers at most d weight gradients beyond the running one.
    assert _WeightsWaiting(table, d) <= min(d + 1, m)
    # Forwards and backwards in 1F1B's order.
    assert [a for a in table.device_orders[d] if a.phase != W] == list(
        one_f_one_b.device_orders[d])


@pytest.mark.parametrize('k', [1, 2, 3, 4])
@pytest.mark.parametrize('m', range(1, 9))
def testZBVIsAVWithBoundedMemory(k, m):
  """Valid for every K, M; chunks c and 2K - 1 - c on device c."""
  table = schedule.BuildTable('zbv', k, m, 2)
  assert table.split_backward and table.num_chunks == 2 * k
  assert table.placement == tuple(range(k)) + tuple(reversed(range(k)))
  assert table.device_chunks == tuple((d, 2 * k - 1 - d) for d in range(k))
  # Chunks are half a stage: every device holds at most 2K chunk calls'
  # activations, 1F1B's K stage calls on device 0, whatever M (exactly that
  # once M >= 2K - 1 fills the V). Weight gradients wait on the devices
  # near the V's tip: up to 2K - 1 on device K - 1.
  for d in range(k):
    assert _InFlight(table, d) <= 2 * k
    assert _InFlight(table, d) == 2 * k or m < 2 * k - 1
    assert _WeightsWaiting(table, d) <= 2 * d + 1


@pytest.mark.parametrize('name,v,message', [
    ('zbv', 1, "virtual_stages=1 is not supported with schedule='zbv'"),
    ('zbv', 3, "virtual_stages=3 is not supported with schedule='zbv'"),
    ('zb1p', 2, "virtual_stages=2 is not supported with schedule='zb1p'"),
    ('1f1b', 2, 'num_micro_batches=3 with schedule=.1f1b. and '
     'virtual_stages=2'),
    ('zbv', 0, 'virtual_stages=0 must be a positive int'),
])
def testScheduleSizeErrorsNameTheParameter(name, v, message):
  with pytest.raises(ValueError, match=message):
    schedule.CheckScheduleSizes(name, 2, 3, v)
  with pytest.raises(ValueError, match=message):
    schedule.BuildTable(name, 2, 3, v)


def testCheckScheduleSizesAcceptsWhatBuilds():
  assert schedule.CheckScheduleSizes('zbv', 2, 1, 2).split_backward
  assert not schedule.CheckScheduleSizes('gpipe', 3, 5, 4).split_backward
  with pytest.raises(ValueError, match="schedule='zb2p' is not supported"):
    schedule.CheckScheduleSizes('zb2p', 2, 2)


@pytest.mark.parametrize('name', ['zb1p', 'zbv'])
def testZeroBubbleNeedsTheLoopEngine(name):
  with pytest.raises(ValueError, match=f"schedule='{name}' is not supported "
                     "with engine='unrolled'"):
    schedule.CheckEngine('unrolled', 'always', name)
  assert schedule.ChooseEngine('auto', 2, 4, 'never', schedule=name,
                               virtual_stages=2 if name == 'zbv' else 1) == (
                                   'loop')
  with pytest.raises(schedule.TableError, match='mixes phases'):
    schedule.BuildTable(name, 2, 4, 2 if name == 'zbv' else 1).PhaseRuns()


@pytest.mark.parametrize('name,num_stages,virtual_stages', [
    ('gpipe', 3, 1), ('gpipe', 2, 3), ('1f1b', 2, 2), ('zb1p', 3, 1),
    ('zbv', 3, 2)])
def testScheduleKnowsItsTablesPlacement(name, num_stages, virtual_stages):
  """`Schedule.placement` (what `CellDevices` reads) is its tables'."""
  table = schedule.BuildTable(name, num_stages, 2 * num_stages,
                              virtual_stages=virtual_stages)
  assert schedule.SCHEDULES[name].placement(
      num_stages, virtual_stages) == table.placement
