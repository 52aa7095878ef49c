"""Zero-bubble schedules on the loop engine: the split backward, transparent.

'zb1p' and 'zbv' split each backward into B (input gradients) and W (weight
gradients, `engine/split_backward.py`). Checked here: the split computes
TensorFlow's gradients and W does not redo B's work (the ops of each part);
a step of either schedule equals the model without a pipeline (loss and
every gradient) for K in {1, 2, 4}, M in {1, 4, 8} with remat 'never' (and
a corner of the grid with 'always'), in a tf.function, in a TF1 graph and
under XLA; and the compiled step does not grow with M.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.engine import pipeline
from lingvo_gpipe.engine import split_backward
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.planning import schedule
import engine_util

DIM = 6
MICRO_BATCH_SIZE = 2
SCHEDULES = ('zb1p', 'zbv')


def _Weights(num_chunks, seed=0):
  rng = np.random.RandomState(seed)
  return [{'w': tf.constant(rng.randn(DIM, DIM).astype(np.float32) * 0.6),
           'b': tf.constant(rng.randn(DIM).astype(np.float32) * 0.1)}
          for _ in range(num_chunks)]


def _Layer(theta, x):
  return tf.tanh(tf.matmul(x, theta['w']) + theta['b'])


def _Chunk(theta, inputs, state, micro_batch_id):
  del micro_batch_id
  (x,) = inputs
  return (_Layer(theta, x),), {'calls': state['calls'] + 1}


def _LossChunk(theta, inputs, state, micro_batch_id):
  (y,), state = _Chunk(theta, inputs, state, micro_batch_id)
  return (tf.reduce_mean(y * y),), state


def _Input(num_micro_batches, seed=0):
  return tf.constant(np.random.RandomState(seed).randn(
      num_micro_batches * MICRO_BATCH_SIZE, DIM).astype(np.float32))


def _Piped(name, k, m, remat, weights, x, executor='auto'):
  """(loss, gradients of the weights and x, calls per chunk)."""
  v = 2 if name == 'zbv' else 1
  pipe = pipeline.Pipeline(
      [_Chunk] * (k * v - 1) + [_LossChunk], engine_util.CPUS[:k], m,
      remat=remat, engine='loop', schedule=name, virtual_stages=v,
      executor=executor)
  with tf.GradientTape() as tape:
    tape.watch([weights, x])
    (loss,), states = pipe(weights, [x], [{'calls': tf.constant(0)}] * (k * v))
  return loss, tape.gradient(loss, [weights, x]), [s['calls'] for s in states]


def _Plain(weights, x):
  with tf.GradientTape() as tape:
    tape.watch([weights, x])
    y = x
    for theta in weights:
      y = _Layer(theta, y)
    loss = tf.reduce_mean(y * y)
  return loss, tape.gradient(loss, [weights, x])


def _CheckTransparent(piped, plain, num_chunks, num_micro_batches):
  loss, grads, calls = piped
  plain_loss, plain_grads = plain
  engine_util.AssertTransparent(
      [loss] + tf.nest.flatten(grads),
      [plain_loss] + tf.nest.flatten(plain_grads), tol=1e-5)
  assert [int(c) for c in calls] == [num_micro_batches] * num_chunks


def _ToNumpy(value):
  return tf.nest.map_structure(np.asarray, value)


# The split itself.


def _TwoLayerSplit():
  """The BackwardSplit of a chunk of two tanh layers, and its arguments."""

  def Body(theta, inputs, state, micro_batch_id):
    del micro_batch_id
    (x,) = inputs
    return (_Layer(theta[1], _Layer(theta[0], x)),), state

  stage = stage_lib.Stage(Body, 'chunk 0', device='')
  weights = _Weights(2)
  theta = stage.FlattenTheta(weights)
  x, state = stage.FlattenCall([_Input(1)], ())
  split = split_backward.BackwardSplit(stage, theta, x, state)
  args = theta + x + state + [tf.constant(0, tf.int64)]
  return split, stage, args, len(theta)


def _Executed(function):
  """The op types a part runs: those of the function its call runs."""
  (call,) = [op for op in function.graph.get_operations()
             if op.type in ('PartitionedCall', 'StatefulPartitionedCall')]
  library = {f.signature.name: f
             for f in function.graph.as_graph_def().library.function}
  return sorted(node.op for node in library[call.get_attr('f').name].node_def
                if node.op not in ('Placeholder', 'Identity', 'Const'))


def testSplitGivesTensorFlowsGradients():
  split, stage, args, num_theta = _TwoLayerSplit()
  d_y = tf.constant(np.random.RandomState(3).randn(
      MICRO_BATCH_SIZE, DIM).astype(np.float32))
  expected = stage.backward(args[:num_theta], args[num_theta:-1], [], args[-1],
                            [d_y])
  results, stash = split.Forward(args)
  for keeping in (stash, None):
    d_inputs, weight_stash = split.Input([d_y], args, keeping)
    d_theta = split.Weight(args[:num_theta], weight_stash)
    engine_util.AssertTransparent(
        [g.numpy() for g in d_theta + d_inputs],
        [g.numpy() for g in expected[:num_theta + 1]], tol=1e-6)
  engine_util.AssertTransparent(
      results, [_Layer(_Weights(2)[1], _Layer(_Weights(2)[0], args[-2]))])


def testWeightGradientsDoNotRedoTheInputGradients():
  """Two tanh layers y = tanh(x w + b): B recomputes the forward (2 matmuls,
  2 tanh) when asked and takes the input gradients (2 matmuls with w^T); W
  runs the 2 weight matmuls x^T dz and the 2 bias sums, nothing else: no
  tanh, no tanh gradient, no input-gradient matmul."""
  split, _, _, _ = _TwoLayerSplit()
  w_ops = _Executed(split._weight)  # pylint: disable=protected-access
  assert w_ops.count('MatMul') == 2 and w_ops.count('Sum') == 2, w_ops
  assert not {'Tanh', 'TanhGrad', 'AddV2'} & set(w_ops), w_ops
  recomputing = _Executed(split._input_recomputing)  # pylint: disable=protected-access
  keeping = _Executed(split._input_keeping)  # pylint: disable=protected-access
  assert recomputing.count('MatMul') == 4 and 'Tanh' in recomputing
  assert keeping.count('MatMul') == 2 and 'Tanh' not in keeping, keeping
  assert recomputing.count('TanhGrad') == keeping.count('TanhGrad') == 2
  # What crosses from B to W: each layer's input and its dz, no constants.
  assert [s.shape.as_list() for s in split.weight_stash_specs] == (
      [[MICRO_BATCH_SIZE, DIM]] * 4)


def testPartsAreNeverInlined():
  """Each part runs as a call of its own: inlined into the loop's branch
  function, a weight gradient's matmuls missed oneDNN's rewrite (which a
  call's instantiation applies) and ran as TensorFlow's Eigen kernels."""
  split, _, _, _ = _TwoLayerSplit()
  # pylint: disable=protected-access
  parts = (split._forward, split._input_keeping, split._input_recomputing,
           split._weight)
  # pylint: enable=protected-access
  assert [p.function_def.attr['_noinline'].b for p in parts] == [True] * 4


def testSplitOfAnEmbeddingGivesItsSparseGradient():
  """W of a lookup returns TensorFlow's IndexedSlices, rows where looked up."""

  def Body(theta, inputs, state, micro_batch_id):
    del micro_batch_id
    (ids,) = inputs
    return (tf.reduce_sum(tf.gather(theta[0], ids) * theta[1]),), state

  stage = stage_lib.Stage(Body, 'embedding', device='')
  table = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
  theta = stage.FlattenTheta([table, tf.constant([1.0, 2.0, 3.0])])
  x, state = stage.FlattenCall([tf.constant([2, 0, 2])], ())
  split = split_backward.BackwardSplit(stage, theta, x, state)
  args = theta + x + state + [tf.constant(0, tf.int64)]
  d_inputs, stash = split.Input([tf.constant(1.0)], args, None)
  assert d_inputs == [None]  # Integer ids have none.
  d_table, d_scale = split.Weight(theta, stash)
  assert isinstance(d_table, tf.IndexedSlices)
  np.testing.assert_array_equal(tf.convert_to_tensor(d_table),
                                [[1, 2, 3], [0, 0, 0], [2, 4, 6], [0] * 3])
  np.testing.assert_array_equal(d_scale, [6 + 0 + 6, 7 + 1 + 7, 8 + 2 + 8])


# Transparency of whole steps.

GRID = [(name, k, m) for name in SCHEDULES for k in (1, 2, 4)
        for m in (1, 4, 8)]
# Each mode runs the whole grid without re-materialization, and a corner of
# it with (the recompute belongs to B; W is the same either way).
REMAT_GRID = [(name, k, m, 'never') for name, k, m in GRID] + [
    (name, k, m, 'always') for name in SCHEDULES for k, m in ((2, 1), (4, 8))]


@pytest.mark.parametrize('name,k,m,remat', REMAT_GRID)
def testTransparentInAFunction(name, k, m, remat):
  """Lockstep loops inside a tf.function."""
  v = 2 if name == 'zbv' else 1
  weights, x = _Weights(k * v), _Input(m)
  step = tf.function(lambda: _Piped(name, k, m, remat, weights, x),
                     autograph=False)
  _CheckTransparent(_ToNumpy(step()), _ToNumpy(_Plain(weights, x)), k * v, m)


@pytest.mark.parametrize('name,k,m,remat',
                         [g for g in REMAT_GRID if g[1] > 1])
def testTransparentInAGraph(name, k, m, remat):
  """A TF1 graph, as Lingvo's trainer builds: one loop per device."""
  v = 2 if name == 'zbv' else 1
  with tf.Graph().as_default():
    weights, x = _Weights(k * v), _Input(m)
    piped = _Piped(name, k, m, remat, weights, x, executor='per_device')
    plain = _Plain(weights, x)
    with tf.compat.v1.Session(config=engine_util.SessionConfig()) as sess:
      piped, plain = sess.run([piped, plain])
  _CheckTransparent(piped, plain, k * v, m)


@pytest.mark.parametrize('name,k,m,remat', REMAT_GRID)
def testTransparentUnderXla(name, k, m, remat):
  v = 2 if name == 'zbv' else 1
  weights, x = _Weights(k * v), _Input(m)
  step = tf.function(lambda: _Piped(name, k, m, remat, weights, x),
                     autograph=False, jit_compile=True)
  _CheckTransparent(_ToNumpy(step()), _ToNumpy(_Plain(weights, x)), k * v, m)


def _HloLines(name, m):
  k, v = 2, 2 if name == 'zbv' else 1
  weights, x = _Weights(k * v), _Input(m)
  step = tf.function(lambda: _Piped(name, k, m, 'never', weights, x),
                     autograph=False, jit_compile=True)
  return len(step.experimental_get_compiler_ir()(stage='hlo').splitlines())


@pytest.mark.parametrize('name', SCHEDULES)
def testCompiledStepDoesNotGrowWithM(name):
  """M is a loop bound, not a count of calls: the same HLO for M = 4 and 16.
  """
  lines = [_HloLines(name, m) for m in (4, 16)]
  assert lines[0] == lines[1], lines


@pytest.mark.parametrize('name,v,message', [
    ('zbv', 1, "virtual_stages=1 is not supported with schedule='zbv'"),
    ('zb1p', 2, "virtual_stages=2 is not supported with schedule='zb1p'"),
])
def testBadCombinationsRaiseBeforeAnyGraph(name, v, message):
  with pytest.raises(ValueError, match=message):
    pipeline.Pipeline([_Chunk] * 2 * v, engine_util.CPUS[:2], 4,
                      engine='loop', schedule=name, virtual_stages=v)


def testUnrolledEngineRefusesThem():
  for name in SCHEDULES:
    with pytest.raises(ValueError, match=f"schedule='{name}' is not supported "
                       "with engine='unrolled'"):
      schedule.CheckEngine('unrolled', 'never', name)


# Lingvo's own layers: the character LM's cells (an embedding lookup, Lingvo
# TransformerLayers, LayerNorm and FCLayer, the loss in the last cell).


def _LmLossAndGradients(name, num_stages, virtual_stages):
  """The LM stack's loss, accuracy and variable gradients in a TF1 graph."""
  # Imported here: the engine tests above run without Lingvo.
  from lingvo_gpipe import layers as layers_lib  # pylint: disable=g-import-not-at-top
  from params import lm  # pylint: disable=g-import-not-at-top
  import test_util  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(5)
  ids = rng.randint(0, 256, size=[8, 8]).astype(np.int32)  # [T, B]
  labels = rng.randint(0, 256, size=[8, 8]).astype(np.int32)
  paddings = np.zeros([8, 8], np.float32)
  paddings[6:, :3] = 1.0
  with test_util.SeededGraph().as_default():
    p = layers_lib.GPipeSequentialLayer.Params().Set(
        name='stack', cell_tpl=lm.CharLmCells(2, 16, 2, 32, loss_inside=True),
        num_stages=num_stages, virtual_stages=virtual_stages,
        num_micro_batches=4, batch_dim=1, schedule=name,
        devices=engine_util.CPUS[:num_stages])
    stack = p.Instantiate()
    loss, accuracy = stack.FProp(stack.theta, tf.constant(ids),
                                 tf.constant(paddings), tf.constant(labels))
    variables = stack.vars.Flatten()
    grads = [tf.convert_to_tensor(g)
             for g in tf.gradients(loss, variables)]
    with tf.compat.v1.Session(config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run([loss, accuracy] + grads)


def testLingvoLanguageModelCellsMatch1F1B():
  """GPipeSequentialLayer over the LM's cells: 'zb1p' (K = 2) and 'zbv'
  (K = 2, v = 2) give 1F1B's loss, accuracy and every variable's gradient
  (1F1B's own transparency: pipeline_test.py, train_test.py)."""
  reference = _LmLossAndGradients('1f1b', 2, 1)
  engine_util.AssertTransparent(_LmLossAndGradients('zb1p', 2, 1), reference)
  reference = _LmLossAndGradients('1f1b', 2, 2)
  engine_util.AssertTransparent(_LmLossAndGradients('zbv', 2, 2), reference)


def testProfileCountsWhatTheSplitKeeps():
  """The planner's profile of a Lingvo cell: its weight stash is the cut's
  (an FC layer: its input and its pre-activation gradient, 4 + 6 floats an
  example), and the weight gradients' time is a part of the backward's."""
  from lingvo.core import layers as lingvo_layers  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe import profiling  # pylint: disable=g-import-not-at-top
  cell = lingvo_layers.FCLayer.Params().Set(
      name='fc', input_dim=4, output_dim=6).Instantiate()
  (fc,), _ = profiling.ProfileCells(
      [cell], (np.ones([8, 4], np.float32),), batch_dim=0,
      micro_batch_sizes=[4, 8], num_warmup=1, num_runs=2)
  assert fc.weight_stash_bytes == 4 * (4 + 6)
  run = profiling.ProfileCell(cell, (np.ones([8, 4], np.float32),),
                              num_warmup=1, num_runs=2)
  assert run.weight_stash_bytes == 8 * 4 * (4 + 6)
  assert 0 <= run.weight_s <= run.backward_s
