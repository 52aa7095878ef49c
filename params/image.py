r"""GPipe models of generated images of shapes: a ResNet and a U-Net.

The images are drawn by TensorFlow ops from a stateless random generator, so
the data needs no files and no network, and image i of a set is the same in
every run, in graph mode and in `tf.function`. Each image shows one of
`SHAPES` (its class) at a random position and size, in a random colour on a
random background colour, with Gaussian noise: position, size and colour say
nothing about the class, only the outline does. The train and dev sets draw
from different seeds.

The classifier is one `GPipeSequentialLayer` of cells: a stem convolution,
residual blocks (convolution + `lingvo_gpipe.BatchNormLayer` + ReLU; the first
block of every lower resolution halves it with a strided convolution and an
average-pooled shortcut) and a head that pools globally and projects to
logits. The cells report their flops (`FPropMeta`), so the pipeline is cut
into stages of equal flops (`partition='flops'`).

    python tools/train.py --model=image.ShapesResNet --num_devices=4 \
        --logdir=/tmp/shapes

`ShapesUNet` segments the same images: the target is a class per pixel, 0
for the background and 1 + the shape's class on the shape. A pixel's class
needs both what only the coarse levels see (which shape it is) and where the
outline runs, which only the fine levels resolve: a U-Net hands the fine
encoder features to the decoder at the same resolution through long skip
connections, here the pipeline's `skips`. 7 cells on 4 stages:

    stem   16x16x16  ConvBatchNorm           --skip-------------------+
    down1   8x8x32   ResidualCell, stride 2  --skip-----------+       |
    down2   4x4x64   ResidualCell, stride 2                   |       |
    mid     4x4x64   ResidualCell                             |       |
    up1     8x8x32   UpCell(mid, down1)      <----------------+       |
    up0    16x16x16  UpCell(up1, stem)       <------------------------+
    head   16x16x7   PixelLogitsCell

`skips=[('stem', 'up0'), ('down1', 'up1')]` and `partition='flops'` ([3, 1,
1, 2]: stem, down1 and down2 on CPU:0, mid on CPU:1, up1 on CPU:2, up0 and
head on CPU:3), so each skip goes from CPU:0 to CPU:2 or CPU:3 directly,
past the stages between.

    python tools/train.py --model=image.ShapesUNet --num_devices=4 \
        --logdir=/tmp/unet
"""

from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import base_input_generator
from lingvo.core import base_layer
from lingvo.core import base_model_params
from lingvo.core import layers
from lingvo.core import py_utils
from lingvo.core import tshape

from lingvo_gpipe import BatchNormLayer
from lingvo_gpipe import GPipeSequentialLayer
from params import pipelined_task

# The classes, in label order.
SHAPES = ('square', 'disc', 'ring', 'plus', 'triangle', 'diamond')
NUM_CHANNELS = 3  # RGB.


def ShapeMasks(image_size, center_y, center_x, radius):
  """Masks of every shape of `SHAPES` with the given centre and radius.

  Args:
    image_size: The height and width of the image, in pixels.
    center_y: float32 scalar, the row of the centre.
    center_x: float32 scalar, the column of the centre.
    radius: float32 scalar, half the height of the shape, in pixels.

  Returns:
    float32 [len(SHAPES), image_size, image_size]: 1 inside, 0 outside.
  """
  coords = tf.range(image_size, dtype=tf.float32)
  dy = (coords[:, tf.newaxis] - center_y) / radius  # [size, 1], in radii.
  dx = (coords[tf.newaxis, :] - center_x) / radius  # [1, size].
  abs_dy, abs_dx = tf.abs(dy), tf.abs(dx)
  distance = tf.sqrt(tf.square(dy) + tf.square(dx))
  in_square = tf.maximum(abs_dy, abs_dx) <= 1.0
  masks = {
      'square': in_square,
      'disc': distance <= 1.0,
      'ring': (distance <= 1.0) & (distance >= 0.6),
      'plus': in_square & (tf.minimum(abs_dy, abs_dx) <= 0.3),
      'triangle': (abs_dy <= 1.0) & (2.0 * abs_dx <= dy + 1.0),  # Apex up.
      'diamond': abs_dy + abs_dx <= 1.0,
  }
  return tf.stack([
      tf.cast(tf.broadcast_to(masks[name], [image_size, image_size]),
              tf.float32) for name in SHAPES
  ])


def DrawImage(data_seed, index, image_size, num_classes, noise_stddev):
  """Image `index` of the set drawn from `data_seed`, and its label.

  See `DrawImageAndMask`.

  Args:
    data_seed: int64 scalar, the seed of the set.
    index: int64 scalar, the image's index in the set.
    image_size: The height and width, in pixels.
    num_classes: The number of classes, the first of `SHAPES`.
    noise_stddev: Standard deviation of the Gaussian pixel noise.

  Returns:
    (image float32 [image_size, image_size, 3], label int32 scalar).
  """
  image, _, label = DrawImageAndMask(data_seed, index, image_size,
                                     num_classes, noise_stddev)
  return image, label


def DrawImageAndMask(data_seed, index, image_size, num_classes,
                     noise_stddev):
  """Image `index` of the set drawn from `data_seed`, its shape and label.

  The label is index % num_classes. Radius (15% to 35% of the image size),
  centre (the whole shape inside the image), background colour (uniform) and
  foreground colour (each channel 0.3 to 0.7 away from the background's,
  modulo 1) and the noise all come from a stateless generator seeded with
  (data_seed, index).

  Args:
    data_seed: int64 scalar, the seed of the set.
    index: int64 scalar, the image's index in the set.
    image_size: The height and width, in pixels.
    num_classes: The number of classes, the first of `SHAPES`.
    noise_stddev: Standard deviation of the Gaussian pixel noise.

  Returns:
    (image float32 [image_size, image_size, 3], mask float32 [image_size,
    image_size] (1 on the shape, 0 elsewhere), label int32 scalar).
  """
  label = tf.cast(index % num_classes, tf.int32)
  seeds = tf.random.experimental.stateless_split(
      tf.stack([data_seed, index]), num=2)
  u = tf.random.stateless_uniform([3 + 2 * NUM_CHANNELS], seed=seeds[0])
  radius = image_size * (0.15 + 0.2 * u[0])
  margin = radius + 0.5
  center_y = margin + u[1] * (image_size - 1 - 2 * margin)
  center_x = margin + u[2] * (image_size - 1 - 2 * margin)
  background = u[3:3 + NUM_CHANNELS]
  foreground = tf.math.floormod(
      background + 0.3 + 0.4 * u[3 + NUM_CHANNELS:], 1.0)
  mask = tf.gather(ShapeMasks(image_size, center_y, center_x, radius), label)
  noise = tf.random.stateless_normal(
      [image_size, image_size, NUM_CHANNELS], seed=seeds[1],
      stddev=noise_stddev)
  image = background + mask[..., tf.newaxis] * (foreground - background)
  return image + noise, mask, label


class ShapesInput(base_input_generator.BaseInputGenerator):
  """Batches of generated shape images: image [B, H, W, 3], label [B].

  Subclasses add fields by overriding `_Example`.

  A set is `num_samples` images drawn from `data_seed` (see `DrawImage`),
  repeated forever: shuffled anew every epoch (training) or in order, so that
  an eval of num_samples examples sees each image exactly once. In graph mode
  every `_InputBatch` call builds a one-shot iterator; in eager mode (Lingvo's
  --use_eager) the iterator is made once, outside the runner's `tf.function`,
  which then advances it on every call.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('image_size', 16, 'Height and width of the images, in pixels.')
    p.Define(
        'num_classes', len(SHAPES), 'Number of classes: the first '
        f'num_classes of {SHAPES}.')
    p.Define('noise_stddev', 0.1, 'Standard deviation of the pixel noise '
             '(colours are in [0, 1]).')
    p.Define('data_seed', 1, 'Seed of the images; sets of different seeds '
             'are different images.')
    p.Define('shuffle', True, 'Whether each epoch visits the images in a '
             'new random order (else in index order).')
    p.num_samples = 1024
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not 2 <= p.num_classes <= len(SHAPES):
      raise ValueError(f'num_classes={p.num_classes} must be in '
                       f'[2, {len(SHAPES)}].')
    if p.num_samples < self.InfeedBatchSize():
      raise ValueError(f'num_samples={p.num_samples} must be at least the '
                       f'batch size {self.InfeedBatchSize()}.')
    self._eager_iterator = None
    if tf.executing_eagerly_outside_functions():
      self._eager_iterator = iter(self._Dataset())

  def _Dataset(self):
    """The endless tf.data pipeline of (images, labels) batches."""
    p = self.params
    dataset = tf.data.Dataset.range(p.num_samples)
    if p.shuffle:
      dataset = dataset.shuffle(
          p.num_samples, seed=p.data_seed, reshuffle_each_iteration=True)
    data_seed = tf.constant(p.data_seed, tf.int64)
    dataset = dataset.repeat().map(
        lambda index: self._Example(data_seed, index),
        num_parallel_calls=tf.data.AUTOTUNE)
    dataset = dataset.batch(self.InfeedBatchSize(), drop_remainder=True)
    return dataset.prefetch(1)

  def _Example(self, data_seed, index):
    """{field: tensor} of image `index`: 'image' and 'label' (`DrawImage`)."""
    p = self.params
    image, label = DrawImage(data_seed, index, p.image_size, p.num_classes,
                             p.noise_stddev)
    return {'image': image, 'label': label}

  def _InputBatch(self):
    if self._eager_iterator is None:
      iterator = tf.data.make_one_shot_iterator(self._Dataset())
      batch = iterator.get_next()
    else:
      batch = next(self._eager_iterator)
    return py_utils.NestedMap(batch)


class ConvBatchNorm(base_layer.BaseLayer):
  """Convolution (no bias), `lingvo_gpipe.BatchNormLayer`, optional ReLU."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('filter_shape', (3, 3, 0, 0),
             '(height, width, input channels, output channels).')
    p.Define('stride', 1, 'Stride in both spatial dimensions.')
    p.Define('activation', 'RELU', "'RELU' or 'NONE'.")
    p.Define('bn_decay', 0.9, 'Decay of the moving mean and variance.')
    p.Define(
        'gamma_zero_init', False, 'Whether the batch norm scale starts at 0 '
        '(the block then starts as its shortcut).')
    return p

  @classmethod
  def _ChildParams(cls, p):
    """(conv, batch norm) Params of a ConvBatchNorm with params `p`."""
    conv = layers.Conv2DLayerNoPadding.Params().Set(
        name='conv', filter_shape=p.filter_shape,
        filter_stride=(p.stride, p.stride))
    bn = BatchNormLayer.Params().Set(
        name='bn', dim=p.filter_shape[-1], decay=p.bn_decay,
        gamma_zero_init=p.gamma_zero_init,
        add_stats_to_moving_average_variables=True)
    return conv, bn

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.activation not in ('RELU', 'NONE'):
      raise ValueError(f"activation={p.activation!r} must be 'RELU' or "
                       "'NONE'.")
    conv, bn = self._ChildParams(p)
    self.CreateChild('conv', conv)
    self.CreateChild('bn', bn)

  def FProp(self, theta, inputs):
    """Returns the normalized convolution of inputs [B, H, W, C_in].

    Args:
      theta: This layer's variables.
      inputs: float32 [B, H, W, C_in].

    Returns:
      float32 [B, H / stride, W / stride, C_out].
    """
    with tf.name_scope(self.params.name):
      outputs = self.bn.FProp(theta.bn, self.conv.FProp(theta.conv, inputs))
      if self.params.activation == 'RELU':
        outputs = tf.nn.relu(outputs)
      return outputs

  @classmethod
  def FPropMeta(cls, p, inputs):
    conv, bn = cls._ChildParams(p)
    conv_meta = conv.cls.FPropMeta(conv, inputs)
    out_shape = conv_meta.out_shapes[0]
    flops = conv_meta.flops + bn.cls.FPropMeta(bn, out_shape).flops
    if p.activation == 'RELU':
      flops += out_shape.num_elements()
    return py_utils.NestedMap(flops=flops, out_shapes=(out_shape,))


class ResidualCell(base_layer.BaseLayer):
  """relu(conv_bn(relu(conv_bn(x))) + shortcut(x)), a ResNet basic block.

  With stride 2 the first convolution halves the resolution and the shortcut
  is a 2x2 average pooling followed by a 1x1 ConvBatchNorm; with more output
  than input channels (and stride 1) only the 1x1 ConvBatchNorm.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Input channels.')
    p.Define('output_dim', 0, 'Output channels.')
    p.Define('stride', 1, '1, or 2 to halve height and width.')
    p.Define('bn_decay', 0.9, 'Decay of the moving mean and variance.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    """{name: ConvBatchNorm Params} of a ResidualCell with params `p`."""
    children = {
        'conv1':
            ConvBatchNorm.Params().Set(
                filter_shape=(3, 3, p.input_dim, p.output_dim),
                stride=p.stride, bn_decay=p.bn_decay),
        'conv2':
            ConvBatchNorm.Params().Set(
                filter_shape=(3, 3, p.output_dim, p.output_dim),
                activation='NONE', bn_decay=p.bn_decay, gamma_zero_init=True),
    }
    if p.stride != 1 or p.input_dim != p.output_dim:
      children['shortcut'] = ConvBatchNorm.Params().Set(
          filter_shape=(1, 1, p.input_dim, p.output_dim), activation='NONE',
          bn_decay=p.bn_decay)
    for name, child in children.items():
      child.name = name
    return children

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.stride not in (1, 2):
      raise ValueError(f'stride={p.stride} must be 1 or 2.')
    for name, child in self._ChildParams(p).items():
      self.CreateChild(name, child)

  def _Pool(self, inputs):
    if self.params.stride == 1:
      return inputs
    return tf.nn.avg_pool2d(inputs, ksize=2, strides=2, padding='SAME')

  def FProp(self, theta, inputs):
    """Returns the block's output.

    Args:
      theta: This layer's variables.
      inputs: float32 [B, H, W, input_dim].

    Returns:
      float32 [B, H / stride, W / stride, output_dim].
    """
    with tf.name_scope(self.params.name):
      residual = self.conv2.FProp(theta.conv2,
                                  self.conv1.FProp(theta.conv1, inputs))
      shortcut = self._Pool(inputs)
      if 'shortcut' in self.children:
        shortcut = self.shortcut.FProp(theta.shortcut, shortcut)
      return tf.nn.relu(residual + shortcut)

  @classmethod
  def FPropMeta(cls, p, inputs):
    children = cls._ChildParams(p)
    conv1 = children['conv1'].cls.FPropMeta(children['conv1'], inputs)
    conv2 = children['conv2'].cls.FPropMeta(children['conv2'],
                                            conv1.out_shapes[0])
    out_shape = conv2.out_shapes[0]
    flops = conv1.flops + conv2.flops + 2 * out_shape.num_elements()
    if 'shortcut' in children:
      shortcut_input = inputs
      if p.stride != 1:
        shortcut_input = tshape.Shape(
            [inputs[0], out_shape[1], out_shape[2], inputs[3]])
        flops += inputs.num_elements()  # Average pooling.
      flops += children['shortcut'].cls.FPropMeta(children['shortcut'],
                                                  shortcut_input).flops
    return py_utils.NestedMap(flops=flops, out_shapes=(out_shape,))


class _LogitsCell(base_layer.BaseLayer):
  """A linear projection of input_dim channels to class logits ('logits')."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Input channels.')
    p.Define('num_classes', 0, 'Number of classes.')
    return p

  @classmethod
  def _ProjectionParams(cls, p):
    return layers.FCLayer.Params().Set(
        name='logits', input_dim=p.input_dim, output_dim=p.num_classes,
        activation='NONE')

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('logits', self._ProjectionParams(self.params))


class PoolingHeadCell(_LogitsCell):
  """Global average pooling, then a linear projection to class logits."""

  def FProp(self, theta, inputs):
    """Returns logits [B, num_classes] of inputs [B, H, W, input_dim]."""
    with tf.name_scope(self.params.name):
      return self.logits.FProp(theta.logits,
                               tf.reduce_mean(inputs, axis=[1, 2]))

  @classmethod
  def FPropMeta(cls, p, inputs):
    projection = cls._ProjectionParams(p)
    pooled = tshape.Shape([inputs[0], inputs[3]])
    meta = projection.cls.FPropMeta(projection, pooled)
    return py_utils.NestedMap(
        flops=inputs.num_elements() + meta.flops, out_shapes=meta.out_shapes)


def ResNetCells(channels, blocks_per_level, num_classes, bn_decay):
  """The cells of the pipeline: stem, residual blocks, pooling head.

  Args:
    channels: Channels of each resolution level, e.g. (16, 32, 64); every
      level after the first halves height and width.
    blocks_per_level: ResidualCells per level.
    num_classes: Number of logits.
    bn_decay: Decay of every batch norm's moving statistics.

  Returns:
    A list of cell Params with unique names.
  """
  cells = [
      ConvBatchNorm.Params().Set(
          name='stem', filter_shape=(3, 3, NUM_CHANNELS, channels[0]),
          bn_decay=bn_decay)
  ]
  input_dim = channels[0]
  for level, output_dim in enumerate(channels):
    for block in range(blocks_per_level):
      cells.append(ResidualCell.Params().Set(
          name=f'block{level}_{block}', input_dim=input_dim,
          output_dim=output_dim, stride=2 if level and not block else 1,
          bn_decay=bn_decay))
      input_dim = output_dim
  cells.append(PoolingHeadCell.Params().Set(
      name='head', input_dim=input_dim, num_classes=num_classes))
  return cells


class ImageClassifierTask(pipelined_task.PipelinedTask):
  """Softmax classification; `stack` maps images [B, H, W, C] to logits."""

  def ComputePredictions(self, theta, input_batch):
    return py_utils.NestedMap(
        logits=self.stack.FProp(theta.stack, input_batch.image))

  def ComputeLoss(self, theta, predictions, input_batch):
    """Mean cross entropy and accuracy of the batch.

    Args:
      theta: The task's variables.
      predictions: ComputePredictions' NestedMap.
      input_batch: The input NestedMap.

    Returns:
      (metrics, per_example): Lingvo's {name: (value, weight)}, with 'loss'
      and 'accuracy' weighted by the number of images (and the pipeline's
      bubble fraction in training), and {}.
    """
    labels = input_batch.label
    loss, accuracy, count = pipelined_task.SoftmaxMetrics(
        predictions.logits, labels, tf.ones_like(labels, tf.float32))
    batch_metrics = {'loss': (loss, count), 'accuracy': (accuracy, count)}
    batch_metrics.update(self.PipelineMetrics(labels.shape[0]))
    return batch_metrics, {}


class _ShapesModel(base_model_params.SingleTaskModelParams):
  """What the models on the generated shapes share: data, sizes, schedule.

  Subclasses set INPUT (the input generator class) and build their Task's
  stack; `_Finish` sets the training schedule and eval size.
  """

  INPUT = None
  IMAGE_SIZE = 16
  NUM_CLASSES = len(SHAPES)
  NOISE_STDDEV = 0.1
  BN_DECAY = 0.9
  BATCH_SIZE = 64
  TRAIN_SAMPLES = 16384
  DEV_SAMPLES = 1024
  NUM_STAGES = 4
  NUM_MICRO_BATCHES = 4
  MAX_STEPS = 500
  LEARNING_RATE = 1e-2

  def _Input(self, data_seed, num_samples, shuffle):
    return self.INPUT.Params().Set(
        image_size=self.IMAGE_SIZE, num_classes=self.NUM_CLASSES,
        noise_stddev=self.NOISE_STDDEV, data_seed=data_seed,
        num_samples=num_samples, shuffle=shuffle, batch_size=self.BATCH_SIZE)

  def Train(self):
    return self._Input(1, self.TRAIN_SAMPLES, shuffle=True)

  def Dev(self):
    return self._Input(2, self.DEV_SAMPLES, shuffle=False)

  def _Finish(self, p):
    """Sets the task's training schedule and eval size; returns it."""
    pipelined_task.SetTrainSchedule(p.train, self.LEARNING_RATE,
                                    self.MAX_STEPS, final_value=0.05,
                                    save_interval_steps=100)
    p.eval.samples_per_summary = self.DEV_SAMPLES
    return p


@model_registry.RegisterSingleTaskModel
class ShapesResNet(_ShapesModel):
  """A 16x16 ResNet-14 on 6 shapes, 4 stages, 4 micro-batches of 16 images."""

  INPUT = ShapesInput
  CHANNELS = (8, 16, 32)
  BLOCKS_PER_LEVEL = 2

  def Task(self):
    p = ImageClassifierTask.Params().Set(name='shapes')
    p.stack = GPipeSequentialLayer.Params().Set(
        name='stack',
        cell_tpl=ResNetCells(self.CHANNELS, self.BLOCKS_PER_LEVEL,
                             self.NUM_CLASSES, self.BN_DECAY),
        num_stages=self.NUM_STAGES,
        num_micro_batches=self.NUM_MICRO_BATCHES,
        partition='flops',
        batch_dim=0)
    return self._Finish(p)


@model_registry.RegisterSingleTaskModel
class ShapesResNetTiny(ShapesResNet):
  """A seconds-per-run variant for tests: 8x8 images, 4 cells, 4 stages."""

  IMAGE_SIZE = 8
  CHANNELS = (8, 16)
  BLOCKS_PER_LEVEL = 1
  BATCH_SIZE = 32
  TRAIN_SAMPLES = 256
  DEV_SAMPLES = 64
  MAX_STEPS = 20
  LEARNING_RATE = 3e-2


# A U-Net: per-pixel classes, long skip connections across stages.


class ShapesSegmentationInput(ShapesInput):
  """`ShapesInput` plus `segment` [B, H, W] int32: 0, or 1 + label."""

  def _Example(self, data_seed, index):
    p = self.params
    image, mask, label = DrawImageAndMask(
        data_seed, index, p.image_size, p.num_classes, p.noise_stddev)
    segment = tf.cast(mask, tf.int32) * (label + 1)
    return {'image': image, 'label': label, 'segment': segment}


def _Upsample(inputs):
  """Nearest-neighbour 2x upsampling of [B, H, W, C]."""
  return tf.repeat(tf.repeat(inputs, 2, axis=1), 2, axis=2)


class UpCell(base_layer.BaseLayer):
  """A U-Net decoder level: upsample, concatenate the skip, two convolutions.

  FProp(theta, inputs, skip): inputs [B, H, W, input_dim] from the coarser
  level, skip [B, 2H, 2W, skip_dim] from the encoder (a skip connection of
  the pipeline); returns [B, 2H, 2W, output_dim]. With skip_dim=0 it takes
  no skip (a decoder without the U-Net's shortcuts, for comparison).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Channels of the coarser level.')
    p.Define('skip_dim', 0, 'Channels of the skipped encoder features; 0 '
             'for no skip input.')
    p.Define('output_dim', 0, 'Output channels.')
    p.Define('bn_decay', 0.9, 'Decay of the moving mean and variance.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    """{name: ConvBatchNorm Params} of an UpCell with params `p`."""
    return {
        'conv1':
            ConvBatchNorm.Params().Set(
                name='conv1',
                filter_shape=(3, 3, p.input_dim + p.skip_dim, p.output_dim),
                bn_decay=p.bn_decay),
        'conv2':
            ConvBatchNorm.Params().Set(
                name='conv2',
                filter_shape=(3, 3, p.output_dim, p.output_dim),
                bn_decay=p.bn_decay),
    }

  def __init__(self, params):
    super().__init__(params)
    for name, child in self._ChildParams(self.params).items():
      self.CreateChild(name, child)

  def FProp(self, theta, inputs, skip=None):
    """Returns the decoder features.

    Args:
      theta: This layer's variables.
      inputs: float32 [B, H, W, input_dim].
      skip: float32 [B, 2H, 2W, skip_dim], or None if skip_dim is 0.

    Returns:
      float32 [B, 2H, 2W, output_dim].

    Raises:
      ValueError: if a skip comes with skip_dim=0 or none with skip_dim > 0.
    """
    p = self.params
    if (skip is None) != (p.skip_dim == 0):
      raise ValueError(
          f'{p.name}: skip_dim={p.skip_dim} but FProp got '
          f'{"no skip" if skip is None else "a skip"}; the pipeline\'s skips '
          f'must bring one to {p.name!r} exactly when skip_dim > 0.')
    with tf.name_scope(p.name):
      x = _Upsample(inputs)
      if skip is not None:
        x = tf.concat([x, skip], axis=-1)
      return self.conv2.FProp(theta.conv2, self.conv1.FProp(theta.conv1, x))

  @classmethod
  def FPropMeta(cls, p, inputs, skip=None):
    """Flops and output shape; the skip's shape follows from `inputs`."""
    del skip  # [B, 2H, 2W, skip_dim]; cost estimates pass the main input.
    children = cls._ChildParams(p)
    concat = tshape.Shape([inputs[0], 2 * inputs[1], 2 * inputs[2],
                           p.input_dim + p.skip_dim])
    conv1 = children['conv1'].cls.FPropMeta(children['conv1'], concat)
    conv2 = children['conv2'].cls.FPropMeta(children['conv2'],
                                            conv1.out_shapes[0])
    return py_utils.NestedMap(flops=conv1.flops + conv2.flops,
                              out_shapes=conv2.out_shapes)


class PixelLogitsCell(_LogitsCell):
  """A linear projection of every pixel's features to class logits."""

  def FProp(self, theta, inputs):
    """Returns logits [B, H, W, num_classes] of inputs [B, H, W, input_dim]."""
    with tf.name_scope(self.params.name):
      return self.logits.FProp(theta.logits, inputs)

  @classmethod
  def FPropMeta(cls, p, inputs):
    projection = cls._ProjectionParams(p)
    return projection.cls.FPropMeta(projection, inputs)


def UNetCells(channels, num_classes, bn_decay):
  """The cells of the U-Net and its skips.

  Args:
    channels: (c0, c1, c2): channels at full, half and quarter resolution.
    num_classes: Number of per-pixel classes (background included).
    bn_decay: Decay of every batch norm's moving statistics.

  Returns:
    (cell Params, skips): the cells stem, down1, down2, mid, up1, up0, head
    and the (from_cell, to_cell) skips [('stem', 'up0'), ('down1', 'up1')].
  """
  c0, c1, c2 = channels
  cells = [
      ConvBatchNorm.Params().Set(
          name='stem', filter_shape=(3, 3, NUM_CHANNELS, c0),
          bn_decay=bn_decay),
      ResidualCell.Params().Set(name='down1', input_dim=c0,
                                      output_dim=c1, stride=2,
                                      bn_decay=bn_decay),
      ResidualCell.Params().Set(name='down2', input_dim=c1,
                                      output_dim=c2, stride=2,
                                      bn_decay=bn_decay),
      ResidualCell.Params().Set(name='mid', input_dim=c2, output_dim=c2,
                                      bn_decay=bn_decay),
      UpCell.Params().Set(name='up1', input_dim=c2, skip_dim=c1,
                          output_dim=c1, bn_decay=bn_decay),
      UpCell.Params().Set(name='up0', input_dim=c1, skip_dim=c0,
                          output_dim=c0, bn_decay=bn_decay),
      PixelLogitsCell.Params().Set(name='head', input_dim=c0,
                                   num_classes=num_classes),
  ]
  return cells, [('stem', 'up0'), ('down1', 'up1')]


class SegmentationTask(ImageClassifierTask):
  """Per-pixel softmax; `stack` maps images to logits [B, H, W, classes]."""

  def ComputeLoss(self, theta, predictions, input_batch):
    """Mean per-pixel cross entropy and accuracies of the batch.

    Args:
      theta: The task's variables.
      predictions: ComputePredictions' NestedMap.
      input_batch: The input NestedMap.

    Returns:
      (metrics, per_example): Lingvo's {name: (value, weight)}: 'loss' and
      'accuracy' over every pixel, 'shape_accuracy' over the pixels of the
      shapes (the right shape class there), 'iou' (intersection over union
      of predicted and true shape pixels, whatever the class), plus the
      pipeline's bubble fraction in training; and {}.
    """
    segment = input_batch.segment
    logits = predictions.logits
    pixels = tf.ones_like(segment, tf.float32)
    loss, accuracy, count = pipelined_task.SoftmaxMetrics(
        logits, segment, pixels)
    on_shape = tf.cast(segment > 0, tf.float32)
    _, shape_accuracy, shape_count = pipelined_task.SoftmaxMetrics(
        logits, segment, on_shape)
    predicted_on = tf.cast(
        tf.argmax(logits, -1, output_type=tf.int32) > 0, tf.float32)
    union = tf.reduce_sum(tf.maximum(predicted_on, on_shape))
    iou = tf.reduce_sum(predicted_on * on_shape) / tf.maximum(union, 1.0)
    batch_metrics = {
        'loss': (loss, count),
        'accuracy': (accuracy, count),
        'shape_accuracy': (shape_accuracy, shape_count),
        'iou': (iou, union),
    }
    batch_metrics.update(self.PipelineMetrics(segment.shape[0]))
    return batch_metrics, {}


@model_registry.RegisterSingleTaskModel
class ShapesUNet(_ShapesModel):
  """A 16x16 U-Net on 6 shapes + background, 4 stages, 2 long skips."""

  INPUT = ShapesSegmentationInput
  CHANNELS = (16, 32, 64)

  def Task(self):
    p = SegmentationTask.Params().Set(name='shapes_unet')
    cells, skips = UNetCells(self.CHANNELS, self.NUM_CLASSES + 1,
                             self.BN_DECAY)
    p.stack = GPipeSequentialLayer.Params().Set(
        name='stack', cell_tpl=cells, skips=skips,
        num_stages=self.NUM_STAGES,
        num_micro_batches=self.NUM_MICRO_BATCHES, partition='flops',
        batch_dim=0)
    return self._Finish(p)


@model_registry.RegisterSingleTaskModel
class ShapesUNetTiny(ShapesUNet):
  """A seconds-per-run variant for tests: 8x8 images, fewer channels."""

  IMAGE_SIZE = 8
  CHANNELS = (4, 8, 8)
  BATCH_SIZE = 32
  TRAIN_SAMPLES = 256
  DEV_SAMPLES = 64
  MAX_STEPS = 20
  LEARNING_RATE = 3e-2
