"""Pipeline stages on the logical cores of a TPU replica.

A replica with K logical cores runs stage k on its logical core k: the device
assignment of a `TPUStrategy` (or of Lingvo's TPU runner) gives every replica
K cores, and ops placed on '/device:TPU_REPLICATED_CORE:k' inside the
replicated computation run on the replica's core k (XLA turns the device into
a maximal sharding on that core).

The topology of a v3-8 (2 x 2 chips of 2 cores), which
`tf.tpu.experimental.initialize_tpu_system(resolver)` returns on a TPU host,
here built by hand; four replicas of two stages:

    >>> cores = [[x, y, 0, core] for y in range(2) for x in range(2)
    ...          for core in range(2)]
    >>> topology = tf.tpu.experimental.Topology(
    ...     mesh_shape=[2, 2, 1, 2], device_coordinates=np.array([cores]))
    >>> assignment = TpuDeviceAssignment(topology, num_replicas=4,
    ...                                  num_stages=2)
    >>> [assignment.tpu_device(1, k, job='worker') for k in range(2)]
    ['/job:worker/task:0/device:TPU:2', '/job:worker/task:0/device:TPU:3']
    >>> TpuStageDevices(2)
    ['/device:TPU_REPLICATED_CORE:0', '/device:TPU_REPLICATED_CORE:1']

The assignment then goes to the strategy, `tf.distribute.TPUStrategy(
resolver, experimental_device_assignment=assignment)`, and the devices to the
layer (`devices=`).
"""

import math
from typing import List, Optional, Sequence, Union

from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_gpipe.planning import checks

_TPU_CORE = '/device:TPU_REPLICATED_CORE:{}'
# Axes of a TPU mesh (x, y, z, core on chip), in the order a replica's cores
# are taken from: both cores of a chip first, then neighbouring chips along x,
# then y, then z, so that consecutive stages sit on the same or adjacent chips.
_TPU_AXIS_ORDER = (3, 0, 1, 2)


def TpuStageDevices(num_stages: int) -> List[str]:
  """Stage k on logical core k of its TPU replica.

  Args:
    num_stages: K, the number of logical cores of each replica.

  Returns:
    ['/device:TPU_REPLICATED_CORE:0', ..., '/device:TPU_REPLICATED_CORE:K-1'],
    for `GPipeSequentialLayer.Params().devices` (Lingvo's TPU cluster returns
    the same devices from `WorkerDeviceInModelSplit`).

  Raises:
    ValueError: if num_stages is not a positive int.
  """
  checks.CheckPositiveInt('num_stages', num_stages)
  return [_TPU_CORE.format(k) for k in range(num_stages)]


def _TpuComputationShape(mesh_shape: Sequence[int],
                         num_stages: int) -> Optional[List[int]]:
  """A box of `num_stages` cores in the mesh, or None if there is none.

  Takes as many cores as divide the remaining count from each axis in
  `_TPU_AXIS_ORDER`, so the box tiles the mesh.

  Args:
    mesh_shape: The 4 sizes (x, y, z, cores per chip) of the TPU mesh.
    num_stages: K, the cores per replica.

  Returns:
    The computation shape (4 ints whose product is K), or None.
  """
  shape, remaining = [1] * len(mesh_shape), num_stages
  for axis in _TPU_AXIS_ORDER:
    shape[axis] = math.gcd(remaining, int(mesh_shape[axis]))
    remaining //= shape[axis]
  return shape if remaining == 1 else None


def TpuDeviceAssignment(
    topology: Union[tf.tpu.experimental.Topology, bytes], num_replicas: int,
    num_stages: int) -> tf.tpu.experimental.DeviceAssignment:
  """A TPU device assignment that gives each of R replicas K logical cores.

  Logical core k of a replica runs stage k (see `TpuStageDevices`). The K cores
  form a box of the mesh, filled core-on-chip first, then along x, y and z;
  `tf.tpu.experimental.DeviceAssignment.build` orders them (along a ring when
  the replicas fill the whole mesh) and places the R boxes. Logs the
  physical core of every stage of every replica.

  Args:
    topology: The TPU topology, e.g. from
      `tf.tpu.experimental.initialize_tpu_system`, or a serialized
      TopologyProto (what TF1's `tf.compat.v1.tpu.initialize_system` returns).
    num_replicas: R, the data-parallel replicas.
    num_stages: K, the pipeline stages (logical cores) of each replica.

  Returns:
    The device assignment, for `tf.distribute.TPUStrategy(resolver,
    experimental_device_assignment=...)`.

  Raises:
    ValueError: if topology is neither a Topology nor bytes, R or K is not a
      positive int, R * K exceeds the cores of the topology, or K cores do not
      form a box of the mesh.
  """
  if isinstance(topology, bytes):
    topology = tf.tpu.experimental.Topology(serialized=topology)
  if not isinstance(topology, tf.tpu.experimental.Topology):
    raise ValueError(f'topology={topology!r} must be a '
                     'tf.tpu.experimental.Topology or a serialized '
                     'TopologyProto.')
  checks.CheckPositiveInt('num_replicas', num_replicas)
  checks.CheckPositiveInt('num_stages', num_stages)
  num_cores = topology.num_tasks * topology.num_tpus_per_task
  mesh_shape = [int(n) for n in topology.mesh_shape]
  computation_shape = _TpuComputationShape(mesh_shape, num_stages)
  if computation_shape is None:
    valid = [k for k in range(1, num_cores + 1)
             if _TpuComputationShape(mesh_shape, k) is not None]
    raise ValueError(f'num_stages={num_stages} TPU cores do not form a box of '
                     f'the TPU mesh {mesh_shape}; valid values are {valid}.')
  if num_replicas * num_stages > num_cores:
    raise ValueError(
        f'num_replicas={num_replicas} x num_stages={num_stages} needs '
        f'{num_replicas * num_stages} TPU cores but the topology (mesh '
        f'{mesh_shape}) has {num_cores}; use num_replicas <= '
        f'{num_cores // num_stages}.')
  assignment = tf.tpu.experimental.DeviceAssignment.build(
      topology, computation_shape=np.array(computation_shape, np.int32),
      num_replicas=num_replicas)
  logging.info(
      'TPU mesh %s, %d replicas x %d stages, computation shape %s:\n%s',
      mesh_shape, num_replicas, num_stages, computation_shape, '\n'.join(
          f'  replica {r}: ' + ', '.join(
              f'stage {k} on core '
              f'{[int(c) for c in assignment.coordinates(r, k)]} '
              f'({assignment.tpu_device(r, k)})' for k in range(num_stages))
          for r in range(num_replicas)))
  return assignment
