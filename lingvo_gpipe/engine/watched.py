"""Which pipeline inputs a gradient can be asked for, as TensorFlow sees it.

With the loss outside the pipeline (GPipe) the backward pass is built when
someone asks for gradients, and TensorFlow computes the input gradients that
were asked for. With the loss inside (1F1B) the backward runs in the forward
pass, before anyone asks: the engine must decide which input gradients to
compute, and each one costs a micro-batch of memory (and, for a dense first
cell, a matmul) per micro-batch. `WatchedInputs` gives TensorFlow's answer:

* Under a recording `tf.GradientTape` (eager, or inside a `tf.function`, as
  Keras and Lingvo's eager trainer run): the inputs the tape watches. The
  tape's gradient of any other tensor is None anyway.
* Executing eagerly without a tape: none; no gradient can be taken later.
* In a graph without a tape (TF1, Lingvo's graph-mode trainer, which
  differentiates with respect to its variables): the inputs that a variable
  or a placeholder feeds through floating-point tensors. An input computed
  from constants, random numbers or an input pipeline only has no gradient
  (None, as a tape gives for a tensor it does not watch).
"""

from typing import List, Optional, Sequence

import tensorflow as tf

from tensorflow.python.eager import record  # pylint: disable=g-direct-tensorflow-import

from lingvo_gpipe.engine import stage as stage_lib

# Ops that hold or read a variable, or feed a value from outside the graph.
_SOURCES = frozenset([
    'Placeholder', 'PlaceholderWithDefault', 'ReadVariableOp',
    'ResourceGather', 'ResourceGatherNd', 'VarHandleOp', 'Variable',
    'VariableV2'
])
# Ops whose outputs carry no gradient to their inputs.
_STOPS = frozenset(['PreventGradient', 'StopGradient'])


def _FedByVariableOrPlaceholder(t: tf.Tensor) -> bool:
  """Whether a variable or placeholder reaches `t` through float tensors.

  A resource input made by a placeholder or a variable counts too: a function
  call reading a captured variable gets it that way.

  Args:
    t: A graph tensor.

  Returns:
    Whether tf.gradients could find a path from such a source to `t`.
  """
  seen, pending = set(), [t.op]
  while pending:
    op = pending.pop()
    if op in seen:
      continue
    seen.add(op)
    if op.type in _SOURCES or any(
        x.dtype == tf.resource and x.op.type in _SOURCES for x in op.inputs):
      return True
    if op.type not in _STOPS:
      pending.extend(
          x.op for x in op.inputs if stage_lib.IsDifferentiable(x))
  return False


def WatchedInputs(inputs: Sequence[Optional[tf.Tensor]]) -> List[bool]:
  """Per input, whether a gradient can be asked for it (module docstring).

  Args:
    inputs: Tensors or None.

  Returns:
    One bool per input: False for None and for tensors that are not floating
    point or complex.
  """
  watched = []
  for x in inputs:
    if x is None or not stage_lib.IsDifferentiable(x):
      watched.append(False)
    elif record.could_possibly_record():
      watched.append(record.should_record_backprop([x]))
    elif tf.executing_eagerly():
      watched.append(False)
    else:
      watched.append(_FedByVariableOrPlaceholder(x))
  return watched
