"""Batch norm that stays correct when GPipe splits the batch into micro-batches.

A batch of 1, 3, 5, 7 (first channel) in two micro-batches; the moving mean
moves once, towards the batch's mean 4, by 1 - decay:

    >>> from lingvo.core import layers
    >>> from lingvo_gpipe import GPipeSequentialLayer
    >>> bn = BatchNormLayer.Params().Set(name='bn', dim=2, decay=0.5)
    >>> fc = layers.FCLayer.Params().Set(name='fc', input_dim=2, output_dim=2)
    >>> pipe = GPipeSequentialLayer.Params().Set(
    ...     name='pipe', cell_tpl=[bn, fc], num_stages=2,
    ...     num_micro_batches=2).Instantiate()
    >>> x = tf.constant([[1.0, 0.0], [3.0, 0.0], [5.0, 0.0], [7.0, 0.0]])
    >>> y = pipe.FProp(pipe.theta, x)
    >>> _ = pipe.bn.PostTrainingStepUpdate()  # Lingvo's BaseTask, once a step.
    >>> pipe.bn.vars.moving_mean.numpy().tolist()
    [2.0, 0.0]

Lingvo's `bn_layers.BatchNormLayer` registers its moving-average update with
`py_utils.UpdateBatchNormVars` from inside FProp. Inside `GPipeSequentialLayer`
FProp is traced into a stage function, so that update op lives in the
function: it runs once per micro-batch call (and again in recomputes), with
micro-batch statistics, and never reaches the trainer's `bn_updates`.

`BatchNormLayer` here takes the same Params. In training inside a pipeline it
normalizes each micro-batch with that micro-batch's statistics (as Lingvo's
layer would on it), and adds the micro-batch's padding-aware (count, mean,
variance) to a Lingvo accumulator that the pipeline threads from micro-batch
to micro-batch. `PostTrainingStepUpdate`, which Lingvo's `BaseTask` runs once
per training step, turns the accumulated whole-mini-batch moments into the
usual `py_utils.UpdateBatchNormVars` update (moving -= (moving - stat) *
(1 - decay)). The GPipe paper's rule; torchgpipe's `DeferredBatchNorm`.

Outside a pipeline the layer is Lingvo's `BatchNormLayer` unchanged.
"""

from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import bn_layers
from lingvo.core import py_utils

from lingvo_gpipe.engine import moments as moments_lib

# Rows of the accumulated moments: [3, dim] = (count, mean, variance); the
# combination is shared with the Keras front end (`engine.moments`).
_MEAN, _VARIANCE = moments_lib.MEAN, moments_lib.VARIANCE
CombineMoments = moments_lib.CombineMoments


class MomentsAccumulator(base_layer.Accumulator):
  """A Lingvo accumulator of batch moments: [3, dim] (count, mean, variance).

  `Update(moments)` folds in the moments of more samples with
  `CombineMoments`. The pipeline threads its value through the micro-batches
  and sets the final value on the layer after FProp.
  """

  def __init__(self, dim, dtype):
    """Creates the accumulator.

    Args:
      dim: The number of channels.
      dtype: The dtype of the accumulated moments.
    """
    super().__init__()
    self._dim = dim
    self._dtype = dtype

  def DefaultValue(self):
    """Zero samples: count, mean and variance 0."""
    return tf.zeros([3, self._dim], dtype=self._dtype)

  def Update(self, moments):
    """Adds the [3, dim] `moments` of more samples."""
    self.SetValue(CombineMoments(self.GetValue(), tf.cast(moments,
                                                          self._dtype)))

  @property
  def has_value(self):
    """Whether FProp or a pipeline has set a value since the last Reset."""
    return self._value is not None


class BatchNormLayer(bn_layers.BatchNormLayer):
  """Lingvo's BatchNormLayer, with moving statistics of the whole mini-batch.

  Inside a `GPipeSequentialLayer` (or with accumulate_stats=True), training
  FProp normalizes with the statistics of its micro-batch and accumulates
  them; `PostTrainingStepUpdate` updates moving_mean and moving_variance once
  from the moments of all micro-batches together. Elsewhere it behaves exactly
  like `lingvo.core.bn_layers.BatchNormLayer` (`layers.BatchNormLayer`):

      >>> bn = BatchNormLayer.Params().Set(name='bn', dim=2).Instantiate()
      >>> x = tf.constant([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])
      >>> paddings = tf.constant([[0.0], [0.0], [1.0]])  # The last row.
      >>> bn.FProp(bn.theta, x, paddings).numpy().round(3).tolist()
      [[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]]
      >>> bn.AccumulatesStats()
      False
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'accumulate_stats', None, 'Whether training FProp accumulates its '
        'moments for PostTrainingStepUpdate instead of registering Lingvo\'s '
        'per-call moving-average update: None decides by whether a '
        'GPipeSequentialLayer holds the layer; True for other layers that '
        'thread accumulators through micro-batches; False forces Lingvo\'s '
        'behaviour.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.accumulate_stats not in (None, True, False):
      raise ValueError(f'accumulate_stats={p.accumulate_stats!r} must be '
                       'None, True or False.')
    self.RegisterAccumulator('moments', MomentsAccumulator(p.dim, p.dtype))
    self._micro_batched = False

  def MarkMicroBatched(self):
    """Called by a micro-batching ancestor (`GPipeSequentialLayer`) at init."""
    self._micro_batched = True

  def AccumulatesStats(self):
    """Whether training FProp accumulates moments (see accumulate_stats)."""
    p = self.params
    if p.accumulate_stats is None:
      return self._micro_batched
    return p.accumulate_stats

  def ComputeAndUpdateMoments(self, theta, inputs, paddings=None, **kwargs):
    """Computes the moments to normalize with and records the update.

    Outside micro-batching, in eval or with frozen statistics this is Lingvo's
    method. Otherwise the micro-batch's (count, mean, variance) are added to
    the `moments` accumulator instead of registering an update op.

    Args:
      theta: A `.NestedMap` of the layer's weights.
      inputs: The inputs, shaped [..., dim].
      paddings: The paddings, shaped [..., 1], same rank as `inputs`, or None.
      **kwargs: Passed to `_GetBetaGamma`.

    Returns:
      Tuple of (mean, variance, beta, gamma) to normalize with.
    """
    p = self.params
    if self.do_eval or p.freeze_bn_stats or not self.AccumulatesStats():
      return super().ComputeAndUpdateMoments(theta, inputs, paddings, **kwargs)
    if paddings is None:
      paddings = self._GetDefaultPaddings(inputs)
    with tf.name_scope(p.name):
      reduce_over_dims = tf.range(0, tf.rank(paddings) - 1)
      mean, variance = bn_layers.ComputeMoments(
          inputs, paddings, reduce_over_dims, None,
          p.enable_cross_replica_sum_on_tpu)
      count = tf.reduce_sum(
          py_utils.ApplyPadding(paddings, tf.ones_like(inputs[..., :1])))
      if py_utils.use_tpu() and p.enable_cross_replica_sum_on_tpu:
        count = tf.tpu.cross_replica_sum(count)
      self.accumulators.moments.Update(
          tf.stop_gradient(
              tf.stack([tf.broadcast_to(count, tf.shape(mean)), mean,
                        variance])))
      if p.use_moving_avg_in_training:
        norm_mean, norm_variance = theta.moving_mean, theta.moving_variance
      else:
        norm_mean, norm_variance = mean, variance
      norm_mean = py_utils.CheckNumerics(
          norm_mean, f'mean of {p.name} failed numeric check')
      norm_variance = py_utils.CheckNumerics(
          norm_variance, f'variance of {p.name} failed numeric check')
      beta, gamma = self._GetBetaGamma(theta, inputs, **kwargs)
      return norm_mean, norm_variance, beta, gamma

  def PostTrainingStepUpdate(self):
    """Updates the moving statistics from the accumulated moments.

    Lingvo's `BaseTask` calls this once per training step, after the gradient
    updates and the `bn_updates`. If FProp accumulated nothing (outside a
    pipeline the update is Lingvo's `bn_updates` entry) it does nothing.

    Returns:
      The update op.
    """
    acc = self.accumulators.moments
    ops = [super().PostTrainingStepUpdate()]
    if acc.has_value:
      moments = acc.GetValue()
      with tf.name_scope(self.params.name):
        ops.append(py_utils.UpdateBatchNormVars(
            self.vars.moving_mean, moments[_MEAN], self._decay))
        ops.append(py_utils.UpdateBatchNormVars(
            self.vars.moving_variance, moments[_VARIANCE], self._decay))
      acc.Reset()
    return tf.group(*ops)
