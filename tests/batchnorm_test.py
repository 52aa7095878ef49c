"""Tests of lingvo_gpipe.batchnorm: batch norm over micro-batches.

The tests build TF1 graphs holding the pipeline and a plain Lingvo reference
that share their variables, emulate one Lingvo training step (`bn_updates`
from `FindRelevantBatchNormUpdates`, then `PostTrainingStepUpdate`, as
`BaseTask` does; one test runs a real `BaseTask`'s train_op) and compare
numbers.
"""

import logging

from absl.testing import flagsaver
import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import base_input_generator
from lingvo.core import builder_layers
from lingvo.core import base_model
from lingvo.core import bn_layers
from lingvo.core import cluster_factory
from lingvo.core import layers
from lingvo.core import py_utils

from lingvo_gpipe import batchnorm
from lingvo_gpipe import layers as layers_lib
import engine_util
import test_util

DIM = 8
BATCH = 16
DECAY = 0.9


@pytest.fixture(autouse=True)
def _no_lingvo_asserts():
  """Lingvo's graph asserts cost ~0.1 s of graph building per batch norm."""
  with flagsaver.flagsaver(enable_asserts=False):
    yield


def _Cells(bn_cls, dim=DIM):
  """[fc0, bn0, fc1, bn1] with batch norms of class `bn_cls`."""
  cells = []
  for i in range(2):
    cells.append(layers.FCLayer.Params().Set(
        name=f'fc{i}', input_dim=dim, output_dim=dim, activation='NONE'))
    cells.append(bn_cls.Params().Set(
        name=f'bn{i}', dim=dim, decay=DECAY,
        add_stats_to_moving_average_variables=True))
  return cells


def _BatchNorms(layer):
  return [layer.children[n] for n in ('bn0', 'bn1')]


def _TrainStepOp(layer, loss):
  """What Lingvo's BaseTask runs for batch norm: bn_updates, then post-step."""
  bn_updates, _ = py_utils.FindRelevantBatchNormUpdates(
      loss, tf.get_collection(py_utils.BATCH_NORM_UPDATES))
  with tf.control_dependencies(bn_updates):
    post_step = layer.PostTrainingStepUpdate()
  return tf.group(bn_updates + [post_step])


def _MovingStats(layer):
  return [v for bn in _BatchNorms(layer)
          for v in (bn.vars.moving_mean, bn.vars.moving_variance)]


def _RandomizeMovingStats(sess, layer, rng):
  """Loads non-trivial moving statistics, so the decay rule is checked."""
  for bn in _BatchNorms(layer):
    bn.vars.moving_mean.load(rng.randn(DIM).astype(np.float32), sess)
    bn.vars.moving_variance.load(
        rng.uniform(0.5, 2.0, DIM).astype(np.float32), sess)


def _Inputs(rng, batch=BATCH, dim=DIM):
  # A large offset, where moments from sums of squares would lose digits.
  return (rng.randn(batch, dim) * 2.0 + 30.0).astype(np.float32)


def _PerMicroBatchReference(ref, x, num_micro):
  """The plain model on each micro-batch, and full-batch BN statistics.

  Args:
    ref: The plain [fc0, bn0, fc1, bn1] model (Lingvo batch norms).
    x: The mini-batch.
    num_micro: M.

  Returns:
    (outputs, updates): the concatenated per-micro-batch outputs, and the
    moving-average updates of plain Lingvo batch norms applied to the whole
    mini-batch of what each batch norm receives.
  """
  theta, bn_inputs, outputs = ref.theta, [[], []], []
  for xm in tf.split(x, num_micro):
    h = xm
    for i in range(2):
      h = ref.children[f'fc{i}'].FProp(theta[f'fc{i}'], h)
      bn_inputs[i].append(h)
      h = ref.children[f'bn{i}'].FProp(theta[f'bn{i}'], h)
    outputs.append(h)
  updates = []
  for i in range(2):
    start = len(tf.get_collection(py_utils.BATCH_NORM_UPDATES))
    ref.children[f'bn{i}'].FProp(theta[f'bn{i}'], tf.concat(bn_inputs[i], 0))
    updates += tf.get_collection(py_utils.BATCH_NORM_UPDATES)[start:]
  assert len(updates) == 4
  return tf.concat(outputs, 0), updates


@pytest.mark.parametrize('num_stages', [1, 2])
@pytest.mark.parametrize('num_micro', [1, 2, 4, 8])
def test_one_step_matches_full_batch(num_micro, num_stages, engine):
  """Moving stats as full-batch Lingvo BN; outputs as per-micro-batch BN."""
  rng = np.random.RandomState(num_micro * 10 + num_stages)
  x_np = _Inputs(rng)
  graph = test_util.SeededGraph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = test_util.PipeParams(
        _Cells(batchnorm.BatchNormLayer), num_stages=num_stages,
        num_micro_batches=num_micro, engine=engine).Instantiate()
    ref = test_util.Reference(_Cells(bn_layers.BatchNormLayer))
    x = tf.constant(x_np)
    y = pipe.FProp(pipe.theta, x)
    pipe_step = _TrainStepOp(pipe, tf.reduce_sum(tf.square(y)))
    y_micro, ref_updates = _PerMicroBatchReference(ref, x, num_micro)
    stats = _MovingStats(pipe)
    with tf.Session(graph=graph, config=engine_util.SessionConfig()) as sess:
      sess.run(tf.global_variables_initializer())
      _RandomizeMovingStats(sess, pipe, rng)
      initial = sess.run(stats)
      y_val, y_micro_val, _ = sess.run([y, y_micro, pipe_step])
      pipe_stats = sess.run(stats)
      for v, value in zip(stats, initial):
        v.load(value, sess)
      sess.run(ref_updates)
      ref_stats = sess.run(stats)
  engine_util.AssertTransparent([y_val], [y_micro_val])
  for actual, expected, before in zip(pipe_stats, ref_stats, initial):
    assert not np.allclose(expected, before)
    assert engine_util.RelErr(actual, expected) < 1e-5
  if num_micro == 1:  # Bit for bit what Lingvo's layer does.
    np.testing.assert_array_equal(pipe_stats, ref_stats)


class _ConstantInput(base_input_generator.BaseInputGenerator):
  """Always the same batch x: [BATCH, DIM]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('x', None, 'The batch, a numpy array.')
    return p

  def _InputBatch(self):
    return py_utils.NestedMap(x=tf.constant(self.params.x))


class _PipelinedTask(base_model.BaseTask):
  """A Lingvo task: fc0 then our batch norm, as a K=2, M=4 pipeline."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('engine', 'unrolled', 'The pipeline engine.')
    return p

  def __init__(self, params):
    super().__init__(params)
    cells = _Cells(batchnorm.BatchNormLayer)[:2]
    self.CreateChild('pipe', test_util.PipeParams(
        cells, num_stages=2, num_micro_batches=4, engine=params.engine))

  def ComputePredictions(self, theta, input_batch):
    return self.pipe.FProp(theta.pipe, input_batch.x)

  def ComputeLoss(self, theta, predictions, input_batch):
    loss = tf.reduce_sum(tf.square(predictions))
    return {'loss': (loss, tf.constant(1.0))}, {}


def test_lingvo_task_applies_update(engine):
  """BaseTask's train_op updates the moving stats once, from the mini-batch."""
  x_np = _Inputs(np.random.RandomState(5))
  graph = test_util.SeededGraph()
  with graph.as_default():
    p = _PipelinedTask.Params().Set(name='task', engine=engine)
    p.input = _ConstantInput.Params().Set(x=x_np)
    task = p.Instantiate()
    task.FPropDefaultTheta()
    task.BProp()
    fc0, bn0 = task.pipe.children.fc0, task.pipe.children.bn0
    bn_inputs = fc0.FProp(fc0.theta, tf.constant(x_np))
    with tf.Session(graph=graph, config=engine_util.SessionConfig()) as sess:
      sess.run(tf.global_variables_initializer())
      h = sess.run(bn_inputs)  # Before train_op changes fc0.
      sess.run(task.train_op)
      mean, variance = sess.run(
          [bn0.vars.moving_mean, bn0.vars.moving_variance])
  assert engine_util.RelErr(mean, (1 - DECAY) * h.mean(axis=0)) < 1e-5
  assert engine_util.RelErr(variance, DECAY + (1 - DECAY) * h.var(axis=0)) < 1e-5


def test_gradients_same_with_and_without_remat():
  rng = np.random.RandomState(0)
  x_np = _Inputs(rng)
  graph = test_util.SeededGraph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    fetches = []
    for engine, remat in [('unrolled', 'never'), ('unrolled', 'always'),
                          ('loop', 'always')]:
      with py_utils.OpportunisticVariableReuseScope(True):
        pipe = test_util.PipeParams(
            _Cells(batchnorm.BatchNormLayer), num_stages=2,
            num_micro_batches=4, remat=remat, engine=engine).Instantiate()
      x = tf.constant(x_np)
      y = pipe.FProp(pipe.theta, x)
      loss = tf.reduce_sum(tf.square(y))
      wrt = [v for v in pipe.vars.Flatten() if v.trainable] + [x]
      fetches.append([y] + tf.gradients(loss, wrt))
      # Both pipes accumulate exactly 4 micro-batches, recompute or not.
      fetches[-1].append(_BatchNorms(pipe)[0].accumulators.moments.GetValue())
    with tf.Session(graph=graph, config=engine_util.SessionConfig()) as sess:
      sess.run(tf.global_variables_initializer())
      plain_values, *remat_values = sess.run(fetches)
  for values in remat_values:
    assert values[-1][0, 0] == BATCH
    engine_util.AssertTransparent(values, plain_values)


def test_eval_uses_moving_stats(engine):
  rng = np.random.RandomState(1)
  x_np = _Inputs(rng)
  graph = test_util.SeededGraph()
  with graph.as_default(), cluster_factory.SetEval(True):
    py_utils.GetOrCreateGlobalStepVar()
    pipe = test_util.PipeParams(
        _Cells(batchnorm.BatchNormLayer), num_stages=2,
        num_micro_batches=4, engine=engine).Instantiate()
    ref = test_util.Reference(_Cells(bn_layers.BatchNormLayer))
    x = tf.constant(x_np)
    y, y_ref = pipe.FProp(pipe.theta, x), ref.FProp(ref.theta, x)
    stats = _MovingStats(pipe)
    with tf.Session(graph=graph, config=engine_util.SessionConfig()) as sess:
      sess.run(tf.global_variables_initializer())
      _RandomizeMovingStats(sess, pipe, rng)
      before = sess.run(stats)
      y_val, y_ref_val = sess.run([y, y_ref])
      after = sess.run(stats)
  engine_util.AssertTransparent([y_val], [y_ref_val])
  np.testing.assert_array_equal(before, after)
  # Normalized with the moving statistics, not the batch's.
  assert np.abs(y_val.mean(axis=0)).max() > 0.1


def test_eval_traced_twice_in_tf_function(engine):
  """Lingvo's eager evaler traces eval FProp twice; no tensor may leak.

  A tensor of the first trace kept by the layer (e.g. an accumulator value)
  would fail the second trace; both traces must give the cells' own eval
  output, normalized with the (non-trivial) moving statistics.

  Args:
    engine: The pipeline engine.
  """
  p = test_util.PipeParams(_Cells(batchnorm.BatchNormLayer), num_stages=2,
                           num_micro_batches=2, engine=engine)
  p.is_inference = True
  rng = np.random.RandomState(0)
  with cluster_factory.SetEval(True):
    pipe = p.Instantiate()
    for bn in _BatchNorms(pipe):
      bn.vars.moving_mean.assign(rng.randn(DIM).astype(np.float32))
      bn.vars.moving_variance.assign(
          rng.uniform(0.5, 2.0, DIM).astype(np.float32))
    x = tf.constant(_Inputs(rng))
    outputs = [tf.function(lambda: pipe.FProp(pipe.theta, x))()
               for _ in range(2)]
    expected = x
    for name in ('fc0', 'bn0', 'fc1', 'bn1'):
      expected = pipe.children[name].FProp(pipe.theta[name], expected)
  for y in outputs:
    engine_util.AssertTransparent([y.numpy()], [expected.numpy()])


def _PaddedInputs(rng, num_micro, batch=8, time=5):
  x = (rng.randn(batch, time, DIM) * 3.0 + 1.0).astype(np.float32)
  lengths = rng.randint(1, time + 1, batch)
  rows = batch // num_micro
  lengths[rows:2 * rows] = 0  # One micro-batch is entirely padding.
  paddings = (np.arange(time)[None, :] >= lengths[:, None]).astype(np.float32)
  return x, paddings


@pytest.mark.parametrize('num_micro', [1, 4])
def test_paddings_excluded_from_stats(num_micro, engine):
  rng = np.random.RandomState(2)
  x_np, pad_np = _PaddedInputs(rng, num_micro)
  graph = test_util.SeededGraph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    bn_p = batchnorm.BatchNormLayer.Params().Set(name='bn0', dim=DIM,
                                                 decay=DECAY)
    pipe = test_util.PipeParams([bn_p], num_micro_batches=num_micro,
                                remat='always', engine=engine).Instantiate()
    ref = test_util.Reference([
        bn_layers.BatchNormLayer.Params().Set(name='bn0', dim=DIM, decay=DECAY)
    ])
    x, paddings = tf.constant(x_np), tf.constant(pad_np)
    y = pipe.FProp(pipe.theta, x, paddings)
    step = _TrainStepOp(pipe, tf.reduce_sum(tf.square(y)))
    y_micro = tf.concat([
        ref.FProp(ref.theta, xm, pm)
        for xm, pm in zip(tf.split(x, num_micro), tf.split(paddings, num_micro))
    ], axis=0)
    bn = pipe.children.bn0
    stats = [bn.vars.moving_mean, bn.vars.moving_variance]
    with tf.Session(graph=graph, config=engine_util.SessionConfig()) as sess:
      sess.run(tf.global_variables_initializer())
      y_val, y_micro_val, _ = sess.run([y, y_micro, step])
      mean, variance = sess.run(stats)
  engine_util.AssertTransparent([y_val], [y_micro_val])
  valid = x_np[pad_np == 0]  # [valid positions, DIM]
  expected_mean = (1 - DECAY) * valid.mean(axis=0)
  expected_var = DECAY + (1 - DECAY) * valid.var(axis=0)
  assert engine_util.RelErr(mean, expected_mean) < 1e-5
  assert engine_util.RelErr(variance, expected_var) < 1e-5


def test_plain_use_is_lingvo_batch_norm():
  """Outside a pipeline: Lingvo's ops, update in bn_updates, no post-step."""
  rng = np.random.RandomState(3)
  x_np = _Inputs(rng)
  results = []
  for cls in (batchnorm.BatchNormLayer, bn_layers.BatchNormLayer):
    graph = tf.Graph()
    with graph.as_default():
      py_utils.GetOrCreateGlobalStepVar()
      bn = cls.Params().Set(name='bn', dim=DIM, decay=DECAY).Instantiate()
      y = bn.FProp(bn.theta, tf.constant(x_np))
      loss = tf.reduce_sum(tf.square(y))
      bn_updates, _ = py_utils.FindRelevantBatchNormUpdates(
          loss, tf.get_collection(py_utils.BATCH_NORM_UPDATES))
      assert len(bn_updates) == 2
      with tf.control_dependencies(bn_updates):
        post_step = bn.PostTrainingStepUpdate()
      # The post-step adds no second update.
      assert len(tf.get_collection(py_utils.BATCH_NORM_UPDATES)) == 2
      with tf.Session(graph=graph) as sess:
        sess.run(tf.global_variables_initializer())
        y_val, _ = sess.run([y, post_step])
        results.append([y_val] + sess.run(
            [bn.vars.moving_mean, bn.vars.moving_variance]))
  for ours, lingvo in zip(*results):
    np.testing.assert_array_equal(ours, lingvo)


def test_combine_moments_is_exact_and_stable():
  rng = np.random.RandomState(4)
  parts = [(rng.randn(n, 3) * 0.01 + 1000.0) for n in (5, 0, 1, 7)]
  graph = tf.Graph()
  with graph.as_default():
    acc = batchnorm.MomentsAccumulator(3, tf.float64)
    for part in parts:
      mean = part.mean(axis=0) if len(part) else np.zeros(3)
      var = part.var(axis=0) if len(part) else np.zeros(3)
      acc.Update(tf.constant(np.stack([np.full(3, len(part)), mean, var])))
    with tf.Session(graph=graph) as sess:
      count, mean, var = sess.run(acc.GetValue())
  whole = np.concatenate(parts)
  np.testing.assert_array_equal(count, len(whole))
  np.testing.assert_allclose(mean, whole.mean(axis=0), rtol=1e-12)
  np.testing.assert_allclose(var, whole.var(axis=0), rtol=1e-9)


def test_post_step_resets_and_bad_param():
  with tf.Graph().as_default():
    acc = batchnorm.MomentsAccumulator(2, tf.float32)
    assert not acc.has_value
    acc.Update(tf.ones([3, 2]))
    assert acc.has_value
    acc.Reset()
    assert not acc.has_value
    p = batchnorm.BatchNormLayer.Params().Set(name='bn', dim=2,
                                              accumulate_stats='yes')
    with pytest.raises(ValueError, match='accumulate_stats'):
      p.Instantiate()


def test_pipeline_marks_ours_and_warns_once_per_lingvo_batch_norm(caplog):
  """Ours, at any depth, accumulate; each plain Lingvo one gets one warning.

  Our layer subclasses Lingvo's, so the pipeline must recognize it first:
  otherwise it would warn about it and leave it updating per micro-batch.

  Args:
    caplog: pytest's log capture.
  """
  nested = builder_layers.SequentialLayer.Params().Set(
      name='block', sub=_Cells(bn_layers.BatchNormLayer)[:2] +
      _Cells(batchnorm.BatchNormLayer)[2:])
  cells = [nested] + _Cells(batchnorm.BatchNormLayer)[2:] + [
      bn_layers.BatchNormLayer.Params().Set(name='plain', dim=DIM)]
  with tf.Graph().as_default(), caplog.at_level(logging.WARNING):
    pipe = test_util.PipeParams(cells, num_stages=2).Instantiate()
  warnings = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and
              r.pathname == layers_lib.__file__]
  assert len(warnings) == 2, warnings
  for path, message in zip(['pipe.block.bn0', 'pipe.plain'], sorted(warnings)):
    assert message.startswith(f'pipe: {path} is a Lingvo BatchNormLayer;')
    assert message.endswith('Use lingvo_gpipe.BatchNormLayer instead.')
  ours = [pipe.children.block.children.bn1, pipe.children.bn1]
  assert [bn.AccumulatesStats() for bn in ours] == [True, True]
  # Outside a pipeline ours keeps Lingvo's per-call update.
  with tf.Graph().as_default():
    alone = _Cells(batchnorm.BatchNormLayer)[1].Instantiate()
  assert not alone.AccumulatesStats()
