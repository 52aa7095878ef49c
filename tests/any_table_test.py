"""Property test: every valid table runs on the loop engine, transparently.

Random valid tables (`random_tables.RandomTable`: a random topological order
of the step's actions, random chunk placements, K <= 4, v <= 2, M <= 6, the
loss inside or outside, a random remat mode), seeded, each run as a
pipeline of one tanh layer per chunk and checked against the same layers
without a pipeline: outputs, the loss, the gradients of the weights and the
input.
"""

import random

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.engine import pipeline
from lingvo_gpipe.planning import lowering
from lingvo_gpipe.planning import schedule
import engine_util
import random_tables

SEED = 20261207
NUM_TABLES = 24
MICRO_BATCH_SIZE = 2
DIM = 6


def _Draws():
  """(table, remat) pairs, the same on every run."""
  rng = random.Random(SEED)
  draws = []
  for _ in range(NUM_TABLES):
    k, v, m = rng.randint(1, 4), rng.randint(1, 2), rng.randint(1, 6)
    loss_outside = rng.random() < 0.5
    remat = rng.choice(schedule.REMAT_MODES)
    draws.append((random_tables.RandomTable(rng, k, m, v, loss_outside),
                  remat))
  return draws


DRAWS = _Draws()


def _Weights(num_chunks, seed):
  rng = np.random.RandomState(seed)
  return [rng.randn(DIM, DIM).astype(np.float32) * 0.6
          for _ in range(num_chunks)]


def _Chunk(theta, inputs, state, micro_batch_id):
  del micro_batch_id
  (x,) = inputs
  return (tf.tanh(tf.matmul(x, theta)),), {'calls': state['calls'] + 1}


def _LossChunk(theta, inputs, state, micro_batch_id):
  (y,), state = _Chunk(theta, inputs, state, micro_batch_id)
  return (tf.reduce_mean(y * y),), state


def _Step(table, remat, weights, x, executor='auto'):
  """(loss, outputs or None, gradients of weights and x, final calls)."""
  num_chunks = table.num_chunks
  fns = [_Chunk] * (num_chunks - 1) + [
      _Chunk if table.loss_outside else _LossChunk]
  pipe = pipeline.Pipeline(
      fns, engine_util.CPUS[:table.num_devices], table.num_micro_batches,
      remat=remat, engine='loop', schedule=table,
      virtual_stages=table.virtual_stages, executor=executor)
  with tf.GradientTape() as tape:
    tape.watch(weights + [x])
    (y,), states = pipe(weights, [x],
                        [{'calls': tf.constant(0)}] * num_chunks)
    loss = tf.reduce_mean(y * y) if table.loss_outside else y
  grads = tape.gradient(loss, weights + [x])
  return (loss, y if table.loss_outside else None, grads,
          [s['calls'] for s in states])


def _Plain(weights, x):
  y = x
  for w in weights:
    y = tf.tanh(tf.matmul(y, w))
  with tf.GradientTape() as tape:
    tape.watch(weights + [x])
    y = x
    for w in weights:
      y = tf.tanh(tf.matmul(y, w))
    loss = tf.reduce_mean(y * y)
  return loss, y, tape.gradient(loss, weights + [x])


def _CheckTransparent(piped, plain, table):
  loss, y, grads, calls = piped
  plain_loss, plain_y, plain_grads = plain
  engine_util.AssertTransparent([loss] + list(grads),
                                [plain_loss] + list(plain_grads), tol=1e-5)
  if y is not None:
    engine_util.AssertTransparent([y], [plain_y], tol=1e-5)
  assert list(calls) == [table.num_micro_batches] * table.num_chunks


def testTheDrawsCoverTheShapes():
  """The seeded draws span K, v, M, both loss placements, every remat mode,
  placements other than c mod K, and tables the per-device executor cannot
  run (an edge read out of send order)."""
  tables = [t for t, _ in DRAWS]
  assert {t.num_devices for t in tables} == {1, 2, 3, 4}
  assert {t.virtual_stages for t in tables} == {1, 2}
  assert {t.loss_outside for t in tables} == {True, False}
  assert {r for _, r in DRAWS} == set(schedule.REMAT_MODES)
  assert max(t.num_micro_batches for t in tables) == 6
  assert any(t.placement != schedule.DefaultPlacement(t.num_devices,
                                                      t.virtual_stages)
             for t in tables)
  assert any(not lowering.Lower(t, lowering.Edges(t.num_chunks, ()), 'always',
                                True).ChannelOrderHolds() for t in tables)


@pytest.mark.parametrize('i', range(NUM_TABLES))
def testRandomTableIsTransparent(i):
  """Lockstep loops inside a tf.function, as Keras and TF2 trainers run."""
  table, remat = DRAWS[i]
  weights = [tf.constant(w) for w in _Weights(table.num_chunks, i)]
  x = tf.constant(np.random.RandomState(i).randn(
      table.num_micro_batches * MICRO_BATCH_SIZE, DIM).astype(np.float32))
  step = tf.function(lambda: _Step(table, remat, weights, x),
                     autograph=False)
  _CheckTransparent([_ToNumpy(t) for t in step()],
                    [_ToNumpy(t) for t in _Plain(weights, x)], table)


def _ToNumpy(value):
  return tf.nest.map_structure(
      lambda t: None if t is None else np.asarray(t), value)


def _RunGraph(table, remat, executor):
  """The step and the plain model in a TF1 graph, with the executor."""
  with tf.Graph().as_default():
    weights = [tf.constant(w) for w in _Weights(table.num_chunks, 0)]
    x = tf.constant(np.random.RandomState(0).randn(
        table.num_micro_batches * MICRO_BATCH_SIZE, DIM).astype(np.float32))
    piped = _Step(table, remat, weights, x, executor)
    plain = _Plain(weights, x)
    whiles = [op.device for op in tf.compat.v1.get_default_graph()
              .get_operations() if op.type in ('While', 'StatelessWhile')]
    with tf.compat.v1.Session(config=engine_util.SessionConfig()) as sess:
      piped, plain = sess.run([[t for t in piped if t is not None], plain])
  if table.loss_outside:
    loss, y, grads, calls = piped
  else:
    (loss, grads, calls), y = piped, None
  return (loss, y, grads, calls), plain, whiles


@pytest.mark.parametrize('remat', ['always', 'never'])
def testFifoBackwardRunsOnBothExecutors(remat):
  """K = 2, M = 2, each device's backwards in its forwards' order: the
  lockstep loops and one loop per device (a TF1 graph) both run it."""
  table = random_tables.FifoBackwardTable(2, 2)
  for executor, loops in (('lockstep', 6), ('per_device', 4)):
    piped, plain, whiles = _RunGraph(table, remat, executor)
    _CheckTransparent(piped, plain, table)
    assert len(whiles) == loops, (executor, whiles)


def testPerDeviceRefusesATableItCannotRun():
  """An edge read out of send order: 'per_device' says why; 'auto' runs
  lockstep loops."""
  table = next(t for t, _ in DRAWS
               if not lowering.Lower(t, lowering.Edges(t.num_chunks, ()),
                                     'always', True).ChannelOrderHolds())
  with pytest.raises(ValueError, match="executor='per_device' cannot run "
                     r'this step: .*order'):
    _RunGraph(table, 'always', 'per_device')
  piped, plain, _ = _RunGraph(table, 'always', 'auto')
  _CheckTransparent(piped, plain, table)


def testFifoBackwardRefusesADifferentiableState():
  """A float state's gradient flows m + 1 -> m: a FIFO backward cannot run
  it, and the error names the chunk and the reason."""
  table = random_tables.FifoBackwardTable(2, 2)

  def Summing(theta, inputs, state, micro_batch_id):
    (y,), _ = _Chunk(theta, inputs, {'calls': 0}, micro_batch_id)
    return (y,), state + tf.reduce_mean(y)

  pipe = pipeline.Pipeline([Summing] * 2, engine_util.CPUS[:2], 2,
                           engine='loop', schedule=table)
  weights = [tf.constant(w) for w in _Weights(2, 0)]
  with pytest.raises(ValueError, match='Chunk 0 carries a differentiable '
                     'state'):
    pipe(weights, [tf.ones([4, DIM])], [tf.constant(0.0)] * 2)


def testUnrolledEngineNamesWhatItCannotRun():
  table = random_tables.FifoBackwardTable(2, 2)
  with pytest.raises(ValueError, match="engine='unrolled' runs schedules"):
    pipeline.Pipeline([_Chunk] * 2, engine_util.CPUS[:2], 2,
                      engine='unrolled', schedule=table)
