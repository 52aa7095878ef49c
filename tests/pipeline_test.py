"""The engine on plain TensorFlow stage functions (no Lingvo)."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.engine import pipeline
import engine_util

RNG = np.random.RandomState(1)
WEIGHTS = [RNG.randn(6, 6).astype(np.float32) * 0.5 for _ in range(4)]
X = RNG.randn(8, 6).astype(np.float32)


def DenseStage(theta, inputs, state, micro_batch_id):
  """tanh layers; counts its calls and sums an auxiliary loss in `state`."""
  del micro_batch_id
  x, mask = inputs
  for w in theta:
    x = tf.tanh(tf.matmul(x, w))
  new_state = {'calls': state['calls'] + 1,
               'aux': state['aux'] + tf.reduce_mean(x)}
  return (x, mask), new_state


def Plain(weights, x):
  for w in weights:
    x = tf.tanh(tf.matmul(x, w))
  return x


def Piped(weights, x, k, m, remat, devices, engine):
  per = len(weights) // k
  pipe = pipeline.Pipeline([DenseStage] * k, devices[:k], m, remat=remat,
                           engine=engine)
  states = [{'calls': tf.constant(0), 'aux': tf.constant(0.0)}] * k
  (y, mask), states = pipe([weights[i * per:(i + 1) * per] for i in range(k)],
                           [x, None], states)
  assert mask is None
  return y, states


def Loss(y, aux):
  return tf.reduce_sum(y * y) + 3.0 * aux


def testTransparentInGraphAllRematModes(engine):
  for k in (1, 2, 4):
    for m in (1, 2, 4, 8):
      for remat in pipeline.RematModes(engine):
        graph = tf.Graph()
        with graph.as_default():
          ws = [tf.constant(w) for w in WEIGHTS]
          x = tf.constant(X)
          y0 = Plain(ws, x)
          # The aux state of the last stage sums mean(y) over micro-batches.
          aux0 = tf.add_n([tf.reduce_mean(p) for p in tf.split(y0, m)])
          g0 = tf.gradients(Loss(y0, aux0), ws + [x])
          y1, states = Piped(ws, x, k, m, remat, engine_util.CPUS, engine)
          g1 = tf.gradients(Loss(y1, states[-1]['aux']), ws + [x])
          calls = [s['calls'] for s in states]
          with tf.compat.v1.Session(
              graph=graph, config=engine_util.SessionConfig()) as sess:
            expected, actual, calls = sess.run([[y0] + g0, [y1] + g1, calls])
        engine_util.AssertTransparent(actual, expected)
        assert calls == [m] * k, (k, m, remat, calls)


@pytest.mark.parametrize('jit_compile', [False, True])
def testTransparentInFunction(jit_compile, engine):
  ws = [tf.constant(w) for w in WEIGHTS]
  x = tf.constant(X)

  @tf.function(jit_compile=jit_compile, autograph=False)
  def Step(k, m, remat):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(ws + [x])
      y0 = Plain(ws, x)
      loss0 = tf.reduce_sum(y0 * y0)
      y1, _ = Piped(ws, x, k, m, remat, [''] * 4, engine)
      loss1 = tf.reduce_sum(y1 * y1)
    return ([y0] + tape.gradient(loss0, ws + [x]),
            [y1] + tape.gradient(loss1, ws + [x]))

  for k, m, remat in [(1, 1, 'always'), (2, 4, 'always'),
                      (4, 8, 'except_last'), (4, 2, 'never')]:
    if remat not in pipeline.RematModes(engine):
      continue
    expected, actual = Step(k, m, remat)
    engine_util.AssertTransparent([a.numpy() for a in actual],
                                [e.numpy() for e in expected])


def testMicroBatchIdsAreStepTimesMPlusIndexInOrder(engine):

  def Stage(theta, inputs, state, micro_batch_id):
    del theta
    return inputs, state * 100 + micro_batch_id

  pipe = pipeline.Pipeline([Stage, Stage], ['', ''], num_micro_batches=3,
                           engine=engine)
  zero = tf.constant(0, tf.int64)
  _, states = pipe([[], []], [tf.zeros([6, 1])], [zero, zero],
                   step=tf.constant(5))
  assert [int(s) for s in states] == [151617, 151617]


def testCapturedTrainableVariableIsRejected(engine):
  v = tf.Variable(1.0)

  def Stage(theta, inputs, state, micro_batch_id):
    del theta, micro_batch_id
    return (inputs[0] * v,), state

  with pytest.raises(ValueError, match='reads trainable variables'):
    pipeline.Pipeline([Stage], [''], 2, engine=engine)([[]],
                                                        [tf.ones([4, 1])])


@pytest.mark.parametrize('kwargs,message', [
    (dict(stage_fns=[], devices=[]), 'stage_fns is empty'),
    (dict(devices=['', '']), 'devices has 2 entries'),
    (dict(num_micro_batches=0), 'num_micro_batches=0 must be a positive int'),
    (dict(remat='sometimes'), "remat='sometimes' is not supported"),
    (dict(batch_dim=-1), 'batch_dim=-1'),
    (dict(engine='fast'), "engine='fast' is not supported"),
    (dict(engine='loop', remat='never'),
     "remat='never' is not supported with engine='loop'"),
    (dict(engine='loop', remat='except_last'),
     "remat='except_last' is not supported with engine='loop'"),
])
def testBadConfiguration(kwargs, message):
  args = dict(stage_fns=[DenseStage], devices=[''], num_micro_batches=1)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    pipeline.Pipeline(**args)


def testIndivisibleBatchFailsBeforeBuilding(engine):
  pipe = pipeline.Pipeline([DenseStage], [''], num_micro_batches=3,
                           engine=engine)
  graph = tf.Graph()
  with graph.as_default():
    x = tf.zeros([8, 6])
    num_ops = len(graph.get_operations())
    with pytest.raises(ValueError, match='does not divide the batch size 8'):
      pipe([[]], [x, None])
    assert len(graph.get_operations()) == num_ops


def _HloLines(engine, num_micro_batches):
  """Lines of the XLA HLO of a K=4 training step's gradients."""
  ws = [tf.constant(w) for w in WEIGHTS]
  x = tf.constant(np.tile(X, [4, 1]))  # Batch 32: M up to 32.

  @tf.function(jit_compile=True, autograph=False)
  def Step():
    with tf.GradientTape() as tape:
      tape.watch(ws)
      y, states = Piped(ws, x, 4, num_micro_batches, 'always', [''] * 4,
                        engine)
      loss = Loss(y, states[-1]['aux'])
    return tape.gradient(loss, ws)

  return len(Step.experimental_get_compiler_ir()(stage='hlo').splitlines())


def testLoopGraphDoesNotGrowWithM():
  """The loop engine's compiled step is the same size for M = 4 and 32."""
  loop = [_HloLines('loop', m) for m in (4, 32)]
  unrolled = [_HloLines('unrolled', m) for m in (4, 32)]
  assert loop[0] == loop[1], loop
  assert unrolled[1] > 5 * unrolled[0], unrolled  # K x M calls.
  assert loop[1] < unrolled[1], (loop, unrolled)
