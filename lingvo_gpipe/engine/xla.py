"""Whether XLA compiles the pipelined step being built: one answer for all.

Two decisions hang on it. `engine='auto'` builds the loop engine under XLA
(`planning.schedule.ChooseEngine`): XLA merges the unrolled engine's
recompute back into the forward pass, so only the loop engine's recompute
saves memory there (docs/engines.md, "Memory under XLA"). And the loop engine
runs one loop per device only outside XLA, which compiles no Send or Recv
(`loop.py`). Both front ends and the engine ask `CompiledByXla`, so a step
that one of them considers compiled, all do.

    >>> def Step():
    ...   return tf.constant(CompiledByXla())
    >>> bool(tf.function(Step, jit_compile=True)())
    True
    >>> bool(tf.function(Step)()), CompiledByXla()  # Without XLA, eagerly.
    (False, False)
    >>> CompiledByXla(['/device:TPU_REPLICATED_CORE:0'])  # A TPU stage.
    True
"""

from typing import Sequence

import tensorflow as tf
# Private, and the only place TensorFlow says whether a graph is built for
# XLA (loop.py imported it directly before this module existed).
# pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import control_flow_util
# pylint: enable=g-direct-tensorflow-import


def IsTpuDevice(device: str) -> bool:
  """Whether `device` names a TPU device ('TPU' or 'TPU_REPLICATED_CORE').

  Args:
    device: A device string; '' (the default device) is not a TPU.

  Returns:
    True for a TPU device.

  Raises:
    ValueError: if `device` is not a device string.
  """
  device_type = tf.DeviceSpec.from_string(device).device_type or ''
  return device_type.upper().startswith('TPU')


def CompiledByXla(devices: Sequence[str] = ()) -> bool:
  """Whether XLA compiles the step being built here, on these stage devices.

  True in two cases, which are the two ways a step ends up as one XLA
  computation:

  * The graph being built is inside an XLA compilation context:
    `tf.function(jit_compile=True)` (Keras' `jit_compile` models), and TPU
    replication (`tpu.rewrite`, `TPUStrategy.run` inside a function, Lingvo's
    TPU trainers), whose replicate context is an XLA context. TensorFlow's
    `control_flow_util.GraphOrParentsInXlaContext` (private) tells.
  * A stage runs on a TPU device: every TPU program is compiled by XLA, so a
    TPU step is compiled even where it is built outside the replicate
    context (e.g. a Lingvo layer under `xla_device='tpu'` asked for its
    engine before the trainer replicates it).

  Not the front end's own notion of "on TPU" (Lingvo's `use_tpu()` flag,
  which the engine cannot read and which says nothing of
  `jit_compile=True` on CPU or GPU): what matters to the engine is whether
  XLA will see the graph, and the graph and the devices say that. Eagerly,
  off TPU, nothing is compiled as a whole: False.

  Args:
    devices: The stage devices of the step (K device strings), or none.

  Returns:
    Whether XLA compiles the step.

  Raises:
    ValueError: if a device is not a device string.
  """
  if any(IsTpuDevice(device) for device in devices):
    return True
  if tf.executing_eagerly():
    return False
  return bool(control_flow_util.GraphOrParentsInXlaContext(
      tf.compat.v1.get_default_graph()))
