r"""Registered FC stacks for the planner, e.g. `benchmarks.fc_model.FcStack`.

A GPipeSequentialLayer of Lingvo FCLayers (ReLU) regressing random inputs
onto a fixed random linear map of them, mean squared error, Lingvo's default
optimizer (Adam). The inputs come from a stateless generator seeded by the
global step, so no data files are needed. `FcStack`'s cells are uneven on
purpose (wide, then narrow), so that the partition matters, and one wide
cell's weights dominate its memory; `FcStackDeep` is many narrow cells on a
large batch, whose memory is mostly activations, the case re-materialization
and micro-batches are for:

    python tools/plan.py auto --model=benchmarks.fc_model.FcStack \
        --num_devices=2 --memory_per_device=128MiB

Registered under the key of this module (Lingvo's registry imports
`benchmarks.fc_model` from the repository root, which the tools put on
sys.path).
"""

from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import base_input_generator
from lingvo.core import base_model
from lingvo.core import base_model_params
from lingvo.core import layers
from lingvo.core import py_utils

from lingvo_gpipe import GPipeSequentialLayer


class RandomVectorInput(base_input_generator.BaseInputGenerator):
  """Random vectors [batch, dim] and targets: a fixed random map of them."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 64, 'Input and target size.')
    p.Define('data_seed', 7, 'Seed of the inputs (with the global step).')
    return p

  def _InputBatch(self):
    p = self.params
    step = tf.cast(py_utils.GetGlobalStep(), tf.int32)
    batch_size = self.InfeedBatchSize()
    x = tf.random.stateless_normal([batch_size, p.dim],
                                   seed=tf.stack([p.data_seed, step]))
    target_map = tf.random.stateless_normal(
        [p.dim, p.dim], seed=[p.data_seed, -1]) / (p.dim**0.5)
    return py_utils.NestedMap(x=x, y=tf.matmul(x, target_map))


class RegressionTask(base_model.BaseTask):
  """Mean squared error of `stack`'s output against the targets."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stack', GPipeSequentialLayer.Params(), 'The pipeline.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('stack', self.params.stack)

  def ComputePredictions(self, theta, input_batch):
    return py_utils.NestedMap(y=self.stack.FProp(theta.stack, input_batch.x))

  def ComputeLoss(self, theta, predictions, input_batch):
    loss = tf.reduce_mean(tf.square(predictions.y - input_batch.y))
    count = tf.cast(tf.shape(input_batch.y)[0], tf.float32)
    return {'loss': (loss, count)}, {}


def FcCells(dims):
  """FCLayers 'fc0', 'fc1', ... mapping dims[i] to dims[i + 1] (ReLU).

  The last cell is linear (no ReLU), so that it can regress any target.

  Args:
    dims: Sizes, the input first.

  Returns:
    A list of FCLayer Params.
  """
  cells = []
  for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
    cells.append(layers.FCLayer.Params().Set(
        name=f'fc{i}', input_dim=a, output_dim=b,
        activation='RELU' if i < len(dims) - 2 else 'NONE'))
  return cells


@model_registry.RegisterSingleTaskModel
class FcStack(base_model_params.SingleTaskModelParams):
  """8 FC cells, 512 wide with a 2048-wide middle, batch 256, 2 stages."""

  DIMS = (512, 512, 2048, 2048, 512, 512, 512, 512, 512)
  BATCH_SIZE = 256
  NUM_STAGES = 2
  NUM_MICRO_BATCHES = 1
  LEARNING_RATE = 1e-3

  def Train(self):
    return RandomVectorInput.Params().Set(dim=self.DIMS[0],
                                          batch_size=self.BATCH_SIZE)

  def Task(self):
    p = RegressionTask.Params().Set(name='fc')
    p.stack = GPipeSequentialLayer.Params().Set(
        name='stack',
        cell_tpl=FcCells(self.DIMS),
        num_stages=self.NUM_STAGES,
        num_micro_batches=self.NUM_MICRO_BATCHES)
    p.train.learning_rate = self.LEARNING_RATE
    p.train.max_steps = 100
    return p


@model_registry.RegisterSingleTaskModel
class FcStackDeep(FcStack):
  """16 FC cells of 256, batch 2048: activations outweigh the weights."""

  DIMS = (256,) * 17
  BATCH_SIZE = 2048


@model_registry.RegisterSingleTaskModel
class FcStackTiny(FcStack):
  """A seconds-per-run variant for tests: 4 cells of 16, batch 8."""

  DIMS = (16, 16, 32, 16, 16)
  BATCH_SIZE = 8
