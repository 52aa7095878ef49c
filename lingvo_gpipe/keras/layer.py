"""GPipeSequential: a Keras 3 layer that runs its layers as a GPipe pipeline.

    >>> import numpy as np
    >>> pipe = GPipeSequential([keras.layers.Dense(16, activation='relu')
    ...                         for _ in range(4)],
    ...                        num_stages=2, num_micro_batches=2)
    >>> model = keras.Sequential([keras.Input((16,)), pipe,
    ...                           keras.layers.Dense(1)])
    >>> model.compile('sgd', 'mse')
    >>> history = model.fit(np.ones([64, 16]), np.zeros([64, 1]),
    ...                     batch_size=32, verbose=0)
    >>> pipe.partition, len(history.history['loss'])
    ([2, 2], 1)

The Keras front end of the engine that also runs `GPipeSequentialLayer`: the
same checks and error messages (`planning.config`), placement
(`engine.placement`) and pipelined call (`engine.call`: M, partition and its
plan, engine choice, eval). Only the cells differ: Keras layers called
statelessly, their seeds and batch-norm statistics as stage state
(`keras/stages.py`). With a schedule that computes the loss inside the
pipeline ('1f1b', 'zb1p', 'zbv') the layer takes `loss=`, is called on
(inputs, labels) and returns the mean loss (docs/keras.md).

Its variables are the layers' own, created in the layer's name scope as a
`keras.Sequential` of the same name would create them: the same order, names
and paths. The pipeline shape (stages, micro-batches, partition, devices,
recompute, engine) changes only how a call runs, so weights move between
shapes and to the plain model (`get_weights` / `set_weights`, and weight
files of models that differ only in the pipeline shape).
"""

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from absl import logging
import keras
import tensorflow as tf

from lingvo_gpipe.engine import call as call_lib
from lingvo_gpipe.engine import placement
from lingvo_gpipe.keras import costs as costs_lib
from lingvo_gpipe.keras import devices as devices_lib
from lingvo_gpipe.keras import stages
from lingvo_gpipe.planning import config
from lingvo_gpipe.planning import schedule as schedule_lib


def _LogPlan(plan: str) -> None:
  """Logs a partition plan at INFO, as a record of this module."""
  logging.info('%s', plan)


def _LossInsideSchedules() -> List[str]:
  """The schedules that compute the loss inside the pipeline."""
  return [name for name, schedule in schedule_lib.SCHEDULES.items()
          if schedule.loss_inside]


def _IsShapePair(input_shape: Any) -> bool:
  """Whether `input_shape` is two shapes (inputs, labels), not one shape."""
  return (isinstance(input_shape, (tuple, list)) and len(input_shape) == 2 and
          all(isinstance(s, (tuple, list)) for s in input_shape))


def _Describe(inputs: Any) -> str:
  """A short description of a call's inputs for an error message."""
  if isinstance(inputs, (tuple, list)):
    return (f'{type(inputs).__name__} of {len(inputs)}: ' +
            ', '.join(_Describe(x) for x in inputs))
  if hasattr(inputs, 'shape'):
    return f'{type(inputs).__name__} of shape {tuple(inputs.shape)}'
  return type(inputs).__name__


def _CheckLayers(layers: Any) -> List[keras.layers.Layer]:
  """The layers as a list; ValueError unless a non-empty list of layers."""
  if isinstance(layers, keras.layers.Layer) or not isinstance(
      layers, (list, tuple)):
    raise ValueError(f'layers={layers!r} must be a list of Keras layers.')
  layers = list(layers)
  if not layers:
    raise ValueError('layers is empty; give at least one Keras layer.')
  for i, layer in enumerate(layers):
    if not isinstance(layer, keras.layers.Layer):
      raise ValueError(f'layers[{i}]={layer!r} is not a keras.layers.Layer.')
    if isinstance(layer, keras.layers.InputLayer):
      raise ValueError(
          f'layers[{i}] is an InputLayer; put keras.Input in the model '
          'around GPipeSequential, not among its layers.')
  return layers


@keras.saving.register_keras_serializable(package='lingvo_gpipe')
class GPipeSequential(keras.layers.Layer):
  """Runs a list of Keras layers as a K-stage, M-micro-batch GPipe pipeline.

  Its outputs are those of `keras.Sequential` of the same layers:

      >>> import numpy as np
      >>> layers = [keras.layers.Dense(4, activation='tanh') for _ in range(4)]
      >>> pipe = GPipeSequential(layers, num_stages=2, num_micro_batches=4)
      >>> x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
      >>> y = pipe(x, training=True)
      >>> np.allclose(y, keras.Sequential(layers)(x), atol=1e-6)
      True

  Attributes:
    layers: The layers, in order.
    num_stages: K.
    partition: Layers per chunk (K v ints), None until a 'params' or
      'profile' partition is decided (at build, or at the first call).
    loss_inside: Whether the schedule computes the loss inside the pipeline
      ('1f1b', 'zb1p', 'zbv'): the layer then takes (inputs, labels) and
      returns the mean loss.
    loss: What the last chunk applies to each micro-batch, (y_true, y_pred)
      -> mean loss (`stages.MeanLoss` of the loss given), or None.
  """

  def __init__(self,
               layers: Sequence[keras.layers.Layer],
               num_stages: Optional[int] = None,
               num_micro_batches: int = 1,
               partition: Union[str, Sequence[int]] = 'uniform',
               remat: str = 'always',
               devices: Optional[Sequence[str]] = None,
               engine: str = 'auto',
               schedule: str = 'gpipe',
               virtual_stages: int = 1,
               micro_batch_size: Optional[int] = None,
               loss: Any = None,
               **kwargs):
    """Checks the pipeline's parameters; nothing is built yet.

    Args:
      layers: Keras layers, in order; layer i's output is layer i + 1's input
        (one tensor each, as in `keras.Sequential`). Names must be unique.
      num_stages: K, the number of pipeline stages (devices); None for one
        stage per layer. At most the number of layers.
      num_micro_batches: M, the micro-batches each mini-batch is split into
        along axis 0. Must divide the batch size.
      partition: How layers are grouped into chunks: 'uniform' (equal
        counts), 'params' (trainable parameters, decided at build), 'profile'
        (measured forward + backward time of each layer on one micro-batch,
        decided at the first call, which needs a static batch size), or a
        list of layers per chunk (K v counts).
      remat: Re-materialization: 'always' (keep each stage's micro-batch
        inputs, recompute the rest in the backward pass), 'except_last' (not
        for the last micro-batch) or 'never'.
      devices: K device strings, one per stage. None: one stage on the
        default device; else the first K local logical devices of one type
        (per replica under a distribution strategy, see `keras/devices.py`).
      engine: 'unrolled', 'loop' or 'auto' ('loop' for a schedule with the
        loss inside and under XLA, else the engine that costs less over a
        training run, `planning.schedule.ChooseEngine`); see docs/engines.md.
      schedule: A key of `planning.schedule.SCHEDULES`. 'gpipe' runs the
        layers before the loss; '1f1b', 'zb1p' and 'zbv' compute `loss`
        inside the pipeline (docs/keras.md, "The loss inside the pipeline").
      virtual_stages: v, chunks per device (circular pipeline): K v chunks,
        chunk c on device c mod K.
      micro_batch_size: Alternative to num_micro_batches: the size of one
        micro-batch (needs a static batch size).
      loss: With a schedule that computes the loss inside the pipeline, and
        only then: a `keras.losses.Loss` with a mean reduction, a loss name
        (`keras.losses.get`) or a callable (y_true, y_pred) -> loss (reduced
        to its mean if not a scalar, as `model.compile` does; y_true as
        given). The layer is then called on
        (inputs, labels) and returns the mean loss.
      **kwargs: keras.layers.Layer arguments (name, dtype, trainable).

    Raises:
      ValueError: naming the parameter, its value and what would be valid.
    """
    super().__init__(**kwargs)
    layers = _CheckLayers(layers)
    if partition == 'flops':
      raise ValueError(
          "partition='flops' needs Lingvo's FPropMeta flop estimates, which "
          "Keras layers do not have; use 'params', 'profile', 'uniform' or a "
          'list of layers per stage.')
    shape = config.CheckShape(
        [layer.name for layer in layers], num_stages, virtual_stages,
        partition, num_micro_batches, micro_batch_size, 0, remat, engine,
        schedule, cells_param='layers')
    self.loss_inside = schedule_lib.CheckSchedule(schedule).loss_inside
    if self.loss_inside and loss is None:
      raise ValueError(
          f'schedule={schedule!r} computes the loss inside the pipeline: give '
          'loss= (e.g. keras.losses.SparseCategoricalCrossentropy()) and '
          "call the layer on (inputs, labels), or use schedule='gpipe'.")
    if loss is not None and not self.loss_inside:
      raise ValueError(
          f'loss={loss!r} needs a schedule that computes the loss inside the '
          f"pipeline ({_LossInsideSchedules()}); schedule={schedule!r} runs "
          'the layers before the loss: compute it outside, or drop loss=.')
    self.loss = None if loss is None else stages.MeanLoss(loss)
    self._loss_arg = loss
    placement.CheckDevices(devices, shape.num_stages)
    stages.CheckLayers(layers)
    self._layers_list = layers
    self.num_stages = shape.num_stages
    self.num_micro_batches = num_micro_batches
    self.micro_batch_size = micro_batch_size
    self.virtual_stages = virtual_stages
    self.remat = remat
    self.engine = engine
    self.schedule = schedule
    self.devices = None if devices is None else list(devices)
    self._partition_arg = (partition if isinstance(partition, str) else
                           list(partition))
    self._logged_devices = None
    # M, the partition and the engine, decided as for every front end.
    self._pipelined_call = call_lib.PipelinedCall(
        self.name, [layer.name for layer in layers], shape,
        partition=self._partition_arg, num_micro_batches=num_micro_batches,
        micro_batch_size=micro_batch_size, batch_dim=0, remat=remat,
        engine=engine, schedule=schedule,
        memory=lambda: costs_lib.VariableBytes(self._layers_list),
        log_plan=_LogPlan)

  @property
  def layers(self) -> List[keras.layers.Layer]:
    return list(self._layers_list)

  @property
  def partition(self) -> Optional[List[int]]:
    return self._pipelined_call.partition

  @property
  def num_chunks(self) -> int:
    """K v."""
    return self._pipelined_call.num_chunks

  def get_config(self) -> Dict[str, Any]:
    base = super().get_config()
    base.update({
        'layers': [keras.saving.serialize_keras_object(layer)
                   for layer in self._layers_list],
        'num_stages': self.num_stages,
        'num_micro_batches': self.num_micro_batches,
        'partition': self._partition_arg,
        'remat': self.remat,
        'devices': self.devices,
        'engine': self.engine,
        'schedule': self.schedule,
        'virtual_stages': self.virtual_stages,
        'micro_batch_size': self.micro_batch_size,
        'loss': keras.saving.serialize_keras_object(self._loss_arg),
    })
    return base

  @classmethod
  def from_config(cls, config_dict: Dict[str, Any]) -> 'GPipeSequential':
    config_dict = dict(config_dict)
    config_dict['layers'] = [keras.saving.deserialize_keras_object(layer)
                             for layer in config_dict['layers']]
    if isinstance(config_dict.get('loss'), dict):
      config_dict['loss'] = keras.losses.get(config_dict['loss'])
    return cls(**config_dict)

  def build(self, input_shape) -> None:
    """Builds the layers in order, as keras.Sequential does.

    Args:
      input_shape: The first layer's input shape (batch dimension included);
        with the loss inside, that shape or (that shape, the labels' shape).
    """
    if self.loss_inside and _IsShapePair(input_shape):
      input_shape = input_shape[0]
    x = keras.KerasTensor(input_shape, dtype=self.input_dtype)
    for layer in self._layers_list:
      x = layer(x)
    self._pipelined_call.Plan(
        lambda: costs_lib.ParamCounts(self._layers_list))

  def compute_output_spec(self, inputs, training=None):
    """The last layer's output spec; with the loss inside, a float scalar.

    Args:
      inputs: A KerasTensor, or with the loss inside (inputs, labels).
      training: Unused: the output's shape and dtype do not depend on it.

    Returns:
      A KerasTensor.

    Raises:
      ValueError: for inputs of the wrong structure (`_LossInputs`).
    """
    del training
    x = self._LossInputs(inputs)[0] if self.loss_inside else inputs
    for layer in self._layers_list:
      x = layer.compute_output_spec(x)
    if self.loss_inside:
      return keras.KerasTensor((), dtype=getattr(self.loss, 'dtype', None) or
                               keras.config.floatx())
    return x

  def _MicroBatchCosts(self, x: tf.Tensor, num_micro: int) -> List[float]:
    """Per-layer 'profile' times on one micro-batch of `x`'s shape.

    Args:
      x: The first call's input.
      num_micro: M.

    Returns:
      One time per layer (`costs.ProfileTimes`).

    Raises:
      ValueError: if the batch size is not static.
    """
    shape = x.shape.as_list()
    if shape[0] is None:
      raise ValueError(
          "partition='profile' times each layer on one micro-batch and needs "
          f'a static batch size at the first call; the input has shape '
          f'{shape}. Give keras.Input a batch_size, call the model once on '
          "an array first, or use partition='params' or a list.")
    shape[0] //= num_micro
    return costs_lib.ProfileTimes(self._layers_list, shape, x.dtype)

  def StageDevices(self) -> List[str]:
    """The K devices of this replica's stages (see `keras/devices.py`)."""
    devices = devices_lib.ReplicaStageDevices(self.num_stages, self.devices)
    if devices != self._logged_devices:
      self._logged_devices = devices
      logging.info('%s: stage devices %s for partition %s', self.name,
                   devices, self.partition)
    return devices

  def NumMicroBatches(self, batch_size: Optional[int]) -> int:
    """M for a mini-batch of `batch_size` (None if unknown statically).

    Raises:
      ValueError: if the batch does not split into M micro-batches.
    """
    return self._pipelined_call.NumMicroBatches(batch_size)

  def Engine(self, num_micro_batches: int) -> str:
    """The engine that builds a call with M micro-batches here.

    'loop' for engine='auto' when XLA compiles the call (`engine.xla`).
    """
    return self._pipelined_call.Engine(num_micro_batches, self.StageDevices())

  def _LossInputs(self, inputs) -> Tuple[Any, Any]:
    """(x, labels) of a call with the loss inside.

    Args:
      inputs: The call's inputs (tensors or KerasTensors).

    Returns:
      (x, labels).

    Raises:
      ValueError: unless `inputs` is a pair whose batch sizes agree.
    """
    if not (isinstance(inputs, (tuple, list)) and len(inputs) == 2 and
            all(hasattr(t, 'shape') and len(t.shape) for t in inputs)):
      raise ValueError(
          f'{self.name} computes the loss inside the pipeline (schedule='
          f'{self.schedule!r}) and takes (inputs, labels), two tensors with '
          f'the batch on axis 0; got {_Describe(inputs)}.')
    x, labels = inputs
    if None not in (x.shape[0], labels.shape[0]) and (x.shape[0] !=
                                                      labels.shape[0]):
      raise ValueError(
          f'{self.name}: the inputs ({x.shape[0]} examples, shape '
          f'{tuple(x.shape)}) and labels ({labels.shape[0]}, shape '
          f'{tuple(labels.shape)}) must have the same batch size on axis 0.')
    return x, labels

  @tf.autograph.experimental.do_not_convert
  def call(self, inputs, training=None):
    """Runs the layers as a pipeline.

    Args:
      inputs: One tensor, the first layer's input; axis 0 is the batch. With
        the loss inside: (that tensor, the labels), the loss's y_true.
      training: Passed to every layer that takes it; also whether the call
        is set up for a backward pass (recompute). With the loss inside,
        False runs the forward passes alone (no gradients: give True to
        train).

    Returns:
      The last layer's output, merged back into the mini-batch; with the
      loss inside, the mean over micro-batches of their losses (float
      scalar), whose gradients the pipeline computed.

    Raises:
      ValueError: if the input is not one tensor (with the loss inside, a
        pair `_LossInputs` accepts) or does not split into M micro-batches.
    """
    if self.loss_inside:
      inputs = list(self._LossInputs(inputs))
    elif tf.is_tensor(inputs):
      inputs = [inputs]
    else:
      raise ValueError(
          f'{self.name} takes one tensor, as keras.Sequential does; got '
          f'{type(inputs).__name__}.')
    if training is not None and not isinstance(training, bool):
      raise ValueError(f'training={training!r} must be True, False or None.')
    training = bool(training)
    num_micro = self._pipelined_call.Prepare(
        inputs, training, functools.partial(self._MicroBatchCosts, inputs[0]))
    if inputs[0].shape[0] is None and num_micro > 1:
      inputs[0] = self._CheckDynamicSplit(inputs[0], num_micro)
    chunks = [stages.Chunk(layers) for layers in
              config.ChunkCells(self._layers_list, self.partition)]
    stage_fns = [chunk.StageFunction(training) for chunk in chunks]
    if self.loss_inside:
      stage_fns = [stages.CarryLabels(fn, self.loss if c == len(chunks) - 1
                                      else None)
                   for c, fn in enumerate(stage_fns)]
    (outputs,), final_states = self._pipelined_call.Run(
        stage_fns, self.StageDevices(), [chunk.Theta() for chunk in chunks],
        inputs, [chunk.InitialState() for chunk in chunks], num_micro,
        training)
    if training:
      for chunk, state in zip(chunks, final_states):
        chunk.ApplyUpdates(state)
    return outputs

  def _CheckDynamicSplit(self, inputs: tf.Tensor,
                         num_micro: int) -> tf.Tensor:
    """`inputs`, checked at run time to split into M micro-batches."""
    batch = tf.shape(inputs, out_type=tf.int64)[0]
    check = tf.debugging.assert_equal(
        batch % num_micro, tf.constant(0, tf.int64),
        message=(f'{self.name}: num_micro_batches={num_micro} must divide '
                 'the batch size; with model.fit/evaluate/predict use a '
                 'batch_size that M divides and a number of samples that '
                 'the batch size divides (or a dataset with '
                 'drop_remainder=True)'))
    with tf.control_dependencies([check]):
      return tf.identity(inputs)
