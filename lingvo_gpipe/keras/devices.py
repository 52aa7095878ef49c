"""Which device each stage of a Keras pipeline runs on, replicas included.

Without a distribution strategy (or with one replica) this is
`engine.placement.StageDevices`: explicit devices, else one stage on the
default device, else the first K local logical devices of one type. Under a
strategy with R > 1 replicas in sync (e.g. `tf.distribute.MirroredStrategy`),
each replica runs its own pipeline: with devices=None replica r runs stage k
on local device r * K + k of one type (R * K devices needed), and K = 1 runs
on the replica's own device. Explicit devices are used by every replica.
Two replicas of two stages on four CPU devices:

    >>> strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:2'])
    >>> found = {}
    >>> def Run():
    ...   found[Replica()[0]] = ReplicaStageDevices(num_stages=2)
    >>> strategy.run(Run)
    >>> found[0], found[1]  # Per replica, its stages' devices.
    (['...CPU:0', '...CPU:1'], ['...CPU:2', '...CPU:3'])
"""

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from lingvo_gpipe.engine import placement


def Replica() -> Tuple[int, int]:
  """(replica index, replicas in sync) of the current context; (0, 1) alone.

  In a cross-replica context the index is 0.

  Raises:
    ValueError: if the strategy's replica id is not known when the call is
      traced (e.g. TPUStrategy); then pass explicit devices.
  """
  strategy = tf.distribute.get_strategy()
  num_replicas = strategy.num_replicas_in_sync
  context = tf.distribute.get_replica_context()
  if num_replicas == 1 or context is None:
    return 0, num_replicas
  replica = tf.get_static_value(context.replica_id_in_sync_group)
  if replica is None:
    raise ValueError(
        f'{type(strategy).__name__} does not say which of its '
        f'{num_replicas} replicas is traced; pass devices=[...] to '
        'GPipeSequential.')
  return int(replica), num_replicas


def ReplicaStageDevices(num_stages: int,
                        explicit: Optional[Sequence[str]] = None
                       ) -> List[str]:
  """The K stage devices of the pipeline of the current replica.

  Args:
    num_stages: K.
    explicit: The user's K devices, or None.

  Returns:
    K device strings; '' is the default device (the replica's own device
    under a strategy).

  Raises:
    ValueError: if `explicit` does not have K strings, or R > 1 replicas need
      R * K local devices of one type and there are fewer.
  """
  replica, num_replicas = Replica()
  if num_replicas == 1 or explicit is not None or num_stages == 1:
    return placement.StageDevices(num_stages, explicit)
  local = placement.LocalDevices(num_replicas * num_stages)
  if local is None:
    found = [d.name for d in tf.config.list_logical_devices()]
    raise ValueError(
        f'{num_replicas} replicas in sync with num_stages={num_stages} need '
        f'{num_replicas * num_stages} local devices of one type (replica r '
        f'runs stage k on device r * {num_stages} + k); found {found}. Pass '
        'devices=[...] (used by every replica), create more logical devices, '
        'or use fewer replicas or stages.')
  return local[replica * num_stages:(replica + 1) * num_stages]
