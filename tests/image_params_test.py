"""Tests of params/image.py: a GPipe ResNet on generated images of shapes.

The tiny registered model (`image.ShapesResNetTiny`, 4 cells) trains as a
real Lingvo `BaseTask` in graph mode on a worker with four CPU devices, so
that stage k runs on CPU:k, and its checkpoint is evaluated on the dev set.
"""

import collections
import re

from absl.testing import flagsaver
import numpy as np
import pytest
from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import cluster_factory
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_gpipe import BatchNormLayer
from lingvo_gpipe import GPipeSequentialLayer
from lingvo_gpipe import costs as costs_lib
from lingvo_gpipe import partition as partition_lib
from params import image
import engine_util

SEED = 7  # Graph seed: the same initial variables in every graph.
NUM_STEPS = 20
TINY = image.ShapesResNetTiny()
TINY_CELLS = ('stem', 'block0_0', 'block1_0', 'head')


@pytest.fixture(autouse=True)
def _no_lingvo_asserts():
  """Lingvo's graph asserts cost graph building time per batch norm."""
  with flagsaver.flagsaver(enable_asserts=False):
    yield


def _Cluster(do_eval=False):
  """One trainer with a model split of four CPU devices (stage k on CPU:k)."""
  return cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4,
      do_eval=do_eval)


def _BuildTask(input_params, num_stages, num_micro_batches):
  """The tiny model's task in the default graph, FProp (and BProp) built.

  Args:
    input_params: The input generator's Params.
    num_stages: K.
    num_micro_batches: M.

  Returns:
    The task.
  """
  tf.random.set_seed(SEED)
  p = TINY.Task()
  p.input = input_params
  p.stack.Set(num_stages=num_stages, num_micro_batches=num_micro_batches)
  task = p.Instantiate()
  task.FPropDefaultTheta()
  if not task.do_eval:
    task.BProp()
  return task


def _OneBatchTrainInput():
  """The training set cut to one batch: every step sees the same images."""
  return TINY.Train().Set(num_samples=TINY.BATCH_SIZE)


def _BatchNorms(task):
  """{path: layer} of the task's BatchNormLayers."""
  found, stack = {}, [task]
  while stack:
    layer = stack.pop()
    if isinstance(layer, BatchNormLayer):
      found[layer.path] = layer
    stack.extend(py_utils.Flatten(layer.children))
  return found


def _MovingStats(task):
  """{path: [moving_mean, moving_variance]} of every batch norm."""
  return {
      path: [bn.vars.moving_mean, bn.vars.moving_variance]
      for path, bn in _BatchNorms(task).items()
  }


def _TrainOneStep(num_stages, num_micro_batches):
  """Moving statistics after one training step of the tiny model (K, M).

  Grappler is off: it does not change these numbers, and optimizing the
  graph for a single step would take most of the test's time.

  Args:
    num_stages: K.
    num_micro_batches: M.

  Returns:
    {path: [moving_mean, moving_variance]} as numpy arrays.
  """
  graph = tf.Graph()
  config = engine_util.SessionConfig()
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  with graph.as_default(), _Cluster():
    task = _BuildTask(_OneBatchTrainInput(), num_stages, num_micro_batches)
    stats = _MovingStats(task)
    with tf.Session(graph=graph, config=config) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(task.train_op)
      return sess.run(stats)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """The tiny model, K=4 and M=4, trained NUM_STEPS steps on one batch.

  Args:
    tmp_path_factory: pytest's, for the checkpoint.

  Returns:
    A NestedMap: losses and accuracies (per step, of the batch the step
    trains on), stats_after_one_step ({path: [mean, variance]}), step_stats
    (of the first step), graph, partition and checkpoint (a path).
  """
  graph = tf.Graph()
  with graph.as_default(), _Cluster():
    task = _BuildTask(_OneBatchTrainInput(), num_stages=4, num_micro_batches=4)
    stats = _MovingStats(task)
    metrics = [task.eval_metrics[name][0] for name in ('loss', 'accuracy')]
    saver = tf.train.Saver()
    checkpoint = str(tmp_path_factory.mktemp('shapes') / 'ckpt')
    result = py_utils.NestedMap(graph=graph, partition=task.stack.partition)
    with tf.Session(graph=graph, config=engine_util.SessionConfig()) as sess:
      sess.run(tf.global_variables_initializer())
      metadata = tf.RunMetadata()
      _, first = sess.run(
          [task.train_op, metrics],
          options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
          run_metadata=metadata)
      result.step_stats = metadata.step_stats
      result.stats_after_one_step = sess.run(stats)
      steps = [first] + [
          sess.run([task.train_op, metrics])[1] for _ in range(NUM_STEPS - 1)
      ]
      result.losses, result.accuracies = np.array(steps).T
      result.checkpoint = saver.save(sess, checkpoint)
  return result


@pytest.mark.slow
def test_tiny_model_trains_with_decreasing_loss(trained):
  """A Lingvo train_op of the K=4, M=4 tiny model fits its one batch.

  Its accuracy on that batch goes from chance (1/6) to at least 3x chance
  (measured: 0.16 at the first step, 0.69 over the last three).

  Args:
    trained: The fixture.
  """
  losses = trained.losses
  assert len(losses) == NUM_STEPS and np.all(np.isfinite(losses))
  assert 1.5 < losses[0] < 2.5  # About ln(6) = 1.79 at initialization.
  assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses
  chance = 1 / len(image.SHAPES)
  assert trained.accuracies[0] < 2 * chance, trained.accuracies
  assert np.mean(trained.accuracies[-3:]) > 3 * chance, trained.accuracies
  assert trained.partition == [1, 1, 1, 1]


@pytest.mark.slow
def test_stage_k_runs_on_cpu_k(trained):
  """Stage calls are placed on CPU:k, and cell k's kernels ran there.

  Each of the tiny model's 4 cells is one stage. Its forward convolutions ran
  2M times (M forwards, M recomputes), its filter gradients M times.

  Args:
    trained: The fixture.
  """
  call_devices = collections.defaultdict(set)
  for op in trained.graph.get_operations():
    match = re.search(r'chunk(\d)', op.name)
    if match and op.type in ('StatefulPartitionedCall', 'PartitionedCall'):
      call_devices[int(match.group(1))].add(op.device)
  assert {k: sorted(v) for k, v in call_devices.items()} == {
      k: [f'/job:localhost/replica:0/task:0/device:CPU:{k}'] for k in range(4)
  }
  kernel_devices = collections.defaultdict(set)
  stem_runs = collections.Counter()
  for dev in trained.step_stats.dev_stats:
    device = int(re.search(r'CPU:(\d+)$', dev.device).group(1))
    for node in dev.node_stats:
      cell = re.search(r'\b(%s)/' % '|'.join(TINY_CELLS), node.node_name)
      # Op types differ with oneDNN: _MklNativeConv2D or Conv2D.
      kernel = re.search(r'= \w*?(Conv2D\w*|MatMul)\(', node.timeline_label)
      if cell and kernel:
        kernel_devices[cell.group(1)].add(device)
        if cell.group(1) == 'stem':
          stem_runs[kernel.group(1)] += 1
  assert dict(kernel_devices) == {
      cell: {k} for k, cell in enumerate(TINY_CELLS)
  }
  assert stem_runs['Conv2D'] == 2 * 4
  assert stem_runs['Conv2DBackpropFilter'] == 4


@pytest.mark.slow
def test_moving_stats_after_one_step_match_one_stage(trained):
  """Batch norm moving statistics do not depend on the pipeline's shape.

  Against K=1, M=4 every batch norm's moving mean and variance after the
  first step match. Against K=1, M=1 the stem's do; the others cannot:
  training normalizes each micro-batch with its own statistics, so from the
  second batch norm on, the inputs (and their mini-batch moments) change
  with M.

  Args:
    trained: The fixture.
  """
  pipelined = trained.stats_after_one_step
  one_stage = _TrainOneStep(num_stages=1, num_micro_batches=4)
  plain = _TrainOneStep(num_stages=1, num_micro_batches=1)
  assert len(pipelined) == 6
  assert sorted(one_stage) == sorted(pipelined) == sorted(plain)
  pairs = [(pipelined[path], one_stage[path]) for path in pipelined]
  stem = [path for path in pipelined if '.stem.' in path]
  assert len(stem) == 1
  pairs.append((pipelined[stem[0]], plain[stem[0]]))
  for (mean, variance), (expected_mean, expected_variance) in pairs:
    # Updated once from the initial 0 and 1 with decay 0.9.
    assert np.abs(expected_mean).max() > 1e-3
    assert np.abs(expected_variance - 1.0).max() > 1e-3
    assert engine_util.RelErr(mean, expected_mean) < 1e-5
    assert engine_util.RelErr(variance, expected_variance) < 1e-5


@pytest.mark.slow
def test_dev_eval_uses_the_moving_stats(trained):
  """Eval of the trained checkpoint on the dev set reads the moving stats.

  Two passes over the dev set give the same numbers, the moving statistics
  stay as trained, and loading the initial ones changes the loss. Dev
  accuracy is not compared with chance: 20 steps on one batch of 32 images
  do not generalize (measured 0.20 against 1/6); that the accuracy metric
  beats chance on the batch the model fits is checked in
  test_tiny_model_trains_with_decreasing_loss.

  Args:
    trained: The fixture.
  """
  graph = tf.Graph()
  with graph.as_default(), _Cluster(do_eval=True):
    task = _BuildTask(TINY.Dev(), num_stages=4, num_micro_batches=4)
    metrics = task.eval_metrics
    stats = _MovingStats(task)
    num_batches = task.params.eval.samples_per_summary // TINY.BATCH_SIZE
    with tf.Session(graph=graph, config=engine_util.SessionConfig()) as sess:
      tf.train.Saver().restore(sess, trained.checkpoint)
      before = sess.run(stats)
      passes = [[sess.run(metrics) for _ in range(num_batches)]
                for _ in range(2)]
      after = sess.run(stats)
      for mean, variance in stats.values():
        mean.load(np.zeros(mean.shape.as_list(), np.float32), sess)
        variance.load(np.ones(variance.shape.as_list(), np.float32), sess)
      reset = [sess.run(metrics) for _ in range(num_batches)]
  assert num_batches == 2
  for batch in passes[0]:
    assert batch['num_samples_in_batch'][0] == TINY.BATCH_SIZE
    for name in ('loss', 'accuracy'):
      assert batch[name][1] == TINY.BATCH_SIZE
  for first, second in zip(*passes):
    assert first['loss'][0] == second['loss'][0]
    assert first['accuracy'][0] == second['accuracy'][0]
  for path in before:
    np.testing.assert_array_equal(before[path], after[path])
    assert np.abs(before[path][0]).max() > 1e-3  # Trained, not initial.
  assert abs(reset[0]['loss'][0] - passes[0][0]['loss'][0]) > 1e-3


def test_input_same_in_graph_and_eager_mode():
  """Two batches from a TF1 session equal two from an eager tf.function.

  Both with the same global seed (a graph's, and eagerly TensorFlow's, which
  conftest.py sets for every test), from which the input's seeded ops draw.
  """
  p = TINY.Train()
  graph = tf.Graph()
  graph.seed = 1
  tf.random.set_seed(1)
  with graph.as_default():
    batch = p.Instantiate().GetPreprocessedInputBatch()
    with tf.Session(graph=graph) as sess:
      graph_batches = [sess.run(batch) for _ in range(2)]
  generator = p.Instantiate()
  next_batch = tf.function(generator.GetPreprocessedInputBatch,
                           autograph=False)
  eager_batches = [next_batch() for _ in range(2)]
  for graph_batch, eager_batch in zip(graph_batches, eager_batches):
    assert graph_batch.image.shape == (TINY.BATCH_SIZE, 8, 8, 3)
    assert graph_batch.image.dtype == np.float32
    assert graph_batch.label.shape == (TINY.BATCH_SIZE,)
    assert graph_batch.label.dtype == np.int32
    np.testing.assert_array_equal(graph_batch.image, eager_batch.image)
    np.testing.assert_array_equal(graph_batch.label, eager_batch.label)
  assert not np.array_equal(graph_batches[0].image, graph_batches[1].image)


def _Epoch(input_params):
  """(images, labels) of one pass over a set, read in eager mode."""
  generator = input_params.Instantiate()
  batches = [
      generator.GetPreprocessedInputBatch()
      for _ in range(input_params.num_samples // input_params.batch_size)
  ]
  return (np.concatenate([b.image.numpy() for b in batches]),
          np.concatenate([b.label.numpy() for b in batches]))


def test_train_and_dev_sets_are_disjoint_and_balanced():
  """One epoch of each set: distinct images, balanced labels."""
  train_images, train_labels = _Epoch(TINY.Train())
  dev_images, dev_labels = _Epoch(TINY.Dev())
  assert len(train_images) == TINY.TRAIN_SAMPLES
  assert len(dev_images) == TINY.DEV_SAMPLES
  # Dev is read in index order, label = index % classes; train is shuffled.
  np.testing.assert_array_equal(
      dev_labels, np.arange(TINY.DEV_SAMPLES) % len(image.SHAPES))
  assert not np.array_equal(
      train_labels, np.arange(TINY.TRAIN_SAMPLES) % len(image.SHAPES))
  counts = np.bincount(train_labels, minlength=len(image.SHAPES))
  assert counts.max() - counts.min() <= 1
  # No dev image is a train image; no two train images are the same.
  train = train_images.reshape(len(train_images), -1)
  dev = dev_images.reshape(len(dev_images), -1)
  assert np.abs(dev[:, None] - train[None]).max(axis=-1).min() > 0.1
  assert len(np.unique(train, axis=0)) == len(train)


@pytest.mark.parametrize('name',
                         ['image.ShapesResNet', 'image.ShapesResNetTiny'])
def test_registered_params(name):
  """Both models: 4 stages, 4 micro-batches, dev set apart and in order."""
  train = model_registry.GetParams(name, 'Train')
  dev = model_registry.GetParams(name, 'Dev')
  stack = train.task.stack
  assert stack.cls is GPipeSequentialLayer
  assert stack.num_stages == 4
  assert stack.num_micro_batches == 4
  assert stack.batch_dim == 0
  assert train.input.data_seed != dev.input.data_seed
  assert train.input.shuffle and not dev.input.shuffle
  # An eval summary covers the dev set exactly once.
  assert dev.task.eval.samples_per_summary == dev.input.num_samples
  assert dev.input.num_samples % dev.input.batch_size == 0


def test_cell_meta_matches_fprop_and_balances_four_stages():
  """FPropMeta's shapes are FProp's, and its flops give balanced stages."""
  model = image.ShapesResNet()
  shape = [model.BATCH_SIZE // 4, model.IMAGE_SIZE, model.IMAGE_SIZE, 3]
  with cluster_factory.SetEval(True):
    cells = [p.Instantiate() for p in model.Task().stack.cell_tpl]
    x = tf.zeros(shape)
    meta_shape = tshape.Shape(shape)
    for cell in cells:
      meta = cell.params.cls.FPropMeta(cell.params, meta_shape)
      x = cell.FProp(cell.theta, x)
      meta_shape = meta.out_shapes[0]
      assert meta_shape.ToTensorShape().as_list() == x.shape.as_list()
      assert meta.flops > 0
  assert x.shape.as_list() == [shape[0], len(image.SHAPES)]
  flops = costs_lib.CellCosts(cells, 'flops', input_shapes=shape)
  counts = partition_lib.PartitionCosts(flops, 4)
  stage_flops = [sum(flops[sum(counts[:k]):sum(counts[:k + 1])])
                 for k in range(4)]
  assert max(stage_flops) / (sum(flops) / 4) < 1.3
