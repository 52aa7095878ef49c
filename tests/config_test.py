"""Tests of planning.config: the parameters every front end takes."""

import pytest

from lingvo_gpipe.planning import config

NAMES = ['a', 'b', 'c', 'd', 'e', 'f']


def testCheckShapeCutsTheCells():
  assert config.CheckShape(NAMES, 2) == config.Shape(2, 1, [3, 3])
  assert config.CheckShape(NAMES, 2, virtual_stages=3) == config.Shape(
      2, 3, [1] * 6)
  assert config.CheckShape(NAMES, partition=[1, 2, 2, 1],
                           virtual_stages=2) == config.Shape(2, 2,
                                                             [1, 2, 2, 1])
  # None: one chunk per cell.
  assert config.CheckShape(NAMES, None).num_chunks == 6
  # A cost-based partition waits for its costs.
  assert config.CheckShape(NAMES, 3, partition='params').counts is None


@pytest.mark.parametrize('kwargs,message', [
    (dict(cell_names=[]), 'cell_tpl is empty'),
    (dict(cell_names=['a', 'a']), r"repeated: \['a'\]"),
    (dict(num_stages=4, virtual_stages=2),
     'needs 8 chunks of at least one cell, but there are 6 cells'),
    (dict(partition=[3, 3], num_stages=3),
     'has 2 entries but num_stages=3 and virtual_stages=1 make 3 chunks'),
    (dict(num_stages=2, num_micro_batches=3, virtual_stages=3,
          schedule_name='1f1b'),
     "num_micro_batches=3 with schedule='1f1b' and virtual_stages=3 must be "
     'a multiple of num_stages=2'),
    (dict(num_stages=2, skips=[('c', 'a')]), 'goes to itself or backwards'),
])
def testCheckShapeErrors(kwargs, message):
  kwargs = {'cell_names': NAMES, **kwargs}
  with pytest.raises(ValueError, match=message):
    config.CheckShape(**kwargs)


def testSkipsThatCrossChunks():
  cells = config.CheckSkips(NAMES, [('a', 'b'), ('a', 'e'), ('c', None)])
  assert cells == [(0, 1), (0, 4), (2, None)]
  # Chunks [a b] [c d] [e f]: a -> b stays in chunk 0; the others cross.
  assert config.ChunkSkips(cells, [2, 2, 2]) == config.Skips(
      cells, [(0, 2), (1, None)], [None, 0, 1])
  with pytest.raises(ValueError, match="'x' is not a cell"):
    config.CheckSkips(NAMES, [('x', 'b')])


def testNumMicroBatches():
  assert config.NumMicroBatches(8, 4, None) == 4
  assert config.NumMicroBatches(None, 4, None) == 4
  assert config.NumMicroBatches(8, 1, 2) == 4
  assert config.NumMicroBatches(8, 4, 2) == 4
  with pytest.raises(ValueError, match='their product is not the batch size'):
    config.NumMicroBatches(8, 2, 2)
  with pytest.raises(ValueError, match=r'valid values are \[1, 2, 4, 8\]'):
    config.NumMicroBatches(8, 3, None)
  with pytest.raises(ValueError, match='larger than the batch size 2'):
    config.CheckSplit(2, 4)
  assert config.ChunkCells(NAMES, [1, 3, 2]) == [['a'], ['b', 'c', 'd'],
                                                 ['e', 'f']]
