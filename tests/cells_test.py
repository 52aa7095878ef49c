"""Tests of lingvo_gpipe.cells: Lingvo cells as stage functions."""

from lingvo import compat as tf
from lingvo.core import layers
from lingvo.core import py_utils

from lingvo_gpipe import cells
from lingvo_gpipe.planning import config


def testMicroBatchSeedsReplaceTheGlobalStepByTheMicroBatchId():
  """Seeds [micro-batch id, step seed] plus the layer's and the op's seed."""
  original = py_utils.GenerateStepSeedPair
  with tf.Graph().as_default():
    p = layers.FCLayer.Params().Set(random_seed=10)
    with tf.compat.v1.Session() as session:
      with cells.MicroBatchSeeds(tf.constant(7, tf.int64)):
        assert py_utils.GenerateStepSeedPair is not original
        seeds = py_utils.GenerateStepSeedPair(p, op_seed=100)
      first, = session.run([seeds])
  assert py_utils.GenerateStepSeedPair is original
  assert first[0] == 7 + 10 + 100


def testSkipValuesRouteTheSkipsThatCrossChunks():
  # Cells 0..5 in chunks [0 1] [2 3] [4 5]: skip 0 stays in chunk 0, skip 1
  # goes from chunk 0 to 2, skip 2 from chunk 1 to the output.
  skip_cells = [(0, 1), (0, 4), (2, None)]
  values = cells.SkipValues(config.ChunkSkips(skip_cells, [2, 2, 2]))
  assert [values.Outgoing(c) for c in range(3)] == [[1], [2], []]
  assert [values.Incoming(c) for c in range(3)] == [[], [], [1]]
  assert values.ToOutput() == [2]
