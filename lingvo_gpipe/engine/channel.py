"""Channels: tensors sent in order from one device to another.

A channel is a Send and a Recv op that share a rendezvous key (TensorFlow's
own `_Send`/`_Recv`, which its graph partitioner inserts between devices).
The loop engine's per-device loops pass a chunk's outputs and gradients over
channels, as Lingvo's `StackedRecurrent` does: the k-th Recv of a channel in
one step gets the tensor of its k-th Send. Keys carry no loop frame, so both
ends must sit in functional (unlowered) While loops, or outside loops as
here, and XLA compiles neither op.

    >>> send_device = FullDeviceName('/cpu:0')
    >>> send_device
    '/job:localhost/replica:0/task:0/device:CPU:0'
    >>> ch = Channel(tf.TensorSpec([2], tf.float32), send_device,
    ...              FullDeviceName('/cpu:1'), 'edge1_data')
    >>> with tf.Graph().as_default():
    ...   with tf.device(send_device):
    ...     sent = ch.Send(tf.constant([1.0, 2.0]))
    ...   with tf.device(ch.recv_device):
    ...     y = ch.Recv()
    ...   config = tf.compat.v1.ConfigProto(device_count={'CPU': 2})
    ...   with tf.compat.v1.Session(config=config) as session:
    ...     _, received = session.run([sent, y])
    >>> received.tolist()
    [1.0, 2.0]
"""

import itertools
from typing import Optional

import tensorflow as tf

# Keys must be unique in a step even across functions that TensorFlow inlines
# into one graph; a process-wide counter makes them so.
_IDS = itertools.count()


def FullDeviceName(device: str) -> Optional[str]:
  """The fully specified name of `device`, or None if it has none.

  Rendezvous keys name both devices in full (job, replica, task, type,
  index). A partial name is completed as a local session names its devices:
  job 'localhost', replica 0, task 0 ('/cpu:1' is
  '/job:localhost/replica:0/task:0/device:CPU:1').

  Args:
    device: A device string, possibly partial or empty.

  Returns:
    '/job:J/replica:R/task:T/device:TYPE:I', or None if `device` names no
    device type and index.
  """
  spec = tf.DeviceSpec.from_string(device or '')
  if spec.device_type is None or spec.device_index is None:
    return None
  local = tf.DeviceSpec(job='localhost', replica=0, task=0)
  return local.make_merged_spec(spec).to_string()


class Channel:
  """Sends tensors of one spec from one device to another, in order.

  Attributes:
    spec: The TensorSpec of what it carries.
    send_device: The full name of the sending device.
    recv_device: The full name of the receiving device.
    key: The tensor name both ops share.
  """

  def __init__(self, spec: tf.TensorSpec, send_device: str, recv_device: str,
               name: str):
    self.spec = spec
    self.send_device = send_device
    self.recv_device = recv_device
    self.key = f'{name}_{next(_IDS)}'

  def Send(self, t: tf.Tensor) -> tf.Operation:
    """The op that sends `t` (build it on the sending device)."""
    return tf.raw_ops.Send(
        tensor=t, tensor_name=self.key, send_device=self.send_device,
        send_device_incarnation=0, recv_device=self.recv_device)

  def Recv(self) -> tf.Tensor:
    """The next tensor sent (build it on the receiving device)."""
    t = tf.raw_ops.Recv(
        tensor_type=self.spec.dtype, tensor_name=self.key,
        send_device=self.send_device, send_device_incarnation=0,
        recv_device=self.recv_device)
    t.set_shape(self.spec.shape)
    return t
