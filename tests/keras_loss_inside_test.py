"""GPipeSequential with the loss inside the pipeline ('1f1b', 'zb1p', 'zbv').

The layer takes (inputs, labels) and returns the mean loss; the loss and the
gradient of every trainable variable (and of the watched input) equal those
of `loss(labels, keras.Sequential(layers)(inputs))`, in a tf.function with
remat 'never' and 'always', and under XLA; eval returns the mean loss;
batch norm moves once per step; model.fit through a custom train_step (with
and without XLA); the config keeps the loss; errors.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.keras import GPipeSequential
import engine_util

DIM = 8
CLASSES = 5
BATCH = 16
# (schedule, virtual_stages), each at K = 2.
SCHEDULES = [('1f1b', 1), ('zb1p', 1), ('zbv', 2)]


def _Layers():
  """Four tanh layers and the logits: 4 chunks of zbv's V at K = 2."""
  return [keras.layers.Dense(DIM, activation='tanh', name=f'dense{i}')
          for i in range(4)] + [keras.layers.Dense(CLASSES, name='logits')]


def _Loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _Data(batch=BATCH, seed=0):
  """(x, labels): float inputs and int class labels."""
  rng = np.random.RandomState(seed)
  return (rng.randn(batch, DIM).astype(np.float32),
          rng.randint(0, CLASSES, batch).astype(np.int32))


def _Models(schedule='zb1p', virtual_stages=1, loss=None, **pipe_kwargs):
  """(plain, pipe): keras.Sequential and GPipeSequential with equal weights."""
  keras.utils.set_random_seed(0)
  plain = keras.Sequential([keras.Input((DIM,))] + _Layers(), name='body')
  pipe = GPipeSequential(_Layers(), num_stages=2, schedule=schedule,
                         virtual_stages=virtual_stages,
                         loss=_Loss() if loss is None else loss, name='body',
                         **pipe_kwargs)
  pipe.build((None, DIM))
  pipe.set_weights(plain.get_weights())
  return plain, pipe


def _LossAndGradients(loss_fn, variables, x, labels, jit_compile=False):
  """[loss] + d loss / d(variables, x) of `loss_fn(x, labels)`, traced."""

  @tf.function(jit_compile=jit_compile)
  def Step(x, labels):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss = loss_fn(x, labels)
    return [loss] + tape.gradient(loss, variables + [x])

  return [np.asarray(t) for t in Step(tf.constant(x), tf.constant(labels))]


def _CheckEqualsSequential(plain, pipe, loss, x, labels, jit_compile=False):
  """The pipe's loss and gradients are the plain model's under `loss`."""
  expected = _LossAndGradients(
      lambda x, y: loss(y, plain(x, training=True)),
      plain.trainable_variables, x, labels, jit_compile)
  actual = _LossAndGradients(
      lambda x, y: pipe((x, y), training=True), pipe.trainable_variables, x,
      labels, jit_compile)
  assert len(actual) == len(plain.trainable_variables) + 2
  assert actual[0].shape == ()
  engine_util.AssertTransparent(actual, expected, tol=1e-5)


@pytest.mark.parametrize('remat', ['never', 'always'])
@pytest.mark.parametrize('num_micro_batches', [1, 4])
@pytest.mark.parametrize('schedule,virtual_stages', SCHEDULES)
def testLossAndGradientsEqualSequential(schedule, virtual_stages,
                                        num_micro_batches, remat):
  plain, pipe = _Models(schedule, virtual_stages,
                        num_micro_batches=num_micro_batches, remat=remat)
  _CheckEqualsSequential(plain, pipe, _Loss(), *_Data())


def testUnderXla():
  plain, pipe = _Models('zbv', 2, num_micro_batches=4)
  _CheckEqualsSequential(plain, pipe, _Loss(), *_Data(), jit_compile=True)


@pytest.mark.parametrize('loss,labels', [
    # A loss name: Keras' function, reduced to its mean as compile does.
    ('mse', np.random.RandomState(2).randn(BATCH, CLASSES).astype(
        np.float32)),
    # A callable that returns the scalar mean itself.
    (lambda y_true, y_pred: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(y_true, y_pred)),
     _Data()[1]),
])
def testLossNamesAndCallables(loss, labels):
  plain, pipe = _Models('1f1b', num_micro_batches=4, loss=loss)
  expected = (keras.losses.MeanSquaredError() if loss == 'mse' else loss)
  _CheckEqualsSequential(plain, pipe, expected, _Data()[0], labels)


def testEvalReturnsTheMeanLoss():
  """training=False runs the forwards alone: the same mean loss."""
  plain, pipe = _Models('zb1p', num_micro_batches=4)
  x, labels = _Data()
  for training in (False, None):
    np.testing.assert_allclose(pipe((x, labels), training=training),
                               _Loss()(labels, plain(x)), rtol=1e-6)


class PipelinedModel(keras.Model):
  """fit and evaluate a GPipeSequential whose last chunk takes the loss."""

  def __init__(self, pipe, **kwargs):
    super().__init__(**kwargs)
    self.pipe = pipe
    self.loss_tracker = keras.metrics.Mean(name='loss')

  def call(self, inputs, training=None):
    return self.pipe(inputs, training=training)

  def train_step(self, data):
    x, labels = data
    with tf.GradientTape() as tape:
      loss = self((x, labels), training=True)
    grads = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
    self.loss_tracker.update_state(loss)
    return {'loss': self.loss_tracker.result()}

  def test_step(self, data):
    x, labels = data
    self.loss_tracker.update_state(self((x, labels), training=False))
    return {'loss': self.loss_tracker.result()}

  @property
  def metrics(self):
    return [self.loss_tracker]


@pytest.mark.parametrize('jit_compile', [False, True])
def testFitWithACustomTrainStepLeavesTheSameWeights(jit_compile):
  plain, pipe = _Models('zb1p', num_micro_batches=4)
  model = PipelinedModel(pipe)
  model.compile(optimizer=keras.optimizers.SGD(0.5), jit_compile=jit_compile)
  plain.compile(optimizer=keras.optimizers.SGD(0.5), loss=_Loss(),
                jit_compile=jit_compile)
  x, labels = _Data(3 * BATCH)
  before = plain.get_weights()
  history = {}
  for name, m in (('plain', plain), ('pipe', model)):
    history[name] = m.fit(x, labels, batch_size=BATCH, shuffle=False,
                          verbose=0).history['loss']
  assert max(np.max(np.abs(a - b))
             for a, b in zip(plain.get_weights(), before)) > 1e-3
  engine_util.AssertTransparent(pipe.get_weights(), plain.get_weights(),
                                tol=1e-5)
  np.testing.assert_allclose(history['pipe'], history['plain'], rtol=1e-5)
  np.testing.assert_allclose(
      model.evaluate(x, labels, batch_size=BATCH, verbose=0),
      plain.evaluate(x, labels, batch_size=BATCH, verbose=0), rtol=1e-5)


def testBatchNormMovesOnceFromTheWholeBatch():
  """Moving statistics as the plain layer's after a whole-batch step."""

  def Layers():
    return [keras.layers.Dense(DIM, name='dense0'),
            keras.layers.BatchNormalization(momentum=0.9, name='bn')
           ] + _Layers()[1:]

  keras.utils.set_random_seed(0)
  plain = keras.Sequential([keras.Input((DIM,))] + Layers(), name='body')
  pipe = GPipeSequential(Layers(), num_stages=2, virtual_stages=2,
                         num_micro_batches=4, schedule='zbv', loss=_Loss(),
                         name='body')
  pipe.build((None, DIM))
  pipe.set_weights(plain.get_weights())
  x, labels = _Data()
  pipe((x * 3 + 1, labels), training=True)
  plain(x * 3 + 1, training=True)
  moving = [v.numpy() for v in pipe.non_trainable_variables]
  assert len(moving) == 2 and np.max(np.abs(moving[0])) > 0.05
  engine_util.AssertTransparent(
      moving, [v.numpy() for v in plain.non_trainable_variables])


def testSymbolicCallIsAScalar():
  _, pipe = _Models('1f1b')
  x, labels = keras.Input((DIM,)), keras.Input((), dtype='int32')
  loss = pipe((x, labels))
  assert (loss.shape, loss.dtype) == ((), 'float32')
  with pytest.raises(ValueError, match=r'takes \(inputs, labels\)'):
    pipe(x)


@pytest.mark.parametrize('loss', [_Loss(), 'sparse_categorical_crossentropy'])
def testConfigKeepsTheLoss(loss):
  _, pipe = _Models('zbv', 2, num_micro_batches=4, loss=loss)
  config = pipe.get_config()
  assert config['loss'] == keras.saving.serialize_keras_object(loss)
  clone = GPipeSequential.from_config(config)
  assert clone.get_config() == config
  clone.build((None, DIM))
  clone.set_weights(pipe.get_weights())
  x, labels = _Data()
  np.testing.assert_allclose(clone((x, labels), training=True),
                             pipe((x, labels), training=True), rtol=1e-6)


@pytest.mark.parametrize('kwargs,message', [
    ({'loss': None}, r"^schedule='zb1p' computes the loss inside the "
     'pipeline: give loss='),
    ({'schedule': 'gpipe'}, r'^loss=.* needs a schedule that computes the '
     r"loss inside the pipeline \(\['1f1b', 'zb1p', 'zbv'\]\); "
     "schedule='gpipe'"),
    ({'schedule': 'zbv'}, "virtual_stages=1 is not supported with "
     "schedule='zbv'"),
    ({'virtual_stages': 2}, "virtual_stages=2 is not supported with "
     "schedule='zb1p'"),
    ({'schedule': '1f1b', 'virtual_stages': 2, 'num_micro_batches': 3},
     r"num_micro_batches=3 with schedule='1f1b' and virtual_stages=2 must be "
     'a multiple of num_stages=2'),
    ({'engine': 'unrolled'},
     "schedule='zb1p' is not supported with engine='unrolled'"),
    ({'loss': keras.losses.MeanSquaredError(reduction='sum')},
     "reduction='sum'; .*use reduction='sum_over_batch_size'"),
    ({'loss': 'no_such_loss'}, "loss='no_such_loss' is not a Keras loss"),
    ({'loss': 3}, 'loss=3 must be a keras.losses.Loss, a loss name or a '
     'callable'),
])
def testConstructionErrorsNameTheParameter(kwargs, message):
  kwargs = dict({'layers': _Layers(), 'num_stages': 2, 'schedule': 'zb1p',
                 'loss': _Loss()}, **kwargs)
  with pytest.raises(ValueError, match=message):
    GPipeSequential(**kwargs)


class _PerExample(keras.losses.Loss):
  """A loss whose __call__ skips the reduction: one value per example."""

  def __call__(self, y_true, y_pred, sample_weight=None):
    return tf.reduce_mean(tf.square(y_pred), axis=-1)


@pytest.mark.parametrize('inputs,message', [
    (lambda x, y: x, r'takes \(inputs, labels\), two tensors with the batch '
     r'on axis 0; got EagerTensor of shape \(16, 8\)'),
    (lambda x, y: (x, y, y), r'got tuple of 3: '),
    (lambda x, y: (x, y[:8]), r'the inputs \(16 examples, shape \(16, 8\)\) '
     r'and labels \(8, shape \(8,\)\) must have the same batch size'),
])
def testCallErrors(inputs, message):
  _, pipe = _Models('1f1b', num_micro_batches=4)
  with pytest.raises(ValueError, match=message):
    pipe(inputs(*[tf.constant(t) for t in _Data()]), training=True)


def testALossThatReturnsNoScalarRaises():
  _, pipe = _Models('1f1b', loss=_PerExample())
  with pytest.raises(ValueError, match=r'loss=.*_PerExample.* returned .* '
                     'on a micro-batch; the pipeline needs a float scalar'):
    pipe(_Data(), training=True)
