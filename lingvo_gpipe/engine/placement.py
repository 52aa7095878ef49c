"""Which device each pipeline stage runs on.

Lingvo-free: the layer passes in what it knows about the Lingvo cluster. The
rules of `StageDevices`, first match wins:

1. explicit devices (one per stage);
2. the model split's first K devices when it has at least K (Lingvo
   cluster): stage k on the split's device k, as Lingvo's PipeliningLayer;
3. one stage: the default device (placement left to TensorFlow);
4. the first K local logical devices of one type (GPU, then CPU);
5. otherwise the default device for every stage, with a warning.

With four logical CPU devices (as tests/conftest.py makes):

    >>> StageDevices(2, explicit=['/cpu:1', '/cpu:0'])
    ['/cpu:1', '/cpu:0']
    >>> StageDevices(2, model_split=['/job:trainer/device:CPU:0',
    ...                              '/job:trainer/device:CPU:1'])
    ['/job:trainer/device:CPU:0', '/job:trainer/device:CPU:1']
    >>> StageDevices(1)
    ['']
    >>> [device.split('/')[-1] for device in StageDevices(4)]
    ['device:CPU:0', 'device:CPU:1', 'device:CPU:2', 'device:CPU:3']

TPU placement is `tpu.py`.
"""

from typing import List, Optional, Sequence

from absl import logging
import tensorflow as tf

_LOCAL_DEVICE_TYPES = ('GPU', 'CPU')


def CheckDevices(devices: Optional[Sequence[str]], num_stages: int) -> None:
  """Raises ValueError unless `devices` is None or has one string per stage."""
  if devices is None:
    return
  if isinstance(devices, str) or len(devices) != num_stages or not all(
      isinstance(d, str) for d in devices):
    raise ValueError(f'devices={devices!r} must be a list of {num_stages} '
                     'device strings, one per stage, or None.')


def LocalDevices(num_stages: int) -> Optional[List[str]]:
  """The first K local logical devices of one type, or None if none has K."""
  for device_type in _LOCAL_DEVICE_TYPES:
    devices = tf.config.list_logical_devices(device_type)
    if len(devices) >= num_stages:
      return [d.name for d in devices[:num_stages]]
  return None


def StageDevices(num_stages: int,
                 explicit: Optional[Sequence[str]] = None,
                 model_split: Optional[Sequence[str]] = None) -> List[str]:
  """Resolves the device of every stage.

  Args:
    num_stages: K.
    explicit: The user's device list, or None.
    model_split: The devices of the Lingvo model split (or any cluster notion
      of "the devices of one model replica"), or None. Used when it has at
      least K devices: stage k runs on model_split[k].

  Returns:
    K device strings; '' means the default device.

  Raises:
    ValueError: if `explicit` does not have K strings.
  """
  CheckDevices(explicit, num_stages)
  if explicit is not None:
    return list(explicit)
  if model_split is not None and len(model_split) >= num_stages:
    return list(model_split[:num_stages])
  if num_stages == 1:
    return ['']
  local = LocalDevices(num_stages)
  if local is not None:
    return local
  logging.warning(
      'No %d devices of one type found (model split: %s, local: %s); all %d '
      'stages run on the default device. Pass devices=[...] or create logical '
      'devices to pipeline across devices.', num_stages, model_split,
      [d.name for d in tf.config.list_logical_devices()], num_stages)
  return [''] * num_stages
