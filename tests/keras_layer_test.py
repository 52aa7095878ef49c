"""GPipeSequential (Keras 3) equals keras.Sequential of the same layers.

Outputs and gradients for every pipeline shape, eager, in tf.function and
under XLA; model.fit; placement; dropout replay; batch norm; saving; errors.
"""

import collections
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.keras import GPipeSequential
import engine_util

DIM = 8
BATCH = 16
NUM_LAYERS = 8
SHAPES = [(1, 1), (2, 4), (4, 4), (4, 8)]


def DenseLayers(num_layers=NUM_LAYERS, dim=DIM):
  """Dense layers with tanh (so every layer changes the gradients)."""
  return [keras.layers.Dense(dim, activation='tanh', name=f'dense{i}')
          for i in range(num_layers)]


def Inputs(batch=BATCH, dim=DIM, seed=0):
  return np.random.RandomState(seed).randn(batch, dim).astype(np.float32)


def Models(make_layers, name='body', **pipe_kwargs):
  """(plain, pipelined): the same layers in keras.Sequential and GPipe.

  Both are built under the same name with fresh layers from `make_layers`;
  the pipelined model gets the plain model's weights (the same for every
  call: initializers are seeded).
  """
  keras.utils.set_random_seed(0)
  plain = keras.Sequential([keras.Input((DIM,))] + make_layers(), name=name)
  pipe = GPipeSequential(make_layers(), name=name, **pipe_kwargs)
  pipe.build((None, DIM))
  pipe.set_weights(plain.get_weights())
  return plain, pipe


def OutputsAndGradients(model, x, mode):
  """The model's training output and d(sum y^2)/d(weights, x)."""

  def Step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = model(x, training=True)
      loss = tf.reduce_sum(y * y)
    return [y] + tape.gradient(loss, model.trainable_variables + [x])

  if mode != 'eager':
    Step = tf.function(Step, jit_compile=mode == 'xla')
  return [np.asarray(t) for t in Step(tf.constant(x))]


@pytest.mark.parametrize('mode', ['eager', 'function', 'xla'])
@pytest.mark.parametrize('num_stages,num_micro_batches', SHAPES)
def testOutputsAndGradientsEqualSequential(num_stages, num_micro_batches,
                                           mode):
  plain, pipe = Models(DenseLayers, num_stages=num_stages,
                       num_micro_batches=num_micro_batches)
  x = Inputs()
  expected = OutputsAndGradients(plain, x, mode)
  actual = OutputsAndGradients(pipe, x, mode)
  assert len(actual) == 2 * NUM_LAYERS + 2
  engine_util.AssertTransparent(actual, expected)


@pytest.mark.parametrize('engine,remat', engine_util.ENGINE_REMAT_MODES)
def testEveryEngineAndRematModeIsTransparent(engine, remat):
  plain, pipe = Models(DenseLayers, num_stages=4, num_micro_batches=4,
                       engine=engine, remat=remat, virtual_stages=2)
  x = Inputs()
  engine_util.AssertTransparent(OutputsAndGradients(pipe, x, 'function'),
                                OutputsAndGradients(plain, x, 'function'))


def testVariablesAreTheLayersOwnWithSequentialPaths():
  plain, pipe = Models(DenseLayers, num_stages=4, num_micro_batches=2)
  assert [v.path for v in pipe.weights] == [v.path for v in plain.weights]
  assert [v.path for v in pipe.weights][:2] == ['body/dense0/kernel',
                                                'body/dense0/bias']
  layer_vars = [v for layer in pipe.layers for v in layer.weights]
  assert [id(v) for v in pipe.weights] == [id(v) for v in layer_vars]


def testEvalAndPredictEqualSequential():
  plain, pipe = Models(DenseLayers, num_stages=2, num_micro_batches=4)
  x = Inputs()
  for training in (False, True):
    np.testing.assert_allclose(pipe(x, training=training),
                               plain(x, training=training), rtol=1e-5,
                               atol=1e-6)


def _Compiled(model_body, jit_compile, seed=0):
  model = keras.Sequential([keras.Input((DIM,)), model_body,
                            keras.layers.Dense(1, name='head')])
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss='mse',
                jit_compile=jit_compile)
  return model


@pytest.mark.parametrize('num_stages,num_micro_batches,jit_compile', [
    (2, 4, False), (4, 8, False),
    pytest.param(2, 4, True, marks=pytest.mark.slow)])
def testThreeFitStepsLeaveTheSameWeights(num_stages, num_micro_batches,
                                         jit_compile):
  plain_body, pipe_body = Models(DenseLayers, num_stages=num_stages,
                                 num_micro_batches=num_micro_batches)
  plain = _Compiled(plain_body, jit_compile)
  pipe = _Compiled(pipe_body, jit_compile)
  pipe.set_weights(plain.get_weights())
  x, y = Inputs(3 * BATCH), Inputs(3 * BATCH, 1, seed=1)
  before = plain.get_weights()
  for model in (plain, pipe):
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  after = plain.get_weights()
  assert max(np.max(np.abs(a - b)) for a, b in zip(after, before)) > 1e-3
  engine_util.AssertTransparent(pipe.get_weights(), after)
  # evaluate and predict split batches as fit does (a partial last batch:
  # 40 rows in batches of 8).
  np.testing.assert_allclose(
      pipe.predict(x[:40], batch_size=8, verbose=0),
      plain.predict(x[:40], batch_size=8, verbose=0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      pipe.evaluate(x, y, batch_size=BATCH, verbose=0),
      plain.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5)


def testFunctionalModel():
  plain_body, pipe_body = Models(DenseLayers, num_stages=4,
                                 num_micro_batches=2)

  def Functional(body):
    inputs = keras.Input((DIM,))
    return keras.Model(inputs, keras.layers.Add()([body(inputs), inputs]))

  plain, pipe = Functional(plain_body), Functional(pipe_body)
  x = Inputs()
  engine_util.AssertTransparent(OutputsAndGradients(pipe, x, 'function'),
                                OutputsAndGradients(plain, x, 'function'))


def _ChunkCallDevices(function, *args):
  """{chunk: ['CPU:k', ...]} of the chunk calls in the traced `function`."""
  graph = function.get_concrete_function(*args).graph
  devices = collections.defaultdict(set)
  for op in graph.get_operations():
    match = re.search(r'chunk(\d+)', op.name)
    if match and op.type in ('StatefulPartitionedCall', 'PartitionedCall'):
      spec = tf.DeviceSpec.from_string(op.device)
      devices[int(match.group(1))].add(
          f'{spec.device_type}:{spec.device_index}')
  return {k: sorted(v) for k, v in devices.items()}


def testStagesRunOnDistinctDevices():
  _, pipe = Models(DenseLayers, num_stages=4, num_micro_batches=4)
  assert pipe.StageDevices() == [f'/device:CPU:{k}' for k in range(4)]

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(pipe(x, training=True))
    return tape.gradient(loss, pipe.trainable_variables)

  assert _ChunkCallDevices(Step, tf.constant(Inputs())) == {
      k: [f'CPU:{k}'] for k in range(4)}


def _DropoutLayers():
  return [
      keras.layers.Dense(DIM, activation='tanh', name='dense0'),
      keras.layers.Dropout(0.5, seed=7, name='drop0'),
      keras.layers.Dense(DIM, activation='tanh', name='dense1'),
      keras.layers.Dropout(0.5, seed=8, name='drop1'),
      keras.layers.Dense(DIM, name='dense2'),
  ]


def _SeedStates(layers):
  return [v.numpy() for layer in layers for v in layer.non_trainable_variables]


@pytest.mark.parametrize(
    'mode', ['function', pytest.param('xla', marks=pytest.mark.slow)])
def testDropoutReplaysExactlyInTheRecompute(mode):
  """Same seeds, same masks: remat 'always' and 'never' agree exactly."""
  results = {}
  for remat in ('always', 'never', 'except_last'):
    _, pipe = Models(_DropoutLayers, num_stages=2, num_micro_batches=4,
                     remat=remat)
    seeds = _SeedStates(pipe.layers)
    results[remat] = OutputsAndGradients(pipe, Inputs(), mode)
    # Each of the 4 micro-batches advanced each seed generator once.
    for before, after in zip(seeds, _SeedStates(pipe.layers)):
      np.testing.assert_array_equal(after - before, [0, 4])
  # Bit for bit in a graph. Under XLA (the loop engine, whose calls that
  # keep their activations run TensorFlow's split of the forward and its
  # gradient instead of a recompute) the fused kernels may round the same
  # values differently in the last bit: the masks are still the same.
  compare = (np.testing.assert_array_equal if mode == 'function' else
             lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                     atol=1e-6))
  for always, never in zip(results['always'], results['never']):
    compare(always, never)
  for always, except_last in zip(results['always'], results['except_last']):
    compare(always, except_last)
  # The masks are real: about half of the hidden units are zeroed.
  plain, _ = Models(_DropoutLayers)
  no_dropout = OutputsAndGradients(plain, Inputs(), mode)
  assert np.max(np.abs(results['always'][0] - no_dropout[0])) > 0.1


def _BatchNormLayers(nested=False):
  bn = keras.layers.BatchNormalization(momentum=0.9, name='bn')
  inner = keras.Sequential([keras.layers.Dense(DIM, name='inner_dense'), bn],
                           name='block') if nested else bn
  return [
      keras.layers.Dense(DIM, name='dense0'),
      inner,
      keras.layers.Dense(DIM, activation='tanh', name='dense1'),
  ]


def _MovingStats(model):
  return [v.numpy() for v in model.non_trainable_variables
          if 'moving' in v.path]


@pytest.mark.parametrize('nested', [False, True])
@pytest.mark.parametrize('num_micro_batches', [1, 4])
def testBatchNormUpdatesOncePerStepFromTheWholeBatch(num_micro_batches,
                                                     nested):
  """Moving statistics as the plain layer's after a whole-batch step."""
  x = Inputs() * 3 + 1
  plain, pipe = Models(lambda: _BatchNormLayers(nested), num_stages=3,
                       num_micro_batches=num_micro_batches)
  y = pipe(x, training=True)
  y_plain = plain(x, training=True)
  moving, moving_plain = _MovingStats(pipe), _MovingStats(plain)
  assert len(moving) == 2
  assert np.max(np.abs(moving_plain[0])) > 0.05  # The mean moved.
  engine_util.AssertTransparent(moving, moving_plain)
  # Training normalizes each micro-batch with its own statistics.
  parts = np.split(x, num_micro_batches)
  _, per_micro = Models(lambda: _BatchNormLayers(nested))
  per_micro.set_weights(plain.get_weights())
  per_micro.set_weights(pipe.get_weights())  # Any moving stats: unused.
  expected = np.concatenate(
      [per_micro(p, training=True) for p in parts]) if (
          num_micro_batches > 1) else y_plain
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  # Inference uses the moving statistics, as the plain model does.
  np.testing.assert_allclose(pipe(x, training=False),
                             plain(x, training=False), rtol=1e-5, atol=1e-5)


def testBatchNormGradientsDoNotDependOnRemat():
  x = Inputs() * 3 + 1
  results = []
  for remat in ('always', 'never'):
    _, pipe = Models(_BatchNormLayers, num_stages=3, num_micro_batches=4,
                     remat=remat)
    results.append(OutputsAndGradients(pipe, x, 'function') +
                   _MovingStats(pipe))
  engine_util.AssertTransparent(results[0], results[1], tol=1e-6)


def testBatchNormInFit():
  """Moving statistics after a fit step: one update from the whole batch.

  One step: after it, the pipelined model's weights differ from the plain
  model's (training normalized micro-batches, not the whole batch).
  """
  plain_body, pipe_body = Models(_BatchNormLayers, num_stages=3,
                                 num_micro_batches=4)
  plain, pipe = _Compiled(plain_body, False), _Compiled(pipe_body, False)
  pipe.set_weights(plain.get_weights())
  x, y = Inputs() * 2 + 1, Inputs(BATCH, 1, seed=1)
  for model in (plain, pipe):
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  assert np.max(np.abs(_MovingStats(plain)[0])) > 0.05
  engine_util.AssertTransparent(_MovingStats(pipe), _MovingStats(plain))


def _MixedLayers():
  return [
      keras.layers.Dense(DIM, name='dense0'),
      keras.layers.BatchNormalization(name='bn'),
      keras.layers.Dense(DIM, activation='tanh', name='dense1'),
      keras.layers.Dropout(0.2, seed=5, name='dropout'),
      keras.layers.Dense(DIM, name='dense2'),
  ]


def testSaveAtFourStagesLoadAtTwo(tmp_path):
  x = Inputs()
  plain_body, four = Models(_MixedLayers, num_stages=4, num_micro_batches=4)
  model = _Compiled(four, False)
  model.fit(x, Inputs(BATCH, 1, seed=1), batch_size=BATCH, verbose=0)
  expected = model.predict(x, verbose=0)
  # save_weights / load_weights into another pipeline shape.
  path = str(tmp_path / 'four.weights.h5')
  model.save_weights(path)
  _, two = Models(_MixedLayers, num_stages=2, num_micro_batches=2)
  other = _Compiled(two, False)
  # Its head is a fresh Dense; the body has the weights before the step.
  assert np.max(np.abs(other.predict(x, verbose=0) - expected)) > 1e-3
  other.load_weights(path)
  np.testing.assert_allclose(other.predict(x, verbose=0), expected,
                             rtol=1e-6)
  # The whole model: config and weights.
  keras_path = str(tmp_path / 'four.keras')
  model.save(keras_path)
  loaded = keras.models.load_model(keras_path)
  assert loaded.layers[0].num_stages == 4
  assert loaded.layers[0].partition == [2, 1, 1, 1]
  np.testing.assert_allclose(loaded.predict(x, verbose=0), expected,
                             rtol=1e-6)
  # Weights of a .keras file into another shape, and into the plain model.
  third = _Compiled(Models(_MixedLayers, num_stages=2)[1], False)
  third.load_weights(keras_path)
  np.testing.assert_allclose(third.predict(x, verbose=0), expected,
                             rtol=1e-5, atol=1e-6)
  plain = _Compiled(plain_body, False)
  plain.set_weights(model.get_weights())
  np.testing.assert_allclose(plain.predict(x, verbose=0), expected,
                             rtol=1e-5, atol=1e-6)


def testPartitionByParams():
  layers = [keras.layers.Dense(d, name=f'dense{i}')
            for i, d in enumerate([64, 64, 8, 8, 8, 8])]
  pipe = GPipeSequential(layers, num_stages=2, partition='params')
  assert pipe.partition is None
  pipe.build((None, 64))
  # 4160 + 4160 | 520 + 72 * 3: the two large layers alone, then the rest.
  assert pipe.partition == [1, 5]


class _Heavy(keras.layers.Layer):
  """No weights, much work: 16 matmuls with a constant."""

  def call(self, x):
    w = tf.constant(np.eye(x.shape[-1], dtype=np.float32) * 0.5)
    for _ in range(16):
      x = tf.tanh(tf.matmul(x, w))
    return x


def testPartitionByProfile():
  """Timed costs see the weightless heavy layers that 'params' ignores."""

  def Layers():
    return [_Heavy(name='heavy0'), _Heavy(name='heavy1'),
            keras.layers.Dense(256, name='dense0'),
            keras.layers.Dense(256, name='dense1')]

  by_params = GPipeSequential(Layers(), num_stages=2, partition='params')
  by_params.build((None, 256))
  assert by_params.partition == [3, 1]
  pipe = GPipeSequential(Layers(), num_stages=2, num_micro_batches=2,
                         partition='profile')
  model = keras.Sequential([keras.Input((256,), batch_size=512), pipe])
  assert pipe.partition is None
  model(np.ones([512, 256], np.float32), training=True)
  assert pipe.partition == [1, 3]
  # Without a static batch size there is no micro-batch to time.
  dynamic = GPipeSequential(Layers(), num_stages=2, partition='profile')
  dynamic.build((None, 256))

  @tf.function(input_signature=[tf.TensorSpec([None, 256])])
  def Call(x):
    return dynamic(x, training=True)

  with pytest.raises(ValueError, match="partition='profile' .* needs a "
                     'static batch size'):
    Call(np.ones([4, 256], np.float32))


def testCompiledByXlaPicksTheLoopEngine():
  _, pipe = Models(DenseLayers, num_stages=2, num_micro_batches=4)
  chosen = {}
  for jit in (False, True):

    @tf.function(jit_compile=jit)
    def Engine():
      return tf.constant(0)

    Engine.get_concrete_function()

    @tf.function(jit_compile=jit)
    def Choose(x):
      chosen[jit] = pipe.Engine(4)
      return x

    Choose.get_concrete_function(tf.constant(0))
  assert chosen == {False: 'unrolled', True: 'loop'}


@pytest.mark.parametrize('kwargs,message', [
    ({'layers': []}, 'layers is empty'),
    ({'layers': 'dense'}, "layers='dense' must be a list of Keras layers"),
    ({'partition': 'flops'}, "partition='flops' needs Lingvo's FPropMeta"),
    ({'partition': 'time'}, "partition='time' is not supported"),
    ({'num_stages': 9}, 'num_stages=9'),
    ({'remat': 'sometimes'}, "remat='sometimes'"),
    ({'engine': 'unrolled', 'schedule': '1f1b'},
     "schedule='1f1b' is not supported with engine='unrolled'"),
    ({'num_micro_batches': 0}, 'num_micro_batches=0 must be a positive int'),
    ({'devices': ['/cpu:0']}, r"devices=\['/cpu:0'\] must be a list of 2"),
    ({'schedule': 'pipedream'}, "schedule='pipedream' is not supported"),
    ({'virtual_stages': 3, 'num_stages': 4}, 'virtual_stages=3'),
])
def testErrorsNameTheParameter(kwargs, message):
  kwargs = dict({'layers': DenseLayers(), 'num_stages': 2}, **kwargs)
  with pytest.raises(ValueError, match=message):
    GPipeSequential(**kwargs)


def testDuplicateLayerNames():
  layers = [keras.layers.Dense(DIM, name='same') for _ in range(2)]
  with pytest.raises(ValueError, match=r"^layers: the cell names "
                     r"\['same', 'same'\] must be unique .* repeated: "
                     r"\['same'\]"):
    GPipeSequential(layers)


def testBatchThatMDoesNotDivide():
  _, pipe = Models(DenseLayers, num_stages=2, num_micro_batches=3)
  with pytest.raises(ValueError, match='num_micro_batches=3 does not divide '
                     r'the batch size 16; valid values are \[1, 2, 4, 8, 16\]'):
    pipe(Inputs(), training=True)

  @tf.function(input_signature=[tf.TensorSpec([None, DIM])])
  def Dynamic(x):
    return pipe(x, training=True)

  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='num_micro_batches=3 must divide the batch size'):
    Dynamic(Inputs())


@pytest.mark.parametrize('make_layer,message', [
    (lambda: keras.layers.BatchNormalization(renorm=True, name='bn'),
     "'bn' .*renorm=True.*use renorm=False"),
    (lambda: keras.layers.BatchNormalization(synchronized=True, name='bn'),
     "'bn' .*synchronized=True.*use synchronized=False"),
    (lambda: keras.layers.ActivityRegularization(l1=0.1, name='reg'),
     "'reg' .*has an activity regularizer"),
    (lambda: keras.Sequential(
        [keras.layers.Dense(DIM, activity_regularizer='l2', name='inner')],
        name='block'),
     "'inner' .*inside 'block'.*has an activity regularizer"),
])
def testUnsupportedLayersRaiseAtConstruction(make_layer, message):
  with pytest.raises(ValueError, match=message):
    GPipeSequential([keras.layers.Dense(DIM, name='dense'), make_layer()],
                    num_stages=2)


class _AddsLoss(keras.layers.Layer):

  def call(self, x):
    self.add_loss(tf.reduce_sum(x))
    return x


@pytest.mark.parametrize('make_layer,message', [
    (lambda: _AddsLoss(name='adds'), "'adds' .*adds losses in its call"),
    (lambda: keras.layers.Embedding(4, DIM, mask_zero=True, name='emb'),
     "'emb' .*returns a mask"),
])
def testUnsupportedCallsRaise(make_layer, message):
  pipe = GPipeSequential([make_layer(), keras.layers.Dense(DIM, name='dense')],
                         num_stages=2)
  pipe.build((None, DIM))
  with pytest.raises(ValueError, match=message):
    pipe(np.ones([BATCH, DIM], np.float32), training=True)


def testFrozenBatchNormIsAConstant():
  """trainable=False: inference normalization, statistics unchanged."""
  plain, pipe = Models(_BatchNormLayers, num_stages=3, num_micro_batches=4)
  for model in (plain, pipe):
    for layer in model.layers:
      if isinstance(layer, keras.layers.BatchNormalization):
        layer.trainable = False
  x = Inputs() * 3 + 1
  before = _MovingStats(pipe)
  engine_util.AssertTransparent(OutputsAndGradients(pipe, x, 'function'),
                                OutputsAndGradients(plain, x, 'function'))
  for a, b in zip(_MovingStats(pipe), before):
    np.testing.assert_array_equal(a, b)


def testMirroredStrategyRunsOnePipelinePerReplica():
  """2 replicas x 2 stages on 4 CPUs: fit as the plain model does."""
  # Not the default collective all-reduce: a process's collective instance
  # keys restart with every strategy, so a later strategy's all-reduce (as
  # in scaleout_test) would meet this one's cached shapes and fail.
  strategy = tf.distribute.MirroredStrategy(
      ['/cpu:0', '/cpu:2'],
      cross_device_ops=tf.distribute.ReductionToOneDevice())
  x, y = Inputs(2 * BATCH), Inputs(2 * BATCH, 1, seed=1)
  weights = {}
  with strategy.scope():
    plain_body, pipe_body = Models(DenseLayers, num_stages=2,
                                   num_micro_batches=4)
    models = {'plain': _Compiled(plain_body, False),
              'pipe': _Compiled(pipe_body, False)}
  models['pipe'].set_weights(models['plain'].get_weights())
  for name, model in models.items():
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    weights[name] = model.get_weights()
  engine_util.AssertTransparent(weights['pipe'], weights['plain'])

  @tf.function
  def Step(x):
    return strategy.run(lambda x: pipe_body(x, training=True), args=(x,))

  # Replica r runs stage k on CPU:(2 r + k).
  assert _ChunkCallDevices(Step, tf.constant(x[:8])) == {
      0: ['CPU:0', 'CPU:2'], 1: ['CPU:1', 'CPU:3']}
