"""Keras 3 layers as the engine's stage functions.

A chunk of the pipeline is a run of Keras layers. `Chunk` turns it into the
engine's contract `(theta, inputs, state, micro_batch_id) -> (outputs,
state)` by calling each layer statelessly: what `layer.stateless_call(
trainable, non_trainable, x)` does (a `keras.StatelessScope` that maps every
variable to a given value and collects the values the call assigns), through
the layer's `__call__` as `keras.Sequential` calls it. Every variable reaches
the layer explicitly, in one of three roles:

* trainable weights travel in `theta`, so the engine's gradients reach the
  variables;
* the moving mean and variance of a training `BatchNormalization` (at any
  depth inside the layers) travel in `theta` too: they are read-only during
  the step. Each such layer normalizes a micro-batch with that micro-batch's
  statistics, as it would on its own; the statistics it computes are folded
  into a (count, mean, variance) accumulator (`engine.moments`) that the
  stage carries as state, and `ApplyUpdates` moves the moving averages once
  per step with the whole mini-batch's moments, exactly as the plain layer
  would with the whole batch (the GPipe paper's rule, as in
  `lingvo_gpipe.batchnorm`);
* every other non-trainable variable is stage state: Keras seed generators
  (Dropout, GaussianNoise, ...), counters, frozen statistics. The engine saves
  the state before each micro-batch and the recompute replays from it, so a
  recompute draws exactly the same random masks as the forward pass. Each
  micro-batch advances a seed generator once, so the M micro-batches of a step
  draw M different masks.

A chunk whose batch norm (momentum 0: the moving statistics become the
step's) sees a batch of 1, 3, 5, 7 in two micro-batches:

    >>> dense = keras.layers.Dense(2, kernel_initializer='ones')
    >>> norm = keras.layers.BatchNormalization(momentum=0.0)
    >>> dropout = keras.layers.Dropout(0.5, seed=1)
    >>> _ = keras.Sequential([keras.Input((2,)), dense, norm, dropout])
    >>> chunk = Chunk([dense, norm, dropout])
    >>> fn = chunk.StageFunction(training=True)
    >>> state = chunk.InitialState()
    >>> for m, x in enumerate([[[1.0, 0.0], [3.0, 0.0]],
    ...                        [[5.0, 0.0], [7.0, 0.0]]]):
    ...   (y,), state = fn(chunk.Theta(), (tf.constant(x),), state,
    ...                    tf.constant(m, tf.int64))
    >>> chunk.ApplyUpdates(state)
    >>> norm.moving_mean.numpy().tolist(), norm.moving_variance.numpy().tolist()
    ([4.0, 4.0], [5.0, 5.0])

With the loss inside the pipeline (schedules '1f1b', 'zb1p', 'zbv'),
`CarryLabels` wraps each chunk's stage function: the labels travel with the
micro-batch from chunk to chunk, and the last chunk returns the micro-batch's
mean loss (`MeanLoss`) instead of its output.
"""

import contextlib
import inspect
from typing import (Any, Callable, Dict, Iterator, List, Optional, Sequence,
                    Tuple)

import keras
import tensorflow as tf

from lingvo_gpipe.engine import moments as moments_lib

# Keras loss reductions that return the mean over the examples (the first is
# Keras' default); the pipeline's mean over micro-batches keeps it.
_MEAN_REDUCTIONS = ('sum_over_batch_size', 'mean', 'mean_with_sample_weight')
# A loss as the last chunk applies it: (y_true, y_pred) -> scalar.
LossFn = Callable[[Any, Any], tf.Tensor]


def SubLayers(layer: keras.layers.Layer) -> List[keras.layers.Layer]:
  """`layer` and every layer inside it, at any depth."""
  # Layer._flatten_layers is Keras 3's own walk (private); without it, only
  # the layer itself is inspected.
  flatten = getattr(layer, '_flatten_layers', None)
  if flatten is None:
    return [layer]
  return list(flatten(include_self=True, recursive=True))


def _Describe(layer: keras.layers.Layer) -> str:
  return f"'{layer.name}' ({type(layer).__name__})"


def CheckBatchNorm(bn: keras.layers.BatchNormalization,
                   owner: keras.layers.Layer) -> None:
  """Raises ValueError for batch norm options the pipeline cannot honour.

  Args:
    bn: A BatchNormalization layer among the pipeline's layers.
    owner: The pipeline's layer that holds it (itself or an ancestor).

  Raises:
    ValueError: for renorm=True or synchronized=True, naming what to use.
  """
  where = ('' if bn is owner else f' inside {_Describe(owner)}')
  if getattr(bn, 'renorm', False):
    raise ValueError(
        f'BatchNormalization {_Describe(bn)}{where} has renorm=True, which '
        'the pipeline does not support (its corrections would follow each '
        'micro-batch); use renorm=False, or LayerNormalization / '
        'GroupNormalization, which have no batch statistics.')
  if getattr(bn, 'synchronized', False):
    raise ValueError(
        f'BatchNormalization {_Describe(bn)}{where} has synchronized=True, '
        'which the pipeline does not support (a cross-replica reduction in '
        'every micro-batch); use synchronized=False: each replica then '
        'updates the moving statistics from its whole mini-batch.')


def CheckLayers(layers: Sequence[keras.layers.Layer]) -> None:
  """Raises for what the pipeline cannot run, before anything is built.

  Checks every layer at any depth: batch norm options (`CheckBatchNorm`) and
  activity regularizers, whose losses a call adds.

  Args:
    layers: The pipeline's layers.

  Raises:
    ValueError: naming the layer and what to use instead.
  """
  for layer in layers:
    for sub in SubLayers(layer):
      if isinstance(sub, keras.layers.BatchNormalization):
        CheckBatchNorm(sub, layer)
      if getattr(sub, 'activity_regularizer', None) is not None:
        where = '' if sub is layer else f' inside {_Describe(layer)}'
        raise ValueError(
            f'Layer {_Describe(sub)}{where} has an activity regularizer, '
            'whose loss the pipeline cannot return per micro-batch; use '
            'weight regularizers, or compute the loss outside '
            'GPipeSequential.')


def _AcceptsTraining(layer: keras.layers.Layer) -> bool:
  """Whether `layer.call` takes a `training` argument."""
  parameters = inspect.signature(layer.call).parameters
  return 'training' in parameters or any(
      p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())


class LayerVariables:
  """How one Keras layer's variables travel through the pipeline.

  Attributes:
    layer: The Keras layer.
    trainable: Its trainable variables, in `layer.trainable_variables` order.
    non_trainable: Its non-trainable variables, in order.
    fixed: One bool per non-trainable variable: True for a training batch
      norm's moving statistic (read-only in the step, passed in theta), False
      for stage state.
    batch_norms: The training BatchNormalization layers at any depth inside.
    accepts_training: Whether its call takes `training`.
  """

  def __init__(self, layer: keras.layers.Layer):
    self.layer = layer
    self.trainable = list(layer.trainable_variables)
    self.non_trainable = list(layer.non_trainable_variables)
    self.batch_norms = []
    moving = set()
    for sub in SubLayers(layer):
      if isinstance(sub, keras.layers.BatchNormalization) and sub.trainable:
        CheckBatchNorm(sub, layer)
        self.batch_norms.append(sub)
        moving.update({id(sub.moving_mean), id(sub.moving_variance)})
    self.fixed = [id(v) in moving for v in self.non_trainable]
    self.accepts_training = _AcceptsTraining(layer)

  def State(self) -> List[Any]:
    return [v for v, f in zip(self.non_trainable, self.fixed) if not f]

  def Call(self, weights: List[tf.Tensor], non_trainable: List[tf.Tensor],
           x: tf.Tensor,
           training: bool) -> Tuple[tf.Tensor, List[tf.Tensor], List[bool]]:
    """Calls the layer on `x` with the given variable values, statelessly.

    What `layer.stateless_call` does, but through the layer's `__call__`
    (input casting, autocast, activity regularizers), as `keras.Sequential`
    calls its layers: inside a `keras.StatelessScope` that maps every
    variable to the value given and collects the values assigned.

    Args:
      weights: Values of `trainable`.
      non_trainable: Values of `non_trainable`.
      x: The input.
      training: Passed on if the layer's call takes it.

    Returns:
      (y, state, changed): the output; the new values of the state entries
      (not fixed); whether the call assigned each of them.

    Raises:
      ValueError: if the layer adds losses or returns anything but one
        tensor without a mask.
    """
    mapping = list(zip(self.trainable, weights)) + list(
        zip(self.non_trainable, non_trainable))
    kwargs = {'training': training} if self.accepts_training else {}
    with keras.StatelessScope(state_mapping=mapping,
                              collect_losses=True) as scope:
      before = [scope.get_current_value(v) for v in self.non_trainable]
      y = self.layer(x, **kwargs)
    if scope.losses:
      raise ValueError(
          f'Layer {_Describe(self.layer)} adds losses in its call (add_loss '
          'or an activity regularizer), which the pipeline cannot return per '
          'micro-batch; use weight regularizers, or compute the loss outside '
          'GPipeSequential.')
    if not tf.is_tensor(y):
      raise ValueError(
          f'Layer {_Describe(self.layer)} returned {type(y).__name__}, not '
          'one tensor; as in keras.Sequential, every layer of '
          'GPipeSequential takes one tensor and returns one.')
    if getattr(y, '_keras_mask', None) is not None:
      raise ValueError(
          f'Layer {_Describe(self.layer)} returns a mask (e.g. '
          'Embedding(mask_zero=True)); GPipeSequential does not carry masks '
          'from layer to layer. Compute the mask outside and drop it here.')
    new, changed = [], []
    for v, old, fixed in zip(self.non_trainable, before, self.fixed):
      if not fixed:
        value = scope.get_current_value(v)
        new.append(value)
        changed.append(value is not old)
    return y, new, changed

  def Fixed(self) -> List[Any]:
    return [v for v, f in zip(self.non_trainable, self.fixed) if f]


@contextlib.contextmanager
def _RecordMoments(
    batch_norms: Sequence[keras.layers.BatchNormalization]
) -> Iterator[Dict[int, tf.Tensor]]:
  """Records the moments each batch norm normalizes with while traced.

  Wraps each layer's `_moments` (Keras 3's BatchNormalization computes the
  batch mean and variance there, private) for the duration of the context;
  the result maps id(layer) to its [3, ...] moments (count, mean, variance)
  of the last call.

  Args:
    batch_norms: Training BatchNormalization layers.

  Yields:
    The dict of recorded moments, filled as the layers are called.

  Raises:
    ValueError: if a layer has no `_moments` (another Keras version) or is
      called with a mask.
  """
  records = {}
  for bn in batch_norms:
    original = getattr(bn, '_moments', None)
    if original is None:
      raise ValueError(
          f'BatchNormalization {_Describe(bn)}: this Keras version ('
          f'{keras.__version__}) has no BatchNormalization._moments to read '
          'micro-batch statistics from; freeze it (trainable=False) or use '
          'LayerNormalization.')

    def Recording(inputs, mask, bn=bn, original=original):
      if mask is not None:
        raise ValueError(
            f'BatchNormalization {_Describe(bn)} is called with a mask; the '
            'pipeline accumulates unmasked batch statistics only.')
      mean, variance = original(inputs, mask)
      shape = bn.moving_mean.shape
      size = tf.cast(tf.size(inputs, out_type=tf.int64), tf.float32)
      count = size / float(max(shape.num_elements(), 1))
      records[id(bn)] = moments_lib.Moments(
          count, tf.reshape(tf.cast(mean, tf.float32), shape),
          tf.reshape(tf.cast(variance, tf.float32), shape))
      return mean, variance

    object.__setattr__(bn, '_moments', Recording)
  try:
    yield records
  finally:
    for bn in batch_norms:
      object.__delattr__(bn, '_moments')


class Chunk:
  """A run of Keras layers on one device: the engine's stage function.

  Attributes:
    layers: The layers, in order.
  """

  def __init__(self, layers: Sequence[keras.layers.Layer]):
    """Sorts each layer's variables into theta and state (see module doc).

    Args:
      layers: Built Keras layers; layer i's output is layer i + 1's input.

    Raises:
      ValueError: for a batch norm the pipeline cannot honour.
    """
    self.layers = list(layers)
    self._vars = [LayerVariables(layer) for layer in self.layers]
    self._batch_norms = [bn for v in self._vars for bn in v.batch_norms]
    # Which state entries a trace of the stage assigned (per layer, per
    # entry): only those are written back after the step.
    self._assigned = [[False] * len(v.State()) for v in self._vars]

  def Theta(self) -> Dict[str, List[List[Any]]]:
    """The chunk's read-only inputs of a step: weights and moving statistics.

    Returns:
      {'weights': per layer its trainable variables, 'moving': per layer the
      moving statistics of its training batch norms (as tensors)}.
    """
    return {
        'weights': [list(v.trainable) for v in self._vars],
        'moving': [[tf.convert_to_tensor(x) for x in v.Fixed()]
                   for v in self._vars],
    }

  def InitialState(self) -> Dict[str, List[Any]]:
    """The chunk's state before the step's first micro-batch.

    Returns:
      {'variables': per layer the values of its other non-trainable
      variables, 'moments': per training batch norm zero moments}.
    """
    return {
        'variables': [[tf.convert_to_tensor(x) for x in v.State()]
                      for v in self._vars],
        'moments': [moments_lib.ZeroMoments(bn.moving_mean.shape)
                    for bn in self._batch_norms],
    }

  def StageFunction(
      self, training: bool
  ) -> Callable[[Any, Tuple[tf.Tensor, ...], Any, tf.Tensor],
                Tuple[Tuple[tf.Tensor], Any]]:
    """The engine's stage function of this chunk.

    Args:
      training: Passed to every layer that takes `training`.

    Returns:
      (theta, inputs, state, micro_batch_id) -> ((y,), state). The id is not
      used: randomness comes from the seed generators in the state.
    """

    def StageFn(theta, inputs, state, micro_batch_id):
      del micro_batch_id  # Seeds travel in the state.
      (y,) = inputs
      new_variables = []
      with _RecordMoments(self._batch_norms if training else []) as records:
        for i, v in enumerate(self._vars):
          fixed = iter(theta['moving'][i])
          others = iter(state['variables'][i])
          non_trainable = [next(fixed) if f else next(others)
                           for f in v.fixed]
          y, new, changed = v.Call(list(theta['weights'][i]),
                                   non_trainable, y, training)
          for j, assigned in enumerate(changed):
            self._assigned[i][j] = self._assigned[i][j] or assigned
          new_variables.append(new)
      moments = [
          moments_lib.CombineMoments(acc, records[id(bn)])
          if id(bn) in records else acc
          for acc, bn in zip(state['moments'], self._batch_norms)
      ]
      return (y,), {'variables': new_variables, 'moments': moments}

    return StageFn

  def ApplyUpdates(self, state: Dict[str, List[Any]]) -> None:
    """Writes a step's final state back into the variables.

    Non-trainable variables that a stage call assigned get their value after
    the last micro-batch; each training batch norm's moving mean and variance
    move once, with the moments of all micro-batches together:
    moving = moving * momentum + batch * (1 - momentum), as
    `keras.layers.BatchNormalization` does for one batch.

    Args:
      state: The chunk's state after the step's last micro-batch.
    """
    for i, v in enumerate(self._vars):
      for variable, value, assigned in zip(v.State(), state['variables'][i],
                                           self._assigned[i]):
        if assigned:
          variable.assign(value)
    for bn, acc in zip(self._batch_norms, state['moments']):
      seen = acc[moments_lib.COUNT] > 0
      for moving, row in ((bn.moving_mean, moments_lib.MEAN),
                          (bn.moving_variance, moments_lib.VARIANCE)):
        old = tf.cast(moving, tf.float32)
        updated = old * bn.momentum + acc[row] * (1.0 - bn.momentum)
        moving.assign(tf.cast(tf.where(seen, updated, old), moving.dtype))


def MeanLoss(loss: Any) -> LossFn:
  """The loss a pipeline with the loss inside applies to each micro-batch.

  The pipeline returns the mean over micro-batches of each micro-batch's
  loss, which is the mini-batch's loss only if each micro-batch's loss is a
  mean over its examples.

  Args:
    loss: A `keras.losses.Loss` with a mean reduction, a name or config that
      `keras.losses.get` resolves, or a callable (y_true, y_pred) -> loss.

  Returns:
    (y_true, y_pred) -> scalar: the Loss itself; a callable's result, or the
    mean of it if it is not a scalar (as `model.compile` reduces a loss
    function), with y_true passed as given.

  Raises:
    ValueError: if `loss` is none of these, or sums (reduction 'sum') or does
      not reduce (None, 'none').
  """
  try:
    resolved = keras.losses.get(loss) if isinstance(loss, (str, dict)) else loss
  except (ValueError, TypeError) as e:
    raise ValueError(f'loss={loss!r} is not a Keras loss: {e}') from e
  if isinstance(resolved, keras.losses.Loss):
    if resolved.reduction not in _MEAN_REDUCTIONS:
      raise ValueError(
          f'loss={loss!r} has reduction={resolved.reduction!r}; the pipeline '
          'returns the mean of the micro-batches\' losses, which is the '
          "mini-batch's loss only for a mean: use reduction="
          f'{_MEAN_REDUCTIONS[0]!r}.')
    return resolved
  if not callable(resolved):
    raise ValueError(
        f'loss={loss!r} must be a keras.losses.Loss, a loss name or a '
        'callable (y_true, y_pred) -> loss.')

  def Mean(y_true, y_pred):
    value = tf.convert_to_tensor(resolved(y_true, y_pred))
    return value if value.shape.rank == 0 else tf.reduce_mean(value)

  return Mean


def CarryLabels(
    stage_fn: Callable[..., Tuple[Tuple[tf.Tensor], Any]],
    loss: Optional[LossFn] = None
) -> Callable[..., Tuple[Tuple[tf.Tensor, ...], Any]]:
  """A chunk's stage function when the labels travel with the micro-batch.

  With the loss inside the pipeline (schedules '1f1b', 'zb1p', 'zbv') each
  micro-batch is (x, labels): every chunk passes the labels on unchanged,
  and the last one returns its micro-batch's loss instead of its output.

  Args:
    stage_fn: A `Chunk.StageFunction`, (theta, (x,), state, id) -> ((y,),
      state).
    loss: For the last chunk, `MeanLoss`; None for the others.

  Returns:
    (theta, (x, labels), state, id) -> ((y, labels), state), or ((loss,),
    state) for the last chunk.
  """

  def StageFn(theta, inputs, state, micro_batch_id):
    x, labels = inputs
    (y,), state = stage_fn(theta, (x,), state, micro_batch_id)
    if loss is None:
      return (y, labels), state
    value = loss(labels, y)
    if value.shape.rank != 0 or not value.dtype.is_floating:
      raise ValueError(
          f'loss={loss!r} returned {value!r} on a micro-batch; the pipeline '
          'needs a float scalar, the mean loss of the micro-batch.')
    return (value,), state

  return StageFn
