"""How expensive each Keras layer is, to choose the pipeline partition.

The Keras counterpart of `lingvo_gpipe.costs`: `ParamCounts` counts trainable
parameters (partition='params'), `ProfileTimes` times each layer's forward
and backward pass on one micro-batch (partition='profile'; the median of
timed runs, as `planning.timing` says, like the Lingvo cells), and
`VariableBytes` gives the memory that `planning.partition.PartitionCosts`
balances; counts and bytes are `planning.sizes`', shared with the Lingvo
cells. Keras layers have no flop estimate, so there is no 'flops'.

    >>> from lingvo_gpipe.planning import partition
    >>> layers = [keras.layers.Dense(32), keras.layers.Dense(8),
    ...           keras.layers.Dense(8)]
    >>> costs = ProfileTimes(layers, micro_batch_shape=(4, 16), num_runs=1)
    >>> len(costs), all(seconds > 0 for seconds in costs)
    (3, True)
    >>> ParamCounts(layers), VariableBytes(layers)  # Built by ProfileTimes.
    ([544.0, 264.0, 72.0], [2176.0, 1056.0, 288.0])
    >>> counts = partition.PartitionCosts(ParamCounts(layers), 2,
    ...                                   memory=VariableBytes(layers))
    >>> counts
    [1, 2]
"""

from typing import List, Sequence

import keras
import numpy as np
import tensorflow as tf

from lingvo_gpipe.keras import stages
from lingvo_gpipe.planning import sizes
from lingvo_gpipe.planning import timing


def ParamCounts(layers: Sequence[keras.layers.Layer]) -> List[float]:
  """The number of trainable parameters of each built layer (may be zero)."""
  return sizes.ParamCounts([layer.trainable_variables for layer in layers])


def VariableBytes(layers: Sequence[keras.layers.Layer]) -> List[float]:
  """Bytes of each built layer's variables, trainable or not."""
  return sizes.VariableBytes([layer.variables for layer in layers],
                             dtype_size=lambda dtype: tf.as_dtype(dtype).size)


def _SampleInput(shape: Sequence[int], dtype: tf.DType) -> tf.Tensor:
  """Normal samples (floats) or zeros (integers, e.g. token ids)."""
  if dtype.is_floating:
    return tf.random.stateless_normal(shape, seed=[0, 0], dtype=dtype)
  return tf.zeros(shape, dtype)


def _TimeLayer(layer: keras.layers.Layer, x: tf.Tensor, num_warmup: int,
               num_runs: int):
  """Times one layer's forward + gradients; returns (seconds, its output)."""
  variables = stages.LayerVariables(layer)
  trainable = [tf.convert_to_tensor(v) for v in variables.trainable]
  non_trainable = [tf.convert_to_tensor(v) for v in variables.non_trainable]

  @tf.function(autograph=False)
  def Step(trainable, non_trainable, x):
    with tf.GradientTape() as tape:
      tape.watch(trainable)
      if x.dtype.is_floating:
        tape.watch(x)
      # Called as in the pipeline (`stages`), with the layer's values.
      y, _, _ = variables.Call(trainable, non_trainable, x, training=True)
      loss = tf.reduce_sum(tf.square(tf.cast(y, tf.float32)))
    wrt = trainable + ([x] if x.dtype.is_floating else [])
    grads = tape.gradient(loss, wrt,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return y, grads

  def Run():
    _, grads = Step(trainable, non_trainable, x)
    for g in grads:
      np.asarray(g)  # Blocks until computed.

  seconds = timing.MedianSeconds(Run, num_warmup, num_runs)
  y, _ = Step(trainable, non_trainable, x)
  return seconds, y


def ProfileTimes(layers: Sequence[keras.layers.Layer],
                 micro_batch_shape: Sequence[int],
                 dtype: tf.DType = tf.float32,
                 num_warmup: int = timing.PROFILE_WARMUP_RUNS,
                 num_runs: int = timing.PROFILE_TIMED_RUNS) -> List[float]:
  """Measured forward + backward seconds of each layer on one micro-batch.

  Layer i + 1 receives layer i's output. Runs eagerly (outside any graph
  being traced), with the layers' current weights; nothing is updated.

  Args:
    layers: Built Keras layers, in order.
    micro_batch_shape: The first layer's input shape for one micro-batch,
      every dimension known.
    dtype: The first layer's input dtype.
    num_warmup: Untimed runs per layer.
    num_runs: Timed runs per layer; their median is the cost.

  Returns:
    One positive float (seconds) per layer.

  Raises:
    ValueError: if a dimension is unknown, or num_runs < 1 or num_warmup < 0.
  """
  timing.CheckRuns(num_warmup, num_runs)
  shape = list(micro_batch_shape)
  if any(d is None for d in shape):
    raise ValueError(f"partition='profile' needs a micro-batch shape with "
                     f'every dimension known, got {shape}.')
  with tf.init_scope():  # Eager, even when called while tracing.
    x = _SampleInput(shape, tf.as_dtype(dtype))
    times = []
    for layer in layers:
      seconds, x = _TimeLayer(layer, x, num_warmup, num_runs)
      times.append(seconds)
  return times

