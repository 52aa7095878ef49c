"""The engine on plain TensorFlow stage functions (no Lingvo)."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.engine import pipeline
from lingvo_gpipe.planning import schedule
import engine_util

WEIGHTS, X = engine_util.DENSE_WEIGHTS, engine_util.DENSE_X
DenseStage, Plain, Piped, Loss = (engine_util.DenseStage, engine_util.Plain,
                                  engine_util.Piped, engine_util.Loss)


def _CheckTransparentInGraph(engine, k, virtual_stages, micro_batches):
  for m in micro_batches:
    for remat in schedule.REMAT_MODES:
      graph = tf.Graph()
      with graph.as_default():
        ws = [tf.constant(w) for w in WEIGHTS]
        x = tf.constant(X)
        y0 = Plain(ws, x)
        # The aux state of the last chunk sums mean(y) over micro-batches.
        aux0 = tf.add_n([tf.reduce_mean(p) for p in tf.split(y0, m)])
        g0 = tf.gradients(Loss(y0, aux0), ws + [x])
        y1, states = Piped(ws, x, k, m, remat, engine_util.CPUS, engine,
                           virtual_stages)
        g1 = tf.gradients(Loss(y1, states[-1]['aux']), ws + [x])
        with tf.compat.v1.Session(
            graph=graph, config=engine_util.SessionConfig()) as sess:
          expected, actual, calls = sess.run(
              [[y0] + g0, [y1] + g1, [s['calls'] for s in states]])
      engine_util.AssertTransparent(actual, expected)
      assert calls == [m] * k * virtual_stages  # Each chunk, each micro-batch.


# M per K: fewer micro-batches than devices, as many, and more (M = 2 and
# M = 4 above K run the same schedule shape; one of them is kept).
MICRO_BATCHES_PER_K = {1: (1, 8), 2: (1, 2, 4), 4: (2, 4, 8)}


def testTransparentInGraphAllRematModes(engine):
  for k in (1, 2, 4):
    _CheckTransparentInGraph(engine, k, 1, MICRO_BATCHES_PER_K[k])


@pytest.mark.parametrize('k,v', [(1, 4), (2, 2)])
def testCircularTransparentInGraphAllRematModes(engine, k, v):
  """4 layers as K v chunks, chunk c on device c % K, every remat mode.

  (K=1, v=2 runs in layers_test.py's circular grid.)
  """
  _CheckTransparentInGraph(engine, k, v, MICRO_BATCHES_PER_K[k])


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


# Schedules with the loss inside the pipeline (1F1B).


def LossStage(theta, inputs, state, micro_batch_id):
  """DenseStage, then the micro-batch's loss and a metric (scalars)."""
  (y, _), state = DenseStage(theta, inputs, state, micro_batch_id)
  return (tf.reduce_mean(y * y), tf.reduce_max(y)), state


def _LossPiped(weights, x, k, m, remat, v=1, input_gradients=(True, False)):
  """The loss and metric means of a 1F1B pipeline over the weights."""
  chunks = k * v
  per = len(weights) // chunks
  pipe = pipeline.Pipeline([DenseStage] * (chunks - 1) + [LossStage],
                           engine_util.CPUS[:k], m, remat=remat,
                           engine='loop', schedule='1f1b', virtual_stages=v)
  states = [{'calls': tf.constant(0), 'aux': tf.constant(0.0)}] * chunks
  (loss, metric), states = pipe(
      [weights[i * per:(i + 1) * per] for i in range(chunks)], [x, None],
      states,
      input_gradients=None if input_gradients is None else
      list(input_gradients))
  return loss, metric, states


def _LossPlain(weights, x, m):
  parts = [Plain(weights, p) for p in tf.split(x, m)]
  return (tf.add_n([tf.reduce_mean(y * y) for y in parts]) / m,
          tf.add_n([tf.reduce_max(y) for y in parts]) / m)


X32 = np.tile(X, [4, 1])


@pytest.mark.parametrize('k,v', [(1, 1), (2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize('remat', ['always', 'never'])
def testOneFOneBLossAndGradientsAreTheMeanLoss(k, v, remat):
  """1F1B: loss, metric and every gradient of the mean loss, vs plain.

  K in {1, 2, 4} x M in {1, 4, 8, 32} and interleaved (K = v = 2, M a
  multiple of K), in both remat modes that matter (recompute, or stash the
  activations between a call's forward and backward ticks).

  Args:
    k: K.
    v: Virtual stages.
    remat: The remat mode.
  """
  for m in (1, 4, 8, 32):
    if v > 1 and m % k:
      continue
    graph = tf.Graph()
    with graph.as_default():
      ws = [tf.constant(w) for w in WEIGHTS]
      x = tf.constant(X32)
      loss0, metric0 = _LossPlain(ws, x, m)
      g0 = tf.gradients(loss0, ws + [x])
      loss1, metric1, states = _LossPiped(ws, x, k, m, remat, v)
      g1 = tf.gradients(3.0 * loss1, ws + [x])  # The upstream gradient: 3.
      with tf.compat.v1.Session(graph=graph,
                                config=engine_util.SessionConfig()) as sess:
        expected, actual, calls = sess.run(
            [[loss0, metric0] + [3.0 * g for g in g0],
             [loss1, metric1] + g1, [s['calls'] for s in states]])
    engine_util.AssertTransparent(actual, expected)
    assert calls == [m] * k * v


def testOneFOneBInFunctionAndXla():
  ws = [tf.constant(w) for w in WEIGHTS]
  x = tf.constant(X32)
  for jit_compile in (False, True):

    @tf.function(jit_compile=jit_compile, autograph=False)
    def Step():
      with tf.GradientTape(persistent=True) as tape:
        tape.watch(ws + [x])
        loss0, _ = _LossPlain(ws, x, 8)
        loss1, _, _ = _LossPiped(ws, x, 2, 8, 'never')
      return ([loss0] + tape.gradient(loss0, ws + [x]),
              [loss1] + tape.gradient(loss1, ws + [x]))

    expected, actual = Step()
    engine_util.AssertTransparent([a.numpy() for a in actual],
                                  [e.numpy() for e in expected])


def testOneFOneBComputesTheInputGradientsThatCanBeAskedFor():
  """With the loss inside, the default input gradients are TensorFlow's.

  TF1: an input fed by a variable or a placeholder gets its gradient, one
  made of constants none; a tape: the inputs it watches. The unwatched input
  leaves no gradient buffer in the loop.
  """
  def Piped(ws, x):
    return _LossPiped(ws, x, 2, 4, 'never', input_gradients=None)[0]

  with tf.Graph().as_default() as graph:
    ws = [tf.constant(w) for w in WEIGHTS]
    fed = {
        'placeholder': tf.compat.v1.placeholder_with_default(X32, X32.shape),
        'variable': tf.Variable(X32) * 1.0,
    }
    grads = {name: tf.gradients(Piped(ws, x), [x])[0]
             for name, x in fed.items()}
    expected = {name: tf.gradients(_LossPlain(ws, x, 4)[0], [x])[0]
                for name, x in fed.items()}
    constant = tf.constant(X32)
    assert tf.gradients(Piped(ws, constant), [constant]) == [None]
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      actual, wanted = sess.run([grads, expected])
  for name in fed:
    engine_util.AssertTransparent(actual[name], wanted[name])

  loop_vars = {}

  def Traced(watch):
    """Traces a step under a tape; returns the input's gradient."""

    @tf.function(autograph=False)
    def Step():
      ws = [tf.constant(w) for w in WEIGHTS]
      x = tf.constant(X32)
      with tf.GradientTape() as tape:
        if watch:
          tape.watch(x)
        loss = Piped(ws, x)
      loop_vars[watch] = max(
          len(op.inputs) for op in tf.compat.v1.get_default_graph()
          .get_operations() if op.type in ('While', 'StatelessWhile'))
      return tape.gradient(loss, x)

    return Step.get_concrete_function().structured_outputs

  assert Traced(True) is not None
  assert Traced(False) is None
  # Without the input's gradient buffer, and the gradient chunk 0 sends.
  assert loop_vars[False] == loop_vars[True] - 2


def testBadInputGradientsAreAnError():
  pipe = pipeline.Pipeline([DenseStage, LossStage], engine_util.CPUS[:2], 2,
                           engine='loop', schedule='1f1b')
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"input_gradients=\[1\] must be 2 "
                       'bools, one per input'):
      pipe([[tf.constant(WEIGHTS[0])], []], [tf.constant(X32), None],
           input_gradients=[1])


def testOneFOneBGradientThroughAMetricIsAnError():
  with tf.Graph().as_default():
    ws = [tf.constant(w) for w in WEIGHTS]
    loss, metric, states = _LossPiped(ws, tf.constant(X32), 2, 4, 'always')
    tf.gradients(loss, ws)  # Fine.
    with pytest.raises(ValueError, match='other than its first'):
      tf.gradients(loss + metric, ws)
    with pytest.raises(ValueError, match='other than its first'):
      tf.gradients(loss + states[-1]['aux'], ws)


@pytest.mark.parametrize('kwargs,message', [
    (dict(engine='unrolled'), "schedule='1f1b' is not supported with "
     "engine='unrolled'"),
    (dict(virtual_stages=2, num_micro_batches=3), 'num_micro_batches=3 with '
     "schedule='1f1b' and virtual_stages=2 must be a multiple of "
     'num_stages=2'),
    (dict(schedule='zigzag'), "schedule='zigzag' is not supported"),
])
def testOneFOneBBadConfiguration(kwargs, message):
  args = dict(stage_fns=[DenseStage] * 4, devices=['', ''],
              num_micro_batches=4, engine='loop', schedule='1f1b',
              virtual_stages=2)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    pipeline.Pipeline(**args)


def testOneFOneBLastCellMustReturnScalars():
  pipe = pipeline.Pipeline([DenseStage] * 2, ['', ''], 2, engine='loop',
                           schedule='1f1b')
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match='needs a last cell that returns '
                       'scalars'):
      pipe([WEIGHTS[:2], WEIGHTS[2:]], [tf.constant(X), None],
           [{'calls': tf.constant(0), 'aux': tf.constant(0.0)}] * 2)


# Skip connections.

SKIP_WIDTH = 7  # Skip tensors are [batch, 7]: told apart from the rest (6).


def _SkipStage(c, skips, loss=False):
  """Chunk c: adds its incoming skips, a tanh layer, emits its skips."""
  outgoing = [s for s, (a, _) in enumerate(skips) if a == c]

  def Stage(theta, inputs, state, micro_batch_id):
    del micro_batch_id
    x, extra = inputs[0], inputs[1:]
    for (t,) in extra:
      x = x + tf.reduce_sum(t, -1, keepdims=True)
    x = tf.tanh(tf.matmul(x, theta[0]))
    sent = tuple((tf.tile(x[:, :1], [1, SKIP_WIDTH]) * (s + 2.0),)
                 for s in outgoing)
    if loss:
      return (tf.reduce_mean(x * x),) + sent, state
    return (x,) + sent, state

  return Stage


def _SkipPlain(weights, x, skips):
  """The same chunks run in order on the whole batch."""
  sent, extra_outputs = {}, []
  for c, w in enumerate(weights):
    for s, (_, b) in enumerate(skips):
      if b == c:
        x = x + tf.reduce_sum(sent[s], -1, keepdims=True)
    x = tf.tanh(tf.matmul(x, w))
    for s, (a, b) in enumerate(skips):
      if a == c:
        sent[s] = tf.tile(x[:, :1], [1, SKIP_WIDTH]) * (s + 2.0)
        if b is None:
          extra_outputs.append(sent[s])
  return x, extra_outputs


SKIPS = [(0, 2), (1, 3), (0, None), (0, 3)]


@pytest.mark.parametrize('k,v', [(1, 4), (2, 2), (4, 1)])
def testSkipsAreTransparent(engine, k, v):
  """4 chunks with skips 0->2, 1->3, 0->output, 0->3 vs the plain chunks."""
  for m in sorted({1, 2 * k}):
    for remat in ('always', 'never'):
      graph = tf.Graph()
      with graph.as_default():
        ws = [tf.constant(w) for w in WEIGHTS]
        x = tf.constant(X)
        y0, extra0 = _SkipPlain(ws, x, SKIPS)
        loss0 = tf.reduce_sum(y0 * y0) + tf.reduce_sum(extra0[0])
        pipe = pipeline.Pipeline(
            [_SkipStage(c, SKIPS) for c in range(4)],
            engine_util.CPUS[:k], m, remat=remat, engine=engine,
            virtual_stages=v, skips=SKIPS)
        (y1, extra1), _ = pipe([[w] for w in ws], [x])
        loss1 = tf.reduce_sum(y1 * y1) + tf.reduce_sum(extra1)
        fetches = [[y0, extra0[0]] + tf.gradients(loss0, ws + [x]),
                   [y1, extra1] + tf.gradients(loss1, ws + [x])]
        with tf.compat.v1.Session(graph=graph,
                                  config=engine_util.SessionConfig()) as sess:
          expected, actual = sess.run(fetches)
      engine_util.AssertTransparent(actual, expected)


@pytest.mark.parametrize('v', [1, 2])
def testSkipsWithTheLossInside(v):
  skips = [(0, 2), (1, 3), (0, 3)]
  for m in (1, 4, 8) if v == 1 else (2, 4, 8):
    for remat in ('always', 'never'):
      graph = tf.Graph()
      with graph.as_default():
        ws = [tf.constant(w) for w in WEIGHTS]
        x = tf.constant(X)
        parts = [_SkipPlain(ws, p, skips)[0] for p in tf.split(x, m)]
        loss0 = tf.add_n([tf.reduce_mean(y * y) for y in parts]) / m
        pipe = pipeline.Pipeline(
            [_SkipStage(c, skips, loss=c == 3) for c in range(4)],
            engine_util.CPUS[:4 // v], m, remat=remat, engine='loop',
            schedule='1f1b', virtual_stages=v, skips=skips)
        (loss1,), _ = pipe([[w] for w in ws], [x], input_gradients=[True])
        fetches = [[loss0] + tf.gradients(loss0, ws + [x]),
                   [loss1] + tf.gradients(loss1, ws + [x])]
        with tf.compat.v1.Session(graph=graph,
                                  config=engine_util.SessionConfig()) as sess:
          expected, actual = sess.run(fetches)
      engine_util.AssertTransparent(actual, expected)


def testSkippedTensorsGoStraightToTheirTarget(engine):
  """K = 4, skip 0 -> 3: no op of devices 1 and 2 touches a skip tensor.

  Skip tensors are the only ones of width SKIP_WIDTH. Unrolled: no graph op
  placed on CPU:1 or CPU:2 reads or writes one, forward or backward. Loop
  (one loop per device, lowered: its links are FIFO queues on the receiving
  device): the skip's tensors travel in one queue on CPU:3 and their
  gradients in one on CPU:0, and no other queue carries that width.

  Args:
    engine: The pipeline engine.
  """
  skips = [(0, 3)]
  graph = tf.Graph()
  with graph.as_default(), engine_util.ObservableLoops(engine):
    ws = [tf.constant(w) for w in WEIGHTS]
    pipe = pipeline.Pipeline([_SkipStage(c, skips) for c in range(4)],
                             engine_util.CPUS, 4, engine=engine, skips=skips)
    (y,), _ = pipe([[w] for w in ws], [tf.constant(X)])
    tf.gradients(tf.reduce_sum(y * y), ws)
  touched = collections.defaultdict(int)
  if engine == 'loop':
    for op in graph.get_operations():
      if op.type == 'FIFOQueueV2' and any(
          s.dim and s.dim[-1].size == SKIP_WIDTH
          for s in op.get_attr('shapes')):
        touched[op.device.split(':')[-1]] += 1
    assert dict(touched) == {'0': 1, '3': 1}
    return
  for op in graph.get_operations():
    for t in list(op.inputs) + list(op.outputs):
      if t.shape.rank and t.shape[-1] == SKIP_WIDTH:
        touched[op.device.split(':')[-1]] += 1
  assert touched['0'] and touched['3']  # The skip exists and is used.
  assert not touched['1'] and not touched['2'], dict(touched)


@pytest.mark.parametrize('skips,message', [
    ([(2, 1)], r'\(2, 1\) must go from a chunk in \[0, 4\) to a later chunk'),
    ([(1, 1)], r'\(1, 1\) must go'),
    ([(0, 4)], r'\(0, 4\) must go'),
    ([(0,)], r'\(0,\) is not a \(source chunk, target chunk or None\) pair'),
])
def testBadSkips(skips, message):
  with pytest.raises(ValueError, match=message):
    pipeline.Pipeline([DenseStage] * 4, [''] * 4, 2, skips=skips)
