"""Tests of planning.lowering and planning.rows: tables lowered, no TF."""

import random

import pytest

from lingvo_gpipe.planning import lowering
from lingvo_gpipe.planning import rows
from lingvo_gpipe.planning import schedule
import random_tables

F, B = schedule.FORWARD, schedule.BACKWARD


def _Lowered(table, skips=(), remat='always', training=True):
  return lowering.Lower(table, lowering.Edges(table.num_chunks, skips),
                        remat, training)


def testAllocateSlotsReusesFreedSlots():
  """A slot is free at its last reader's tick; greedy by first tick."""
  assert lowering.AllocateSlots({}) == (0, {})
  # Nested and back-to-back intervals: m2 takes m1's slot at m1's last read.
  assert lowering.AllocateSlots({0: (0, 9), 1: (1, 3), 2: (3, 5),
                                 3: (6, 7)}) == (2, {0: 0, 1: 1, 2: 1, 3: 1})


def testAllocateSlotsUsesTheMostLiveAtOnce():
  """On random intervals: as many slots as the most live at one tick, and
  no two micro-batches live at once share one."""
  rng = random.Random(0)
  for _ in range(200):
    intervals = {}
    for m in range(rng.randint(1, 12)):
      first = rng.randint(0, 20)
      intervals[m] = (first, first + rng.randint(0, 8))
    count, slots = lowering.AllocateSlots(intervals)
    most = max(sum(1 for a, b in intervals.values() if a <= t < b or
                   a == b == t) for t in range(30))
    assert count <= max(most, 1)
    for m, (a, b) in intervals.items():
      for n, (c, d) in intervals.items():
        if m < n and slots[m] == slots[n]:
          assert b <= c or d <= a, (m, n, intervals, slots)


@pytest.mark.parametrize('name,k,m,slots', [
    ('gpipe', 2, 8, 8),  # Every micro-batch's input is kept until its B.
    ('1f1b', 2, 8, 2),  # Only those in flight: K - k on device k.
    ('1f1b', 4, 8, 4),
])
def testSlotsOfTheFirstEdge(name, k, m, slots):
  """The data buffer of edge 1 (chunk 0 -> 1): a slot per micro-batch in
  flight between chunk 0's forward and chunk 1's backward."""
  step = _Lowered(schedule.BuildTable(name, k, m))
  assert step.Size('data', 1) == slots
  assert step.buffers['data', 1].device == 1  # With its reader.
  assert step.buffers['grad', 1].device == 0  # With its writer.


def testTransfersOfAGPipeStep():
  """Every edge between chunks moves each micro-batch forward and back,
  from the producer's device at the producer's tick."""
  table = schedule.BuildTable('gpipe', 3, 4)
  step = _Lowered(table)
  assert len(step.transfers) == 2 * 2 * 4  # 2 edges, 2 ways, M = 4.
  for t in step.transfers:
    edge = step.edges[t.edge]
    producer = (schedule.Action(F, edge.source, t.micro_batch)
                if t.kind == 'data' else
                schedule.Action(B, edge.target, t.micro_batch))
    assert t.tick == table.tick_of[producer]
    assert t.source_device == table.Device(producer.chunk)
    assert t.slot == step.Slot(t.kind, t.edge, t.micro_batch)
  assert [t.tick for t in step.transfers] == sorted(
      t.tick for t in step.transfers)


def testSkipEdgesGoDeviceToDevice():
  """A skip from chunk 0 to 2 goes from device 0 to device 2 directly."""
  step = _Lowered(schedule.BuildTable('gpipe', 3, 2), skips=[(0, 2)])
  skip = len(step.edges) - 1
  assert step.edges[skip] == lowering.Edge(0, 2, True)
  moves = {(t.kind, t.source_device, t.target_device)
           for t in step.transfers if t.edge == skip}
  assert moves == {('data', 0, 2), ('grad', 2, 0)}


def testProgramsHoldEveryActionOnItsDevice():
  """Each device's program: its table actions, in tick order, with slots."""
  table = random_tables.RandomTable(random.Random(5), 3, 4, 2,
                                    loss_outside=False)
  step = _Lowered(table, remat='except_last')
  for k, program in enumerate(step.programs):
    assert [i.action for i in program] == list(table.device_orders[k])
    assert [i.tick for i in program] == sorted(i.tick for i in program)
    for i in program:
      assert i.state_slot == step.Slot('state', i.action.chunk,
                                       i.action.micro_batch)
      assert i.keeps == (not step.recomputes[i.action.chunk,
                                             i.action.micro_batch])


def testForwardTicksOfAnEvaluationStep():
  """Eval runs the table's forwards alone, in its order, on early ticks."""
  table = schedule.BuildTable('1f1b', 4, 8)
  ticks = lowering.ForwardTicks(table)
  assert len(ticks) == 8 + 4 - 1  # GPipe's forward: no gap.
  for k in range(4):
    assert [t[k] for t in ticks if t[k]] == [
        a for a in table.device_orders[k] if a.phase == F]
  step = _Lowered(table, training=False)
  assert [name for name, _ in step.phases] == ['forward']
  assert 'state' not in {kind for kind, _ in step.buffers}


def testPassesFollowTheLossPlacement():
  gpipe = _Lowered(schedule.BuildTable('gpipe', 2, 4))
  assert [(n, len(r)) for n, r in gpipe.phases] == [('forward', 5),
                                                    ('backward', 5)]
  one_f_one_b = _Lowered(schedule.BuildTable('1f1b', 2, 4))
  assert [n for n, _ in one_f_one_b.phases] == ['step']


def testChannelOrderOfTheBuiltInTables():
  """Every edge's reader takes micro-batches in its writer's order."""
  runs = {'gpipe': (1, 2), '1f1b': (1, 2), 'zb1p': (1,), 'zbv': (2,)}
  assert set(runs) == set(schedule.SCHEDULES)
  for name, virtual_stages in runs.items():
    for k, v in ((2, 1), (4, 1), (2, 2), (4, 2)):
      if v in virtual_stages:
        table = schedule.BuildTable(name, k, 8, v)
        assert _Lowered(table).ChannelOrderHolds(), (name, k, v)


def testChannelOrderHoldsForAFifoBackward():
  """FIFO backward: gradients are sent and read in one (forward) order."""
  step = _Lowered(random_tables.FifoBackwardTable(2, 2))
  assert step.ChannelOrderHolds()
  assert not lowering.BackwardReversesForward(step.table, 0)


def testChannelOrderRejectsReorderedMicroBatches():
  """Chunk 1 takes micro-batch 1 before 0: a channel would swap them."""
  orders = [
      [schedule.Action(F, 0, 0), schedule.Action(F, 0, 1),
       schedule.Action(B, 0, 0), schedule.Action(B, 0, 1)],
      [schedule.Action(F, 1, 1), schedule.Action(F, 1, 0),
       schedule.Action(B, 1, 0), schedule.Action(B, 1, 1)],
  ]
  table = schedule.TableFromOrders('custom', num_devices=2,
                                   num_micro_batches=2, virtual_stages=1,
                                   loss_outside=True, orders=orders)
  assert not _Lowered(table).ChannelOrderHolds()


def testLockstepRowsOfAGPipePass():
  """Fill, full, drain: in the full segment no device idles; rows give each
  device's micro-batch and the slots its instruction uses."""
  step = _Lowered(schedule.BuildTable('gpipe', 2, 4))
  forward = step.phases[0][1]
  segments = rows.LockstepSegments(step, forward)
  assert [s.idles for s in segments] == [[False, True], [False, False],
                                         [True, False]]
  full = segments[1]
  micro = [[row[full.hosted[k].index('micro_batch')] for row in full.rows[k]]
           for k in range(2)]
  assert micro == [[1, 2, 3], [0, 1, 2]]
  # Device 1 reads edge 1 at the slot device 0 wrote a tick earlier.
  reads = [row[full.hosted[1].index(('data_read', 1))]
           for row in full.rows[1]]
  assert reads == [step.Slot('data', 1, m) for m in (0, 1, 2)]


def testDeviceRowsFollowTheProgram():
  step = _Lowered(schedule.BuildTable('1f1b', 2, 4), remat='never')
  choices, fields, device_rows = rows.DeviceRows(step, 0, step.phases[0][1])
  assert choices == [(F, 0, True), (B, 0, True)]
  branch = fields.index('branch')
  assert [choices[r[branch]][0][0] for r in device_rows] == [
      a.phase[0] for a in step.table.device_orders[0]]


def testCustomPlacementIsLowered():
  """A V-shaped placement: chunks 0 and 3 on device 0, 1 and 2 on 1."""
  rng = random.Random(1)
  table = random_tables.RandomTable(rng, 2, 3, 2, loss_outside=True,
                                    placement=(0, 1, 1, 0))
  step = _Lowered(table)
  assert step.buffers['data', 3].device == 0  # Edge 2 -> 3: chunk 3's.
  for t in step.transfers:
    edge = step.edges[t.edge]
    assert t.source_device == table.placement[
        edge.source if t.kind == 'data' else edge.target]
