"""Tests of the U-Net of params/image.py: skip connections across stages.

`image.ShapesUNet` segments the generated shape images with a U-Net whose two
long skips cross pipeline stages. The tiny variant's training step at K = 4
equals the same model's at K = 1 (same M: batch norm normalizes per
micro-batch), and `tools/train.py` trains it as the docs show.
"""

import re

from absl.testing import flagsaver
import numpy as np
import pytest
from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import cluster_factory
from lingvo.core import tshape

from lingvo_gpipe import GPipeSequentialLayer
from lingvo_gpipe import costs as costs_lib
from lingvo_gpipe import partition as partition_lib
from lingvo_gpipe.planning import config
from params import image
import engine_util
import tool_util

SEED = 7
TINY = image.ShapesUNetTiny()
CELLS = ['stem', 'down1', 'down2', 'mid', 'up1', 'up0', 'head']


@pytest.fixture(autouse=True)
def _no_lingvo_asserts():
  """Lingvo's graph asserts cost graph building time per batch norm."""
  with flagsaver.flagsaver(enable_asserts=False):
    yield


@pytest.mark.parametrize('name', ['image.ShapesUNet', 'image.ShapesUNetTiny'])
def test_registered_params(name):
  """7 cells, two skips, 4 stages, 4 micro-batches, dev set apart."""
  train = model_registry.GetParams(name, 'Train')
  dev = model_registry.GetParams(name, 'Dev')
  stack = train.task.stack
  assert stack.cls is GPipeSequentialLayer
  assert [c.name for c in stack.cell_tpl] == CELLS
  assert stack.skips == [('stem', 'up0'), ('down1', 'up1')]
  assert (stack.num_stages, stack.num_micro_batches) == (4, 4)
  assert stack.cell_tpl[-1].num_classes == len(image.SHAPES) + 1
  assert train.input.data_seed != dev.input.data_seed
  assert dev.task.eval.samples_per_summary == dev.input.num_samples


def test_full_model_skips_cross_stages():
  """By flops, [3, 1, 1, 2]: both skips leave CPU:0 and pass stage 1."""
  model = image.ShapesUNet()
  p = model.Task().stack
  shape = [model.BATCH_SIZE // 4, model.IMAGE_SIZE, model.IMAGE_SIZE, 3]
  with cluster_factory.SetEval(True):
    cells = [c.Instantiate() for c in p.cell_tpl]
    # FPropMeta's shapes are FProp's (an UpCell gets its skip in FProp).
    x, outputs, meta_shape = tf.zeros(shape), {}, tshape.Shape(shape)
    for cell in cells:
      meta = cell.params.cls.FPropMeta(cell.params, meta_shape)
      skip = {'up1': 'down1', 'up0': 'stem'}.get(cell.params.name)
      args = (x,) if skip is None else (x, outputs[skip])
      x = outputs[cell.params.name] = cell.FProp(cell.theta, *args)
      meta_shape = meta.out_shapes[0]
      assert meta_shape.ToTensorShape().as_list() == x.shape.as_list()
  assert x.shape.as_list() == shape[:3] + [len(image.SHAPES) + 1]
  flops = costs_lib.CellCosts(cells, 'flops', input_shapes=shape)
  counts = partition_lib.PartitionCosts(flops, 4)
  assert counts == [3, 1, 1, 2]
  skips = config.ChunkSkips(config.CheckSkips(CELLS, p.skips), counts)
  assert skips.chunk_skips == [(0, 3), (0, 2)]


def test_segmentation_input():
  """`segment` is 1 + label on the shape, 0 elsewhere; image as ShapesInput."""
  p = TINY.Dev()
  batch = p.Instantiate().GetPreprocessedInputBatch()
  plain = image.ShapesInput.Params().Set(
      **{k: v for k, v in p.IterParams() if k != 'cls'})
  plain_batch = plain.Instantiate().GetPreprocessedInputBatch()
  np.testing.assert_array_equal(batch.image.numpy(), plain_batch.image.numpy())
  segment, label = batch.segment.numpy(), batch.label.numpy()
  assert segment.shape == (TINY.BATCH_SIZE, 8, 8)
  for s, l in zip(segment, label):
    assert set(np.unique(s)) == {0, l + 1}
  # The shape's pixels differ from the background's colour.
  on = segment > 0
  assert 0.05 < on.mean() < 0.6


def _TrainStep(num_stages):
  """Metrics and gradients of one step of the tiny U-Net at K, M = 4."""
  graph = tf.Graph()
  config_proto = engine_util.SessionConfig()
  config_proto.graph_options.rewrite_options.disable_meta_optimizer = True
  with graph.as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4):
    tf.random.set_seed(SEED)
    p = TINY.Task()
    p.input = TINY.Train().Set(num_samples=TINY.BATCH_SIZE, shuffle=False)
    p.stack.Set(num_stages=num_stages, partition='uniform' if num_stages == 1
                else 'flops')
    task = p.Instantiate()
    metrics, _ = task.FPropDefaultTheta()
    variables = [v for v in task.vars.Flatten() if v.trainable]
    grads = tf.gradients(metrics['loss'][0], variables)
    names = ('loss', 'accuracy', 'shape_accuracy', 'iou')
    fetches = [metrics[n][0] for n in names] + grads
    with tf.Session(graph=graph, config=config_proto) as sess:
      sess.run(tf.global_variables_initializer())
      return sess.run(fetches), task.stack.partition


def test_four_stages_equal_one_stage():
  """The skips cross stages; loss, metrics and gradients are unchanged."""
  (four, partition), (one, _) = _TrainStep(4), _TrainStep(1)
  assert partition == [3, 2, 1, 1]
  engine_util.AssertTransparent(four, one)


def _Logits(stack_params):
  """Logits of the tiny U-Net stack on zeros, in eval (no batch statistics)."""
  with tf.Graph().as_default(), cluster_factory.SetEval(True):
    stack = stack_params.Instantiate()
    return stack.FProp(stack.theta, tf.zeros([4, 8, 8, 3]))


def test_without_skips_for_comparison():
  """The documented no-skip variant builds; a mismatched skip raises."""
  p = TINY.Task().stack
  p.skips = []
  for cell in p.cell_tpl[4:6]:
    cell.skip_dim = 0
  assert _Logits(p).shape.as_list() == [4, 8, 8, len(image.SHAPES) + 1]
  p.cell_tpl[5].skip_dim = 4
  with pytest.raises(ValueError, match=(
      r"up0: skip_dim=4 but FProp got no skip; the pipeline's skips must "
      r"bring one to 'up0' exactly when skip_dim > 0")):
    _Logits(p)


@pytest.mark.slow
def test_documented_command_trains_tiny(tmp_path):
  """docs/training.md's command, on the tiny variant: loss falls, eval runs."""
  runs = tool_util.RunToolInParallel('train.py', {'unet': [
      '--model=image.ShapesUNetTiny', '--num_devices=4',
      '--logdir={tmp}/unet', '--job=trainer_client,evaler_dev'
  ]}, str(tmp_path), timeout=900)
  code, stdout, stderr = runs['unet']
  assert code == 0, stderr[-3000:]
  match = re.search(r'trained image.ShapesUNetTiny: steps=20 loss ([\d.]+) -> '
                    r'([\d.]+)', stdout)
  assert match, stdout
  first, last = map(float, match.groups())
  assert last < 0.8 * first
  assert re.search(r'eval_dev image.ShapesUNetTiny at step 20: .*'
                   r'shape_accuracy [\d.]+', stdout), stdout
