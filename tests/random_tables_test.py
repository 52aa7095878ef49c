"""Tests of random_tables: random valid schedule tables, and FIFO backward."""

import collections
import random

import pytest

from lingvo_gpipe.planning import schedule
import random_tables

F, B = schedule.FORWARD, schedule.BACKWARD
A = schedule.Action
SEEDS = range(20)


def _Actions(table):
  """Every action of the table, in tick order."""
  return [a for tick in table.ticks for a in tick if a is not None]


@pytest.mark.parametrize('k', [1, 2, 3, 4])
@pytest.mark.parametrize('v', [1, 2])
def testRandomTablesAreValidWithEveryActionOnce(k, v):
  for m in range(1, 7):
    everything = sorted(A(phase, c, i) for phase in (F, B)
                        for c in range(k * v) for i in range(m))
    for loss_outside in (True, False):
      for seed in SEEDS:
        rng = random.Random(seed)
        drawn = random_tables.RandomPlacement(random.Random(seed), k, v)
        table = random_tables.RandomTable(rng, k, m, v, loss_outside)
        assert schedule.Validate(table) is table
        assert sorted(_Actions(table)) == everything
        assert table.placement == drawn
        assert collections.Counter(drawn) == {d: v for d in range(k)}
        assert (table.num_devices, table.num_micro_batches,
                table.virtual_stages, table.loss_outside) == (k, m, v,
                                                              loss_outside)


def testRandomTableKeepsAGivenPlacement():
  v_shape = (0, 1, 2, 2, 1, 0)
  for seed in SEEDS:
    table = random_tables.RandomTable(random.Random(seed), 3, 4, 2, True,
                                      placement=v_shape)
    assert table.placement == v_shape
    assert all(table.Device(a.chunk) == k for k, order in enumerate(
        table.device_orders) for a in order)


def testRandomTablesDifferAcrossSeedsAndRepeatForOne():
  tables = [random_tables.RandomTable(random.Random(seed), 2, 3, 2, False)
            for seed in range(20)]
  assert len({t.placement for t in tables}) > 1
  assert len({t.device_orders for t in tables}) > 10
  # Orders differ for one placement too, not only through it.
  fixed = {random_tables.RandomTable(random.Random(seed), 2, 3, 2, True,
                                     placement=(0, 1, 1, 0)).device_orders
           for seed in range(20)}
  assert len(fixed) > 10
  again = random_tables.RandomTable(random.Random(7), 2, 3, 2, False)
  assert again == tables[7]


def testNeedsStatesTheRulesOfValidate():
  assert random_tables.Needs(A(F, 0, 1), 4, 2, True) == []
  assert random_tables.Needs(A(F, 2, 1), 4, 2, True) == [A(F, 1, 1)]
  assert random_tables.Needs(A(B, 2, 1), 4, 2, False) == [A(F, 2, 1),
                                                          A(B, 3, 1)]
  assert random_tables.Needs(A(B, 3, 1), 4, 2, False) == [A(F, 3, 1)]
  assert random_tables.Needs(A(B, 3, 1), 4, 2, True) == [A(F, 3, 1),
                                                         A(F, 3, 0)]


def testFifoBackwardTable():
  table = random_tables.FifoBackwardTable(2, 2)
  assert str(table).splitlines() == [
      'fifo: K=2 v=1 M=2, 6 ticks',
      'device 0: F0.0 F0.1    -    - B0.0 B0.1',
      'device 1:    - F1.0 F1.1 B1.0 B1.1    -']
  table = random_tables.FifoBackwardTable(3, 4)
  assert table.loss_outside
  for k, order in enumerate(table.device_orders):
    assert order == tuple(A(F, k, m) for m in range(4)) + tuple(
        A(B, k, m) for m in range(4))
