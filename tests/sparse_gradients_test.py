"""Sparse (IndexedSlices) weight gradients through every engine and schedule.

An embedding lookup's gradient is a `tf.IndexedSlices`. A call that keeps its
activations in the loop engine (remat 'never', and the kept calls of
'except_last') runs TensorFlow's own split of the call, whose backward returns
such a gradient as three tensors (values, indices, dense shape) and nothing
for an input the outputs do not depend on (a softmax cell's label weights);
the loop engine sums weight gradients densely, under XLA too. Each case
checks the loss and every gradient against the un-pipelined model (relative
error under 1e-5):

a. Lingvo's own `lingvo.tasks.lm.layers.GPipeTransformerLm` on our
   `GPipeBatchMajorTransformerStack` against the same LM on Lingvo's stack;
b. our `GPipeBatchMajorTransformerStack` (embedding, encoder, decoder,
   softmax; packed inputs) against Lingvo's;
c. a Keras `Embedding` first layer in `GPipeSequential` against
   `keras.Sequential` of the same layers;
d. one embedding read by the first and the last chunk (tied input embedding
   and output softmax) through the engine's own `pipeline.Pipeline`: its
   gradient is the sum of both uses.

The grid: d covers every engine x remat x schedule ('gpipe' and '1f1b' with
v = 1 and 2, 'zb1p' with v = 1, 'zbv' with v = 2; those with the loss inside
on the loop engine only) in a TF1 graph (the loop engine's
per-device loops); c every engine x remat x v in a tf.function (its lockstep
loops) and the loop engine's remat modes under XLA; a and b together every
engine x remat mode on Lingvo's stacks once (GPipe schedule, v = 1), and
both the loop engine without recompute outside the `slow` mark.
"""

import keras
import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import cluster_factory
from lingvo.core import layers_with_gpipe
from lingvo.core import py_utils
from lingvo.tasks.lm import layers as lm_layers

from lingvo_gpipe import checkpoints
from lingvo_gpipe import stacks
from lingvo_gpipe.engine import pipeline
from lingvo_gpipe.keras import GPipeSequential
from lingvo_gpipe.planning import schedule
import engine_util
import test_util

VOCAB, DIM, TIME, BATCH = 12, 8, 6, 8
RNG = np.random.RandomState(3)
IDS = RNG.randint(0, VOCAB, [BATCH, TIME]).astype(np.int32)
LABELS = RNG.randint(0, VOCAB, [BATCH, TIME]).astype(np.int32)
PADDINGS = np.zeros([BATCH, TIME], np.float32)
PADDINGS[:, -2:] = 1.0  # Padded ends, as in a real batch.



def _Builds(name, v):
  """Whether the schedule runs v virtual stages (zb1p 1, zbv 2)."""
  try:
    schedule.CheckScheduleSizes(name, 2, 4, v)
  except ValueError:
    return False
  return True


# Every (engine, remat, schedule, virtual_stages) a step can be built with.
GRID = [(engine, remat, name, v)
        for engine, remat in engine_util.ENGINE_REMAT_MODES
        for name in schedule.SCHEDULES for v in (1, 2)
        if _Builds(name, v) and (
            engine == 'loop' or not schedule.SCHEDULES[name].loss_inside)]


# Lingvo's stacks (a and b): Lingvo's own class, un-pipelined, is the
# reference; ours, pipelined, gets its weights (renamed, `checkpoints`).


def _LmParams(splits, num_micro_batches, engine=None, remat=None):
  """A small GPipeTransformerLm: 4 cells (embedding, 2 layers, softmax).

  Args:
    splits: Lingvo's split of the cells.
    num_micro_batches: M.
    engine: Our stack's engine, or None for Lingvo's own stack.
    remat: Our stack's remat mode.

  Returns:
    The LM's Params.
  """
  p = lm_layers.GPipeTransformerLm.CommonParams(
      vocab_size=VOCAB, model_dim=DIM, hidden_dim=2 * DIM, num_heads=2,
      num_layers=2, splits=splits, num_micro_batches=num_micro_batches,
      num_shards=1, residual_dropout_prob=0.0)
  p.random_seed = 1
  if engine is not None:
    ours = stacks.GPipeBatchMajorTransformerStack.Params()
    for name, value in p.stack.IterParams():
      if name != 'cls':
        ours.Set(**{name: value})
    ours.pipeline_tpl.Set(engine=engine, remat=remat)
    p.stack = ours
  return p


def _LmLoss(lm):
  labels = py_utils.NestedMap(class_ids=tf.constant(LABELS),
                              class_weights=tf.constant(1.0 - PADDINGS))
  xent, _ = lm.FProp(lm.theta, tf.constant(IDS), tf.constant(PADDINGS),
                     labels=labels)
  return xent.avg_xent


def _StackParams(splits, num_micro_batches, engine=None, remat=None):
  """A batch-major stack: embedding, encoder, decoder, softmax (packed)."""
  cls = (layers_with_gpipe.GPipeBatchMajorTransformerStack if engine is None
         else stacks.GPipeBatchMajorTransformerStack)
  p = test_util.BatchMajorStackParams(cls, splits, num_micro_batches, DIM)
  p.emb_tpl.token_emb.Set(vocab_size=VOCAB, embedding_dim=DIM)
  p.emb_tpl.position_emb.Set(embedding_dim=DIM)
  p.softmax_tpl.Set(input_dim=DIM, num_classes=VOCAB)
  if engine is not None:
    p.pipeline_tpl.Set(engine=engine, remat=remat)
  return p


def _StackLoss(stack):
  """The weighted mean xent of two packed sequences per row."""
  segments = np.array([[1, 1, 2, 2, 2, 0]] * BATCH, np.int32)
  positions = np.array([[0, 1, 0, 1, 2, 0]] * BATCH, np.int32)
  paddings = (segments == 0).astype(np.float32)
  weights = 1.0 - paddings
  inputs = [IDS, paddings, LABELS, paddings, segments, segments,
            np.roll(LABELS, -1, axis=1), weights, positions, positions]
  xent, _ = stack.FProp(stack.theta, *map(tf.constant, inputs))
  return tf.reduce_sum(xent * weights) / weights.sum()


def _AgainstLingvo(make_params, loss_fn, variants):
  """Our pipelined stacks vs Lingvo's un-pipelined one: loss and gradients.

  All in one TF1 graph on a 4-device split: Lingvo's layer, then one of ours
  per variant, all of ours sharing one set of variables, which get Lingvo's
  values.

  Args:
    make_params: fn(splits, M, engine=None, remat=None) -> the layer's
      Params; engine None: Lingvo's own stack.
    loss_fn: fn(layer) -> its scalar loss on the test's inputs.
    variants: (splits, M, engine, remat) of our layers.
  """
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4)
  graph = test_util.SeededGraph()
  with graph.as_default(), cluster:
    py_utils.GetOrCreateGlobalStepVar()
    ref = make_params(1, 1).Instantiate()
    ref_vars = ref.vars.Flatten()
    ref_loss = loss_fn(ref)
    expected = [ref_loss] + tf.gradients(ref_loss, ref_vars)
    actual, copy = [], []
    with py_utils.OpportunisticVariableReuseScope(True):
      for splits, num_micro, engine, remat in variants:
        ours = make_params(splits, num_micro, engine, remat).Instantiate()
        by_name = {v.name[:-2]: v for v in ours.vars.Flatten()}
        renames = checkpoints.Renames(ours, [v.name[:-2] for v in ref_vars],
                                      to='ours')
        assert sorted(renames.values()) == sorted(by_name)
        ours_vars = [by_name[renames[v.name[:-2]]] for v in ref_vars]
        if not copy:
          copy = [o.assign(r) for o, r in zip(ours_vars, ref_vars)]
        loss = loss_fn(ours)
        actual.append([loss] + tf.gradients(loss, ours_vars))
    assert any(isinstance(g, tf.IndexedSlices) for g in expected)
    dense = lambda ts: [tf.convert_to_tensor(t) for t in ts]
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(copy)
      expected, actual = sess.run(
          [dense(expected), [dense(a) for a in actual]])
  for variant, values in zip(variants, actual):
    try:
      engine_util.AssertTransparent(values, expected)
    except AssertionError as e:
      raise AssertionError(f'(splits, M, engine, remat)={variant}: {e}') from e


@pytest.mark.parametrize('variants', [
    pytest.param([(2, 2, 'loop', 'never')], id='loop-never'),
    pytest.param([(4, 4, 'loop', 'except_last'), (2, 4, 'loop', 'always'),
                  (4, 2, 'unrolled', 'never')],
                 id='others', marks=pytest.mark.slow),
])
def testLingvoTransformerLm(variants):
  """Lingvo's own GPipeTransformerLm with our stack equals it on Lingvo's."""
  _AgainstLingvo(_LmParams, _LmLoss, variants)


@pytest.mark.parametrize('variants', [
    pytest.param([([0, 1, 2], 4, 'loop', 'never')], id='loop-never'),
    pytest.param([([0, 1, 2], 2, 'unrolled', 'except_last'),
                  (2, 4, 'unrolled', 'always')],
                 id='others', marks=pytest.mark.slow),
])
def testBatchMajorStackWithTheEmbeddingInTheFirstCell(variants):
  _AgainstLingvo(_StackParams, _StackLoss, variants)


# Keras (c).


def _KerasLayers():
  return ([keras.layers.Embedding(VOCAB, DIM, name='emb')] +
          [keras.layers.Dense(DIM, activation='tanh', name=f'dense{i}')
           for i in range(3)])


def _CheckKeras(engine, remat, virtual_stages, jit_compile):
  """GPipeSequential equals keras.Sequential (K = 2, M = 4, tf.function).

  Args:
    engine: The engine.
    remat: The remat mode.
    virtual_stages: v.
    jit_compile: Whether XLA compiles the step.
  """
  keras.utils.set_random_seed(0)
  plain = keras.Sequential([keras.Input((TIME,), dtype='int32')] +
                           _KerasLayers(), name='body')
  pipe = GPipeSequential(_KerasLayers(), name='body', num_stages=2,
                         num_micro_batches=4, engine=engine, remat=remat,
                         virtual_stages=virtual_stages)
  pipe.build((None, TIME))
  pipe.set_weights(plain.get_weights())

  @tf.function(autograph=False, jit_compile=jit_compile)
  def Step(model, x):
    with tf.GradientTape() as tape:
      y = model(x, training=True)
      loss = tf.reduce_sum(y * y)
    grads = tape.gradient(loss, model.trainable_variables)
    return [y] + [tf.convert_to_tensor(g) for g in grads]

  x = tf.constant(IDS)
  engine_util.AssertTransparent([t.numpy() for t in Step(pipe, x)],
                                [t.numpy() for t in Step(plain, x)])


@pytest.mark.parametrize('engine,remat', engine_util.ENGINE_REMAT_MODES)
@pytest.mark.parametrize('virtual_stages', [1, 2])
def testKerasEmbeddingInTheFirstChunk(engine, remat, virtual_stages):
  # With v = 2 the embedding is chunk 0 alone, and a micro-batch looks up
  # 2 x 6 = VOCAB rows: a sparse gradient's values have the table's shape.
  _CheckKeras(engine, remat, virtual_stages, jit_compile=False)


@pytest.mark.parametrize('remat', schedule.REMAT_MODES)
def testKerasEmbeddingUnderXla(remat):
  """The loop engine (XLA's) densifies with a static number of rows."""
  _CheckKeras('loop', remat, 1, jit_compile=True)


# The engine's own API (d): a tied embedding in the first and last chunks.

NUM_STAGES, NUM_MICRO = 2, 4
EMBEDDING = RNG.randn(VOCAB, DIM).astype(np.float32)
WEIGHTS = [RNG.randn(DIM, DIM).astype(np.float32) * 0.5 for _ in range(4)]


def _Embed(theta, inputs, state, micro_batch_id):
  """Chunk 0: looks the ids up in the embedding, then a tanh layer."""
  del micro_batch_id
  (embedding, w), (ids, labels) = theta, inputs
  return (tf.tanh(tf.einsum('btd,de->bte', tf.gather(embedding, ids), w)),
          labels), state


def _Middle(theta, inputs, state, micro_batch_id):
  del micro_batch_id
  (w,), (h, labels) = theta, inputs
  return (tf.tanh(tf.einsum('btd,de->bte', h, w)), labels), state


def _Xent(embedding, w, h, labels):
  """Per example: mean xent of the softmax tied to the embedding."""
  logits = tf.einsum('btd,vd->btv',
                     tf.tanh(tf.einsum('btd,de->bte', h, w)), embedding)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits), axis=1)


def _Softmax(theta, inputs, state, micro_batch_id):
  """The last chunk: a tanh layer and the tied softmax's xent per example."""
  del micro_batch_id
  return (_Xent(*theta, *inputs),), state


def _SoftmaxLoss(theta, inputs, state, micro_batch_id):
  """The last chunk with the loss inside: the micro-batch's mean xent."""
  del micro_batch_id
  return (tf.reduce_mean(_Xent(*theta, *inputs)),), state


def _PlainLoss(embedding_in, embedding_out, weights):
  ids, labels = tf.constant(IDS), tf.constant(LABELS)
  h = tf.tanh(tf.einsum('btd,de->bte', tf.gather(embedding_in, ids),
                        weights[0]))
  for w in weights[1:-1]:
    h = tf.tanh(tf.einsum('btd,de->bte', h, w))
  return tf.reduce_mean(_Xent(embedding_out, weights[-1], h, labels))


def _PipelinedLoss(embedding, weights, engine, remat, name, v):
  """The same loss, pipelined: 2 v chunks on 2 devices, M = 4."""
  num_chunks = NUM_STAGES * v
  loss_inside = schedule.SCHEDULES[name].loss_inside
  fns = ([_Embed] + [_Middle] * (num_chunks - 2) +
         [_SoftmaxLoss if loss_inside else _Softmax])
  per = (len(weights) - 2) // (num_chunks - 2) if num_chunks > 2 else 0
  thetas = ([[embedding, weights[0]]] +
            [weights[1 + i * per:1 + (i + 1) * per]
             for i in range(num_chunks - 2)] +
            [[embedding, weights[-1]]])
  pipe = pipeline.Pipeline(fns, engine_util.CPUS[:NUM_STAGES], NUM_MICRO,
                           remat=remat, engine=engine, schedule=name,
                           virtual_stages=v)
  (out,), _ = pipe(thetas, [tf.constant(IDS), tf.constant(LABELS)])
  return out if loss_inside else tf.reduce_mean(out)


@pytest.mark.parametrize('engine,remat,name,v', GRID)
def testTiedEmbeddingReadByTwoChunks(engine, remat, name, v):
  """The tied embedding's gradient is the sum of its two uses."""
  weights = WEIGHTS[:2] if v == 1 else WEIGHTS
  graph = tf.Graph()
  with graph.as_default():
    embedding = tf.constant(EMBEDDING)
    ws = [tf.constant(w) for w in weights]
    plain = _PlainLoss(embedding, embedding, ws)
    # Each use alone: the other one reads a constant copy.
    frozen = tf.stop_gradient(embedding)
    uses = [tf.gradients(_PlainLoss(embedding, frozen, ws), embedding)[0],
            tf.gradients(_PlainLoss(frozen, embedding, ws), embedding)[0]]
    piped = _PipelinedLoss(embedding, ws, engine, remat, name, v)
    dense = lambda ts: [tf.convert_to_tensor(t) for t in ts]
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      expected, actual, (use_in, use_out) = sess.run([
          dense([plain] + tf.gradients(plain, [embedding] + ws)),
          dense([piped] + tf.gradients(piped, [embedding] + ws)),
          dense(uses)])
  engine_util.AssertTransparent(actual, expected)
  engine_util.AssertTransparent([actual[1]], [use_in + use_out])
  assert np.abs(use_in).max() > 0.01 and np.abs(use_out).max() > 0.01
