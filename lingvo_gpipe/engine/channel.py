"""Channels: tensors sent in order from one device to another.

A channel is a Send and a Recv op that share a rendezvous key (TensorFlow's
own `_Send`/`_Recv`, which its graph partitioner inserts between devices).
The loop engine's per-device loops pass a chunk's outputs and gradients over
channels, as Lingvo's `StackedRecurrent` does: the k-th Recv of a channel in
one step gets the tensor of its k-th Send. Keys carry no loop frame, so both
ends must sit in functional (unlowered) While loops, or outside loops as
here, and XLA compiles neither op.

A Recv in another process (task) than its Send gets the tensor only if the
key names the sending device's incarnation, a number its server draws when
it starts: build the step inside `DeviceIncarnations` with the cluster's
devices (`session.list_devices()`), or the servers refuse the transfer.
Within one process the incarnation is not checked (0 is used).

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

import contextlib
import contextvars
import itertools
from typing import Any, Dict, Iterable, Optional

import tensorflow as tf

# Keys must be unique in a step even across functions that TensorFlow inlines
# into one graph; a process-wide counter makes them so.
_IDS = itertools.count()
# Full device name -> incarnation, for the channels built now
# (`DeviceIncarnations`).
_INCARNATIONS = contextvars.ContextVar('lingvo_gpipe_device_incarnations',
                                       default={})


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


@contextlib.contextmanager
def DeviceIncarnations(devices: Iterable[Any]):
  """Channels built inside name these devices' incarnations in their keys.

  Needed where a step's devices are in several processes, e.g. K stages on
  the K tasks of a cluster: open the session on the cluster first, then
  build the step inside `DeviceIncarnations(session.list_devices())`
  (docs/scaling_out.md). A context variable: scoped to the `with` block and
  its thread.

  Args:
    devices: Devices with a `name` and an `incarnation`, as
      `tf.compat.v1.Session.list_devices()` returns them.

  Yields:
    Nothing.
  """
  token = _INCARNATIONS.set({FullDeviceName(d.name): d.incarnation
                             for d in devices})
  try:
    yield
  finally:
    _INCARNATIONS.reset(token)


def Incarnations() -> Dict[str, int]:
  """Full device name -> incarnation, as `DeviceIncarnations` set them."""
  return dict(_INCARNATIONS.get())


def Task(device: str) -> str:
  """The process of a full device name: '/job:J/replica:R/task:T'."""
  spec = tf.DeviceSpec.from_string(device)
  return f'/job:{spec.job}/replica:{spec.replica}/task:{spec.task}'


class Channel:
  """Sends tensors of one spec from one device to another, in order.

  Attributes:
    spec: The TensorSpec of what it carries.
    send_device: The full name of the sending device.
    recv_device: The full name of the receiving device.
    key: The tensor name both ops share.
    incarnation: The sending device's incarnation (`DeviceIncarnations`;
      0 if not given).
  """

  def __init__(self, spec: tf.TensorSpec, send_device: str, recv_device: str,
               name: str):
    self.spec = spec
    self.send_device = send_device
    self.recv_device = recv_device
    self.key = f'{name}_{next(_IDS)}'
    self.incarnation = _INCARNATIONS.get().get(send_device, 0)

  def Send(self, t: tf.Tensor) -> tf.Operation:
    """The op that sends `t` (build it on the sending device)."""
    return tf.raw_ops.Send(
        tensor=t, tensor_name=self.key, send_device=self.send_device,
        send_device_incarnation=self.incarnation,
        recv_device=self.recv_device)

  def Recv(self) -> tf.Tensor:
    """The next tensor sent (build it on the receiving device)."""
    t = tf.raw_ops.Recv(
        tensor_type=self.spec.dtype, tensor_name=self.key,
        send_device=self.send_device,
        send_device_incarnation=self.incarnation,
        recv_device=self.recv_device)
    t.set_shape(self.spec.shape)
    return t
