"""Tests of engine.tpu: the TPU cores a pipeline's stages run on."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.engine import tpu


def _V38Topology():
  """A hand-built TPU topology like a v3-8: 2 x 2 x 1 chips, 2 cores each.

  Device ordinals run over the cores of a chip, then x, then y: TPU:0 and
  TPU:1 are chip (0, 0), TPU:2 and TPU:3 chip (1, 0), TPU:4 and TPU:5 chip
  (0, 1), TPU:6 and TPU:7 chip (1, 1).

  Returns:
    A tf.tpu.experimental.Topology of one task with 8 TPU cores.
  """
  coordinates = [[x, y, 0, core] for y in range(2) for x in range(2)
                 for core in range(2)]
  return tf.tpu.experimental.Topology(
      mesh_shape=[2, 2, 1, 2],
      device_coordinates=np.array([coordinates], np.int32))


@pytest.mark.parametrize('num_stages,num_replicas,ordinals,coordinates', [
    # One chip (both cores) per replica; replicas go round the 2 x 2 ring.
    (2, 4, [[0, 1], [2, 3], [6, 7], [4, 5]],
     [[[0, 0, 0, 0], [0, 0, 0, 1]], [[1, 0, 0, 0], [1, 0, 0, 1]],
      [[1, 1, 0, 0], [1, 1, 0, 1]], [[0, 1, 0, 0], [0, 1, 0, 1]]]),
    # Two chips adjacent along x per replica.
    (4, 2, [[0, 1, 2, 3], [4, 5, 6, 7]],
     [[[0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 1]],
      [[0, 1, 0, 0], [0, 1, 0, 1], [1, 1, 0, 0], [1, 1, 0, 1]]]),
    # All 8 cores; consecutive stages stay on the same or a neighbouring chip.
    (8, 1, [[0, 1, 2, 3, 6, 7, 4, 5]],
     [[[0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 1],
       [1, 1, 0, 0], [1, 1, 0, 1], [0, 1, 0, 0], [0, 1, 0, 1]]]),
    (1, 8, [[k] for k in range(8)], None),
])
def testTpuDeviceAssignment(num_stages, num_replicas, ordinals, coordinates):
  """Replica r's stage k runs on the physical core of logical core k."""
  assignment = tpu.TpuDeviceAssignment(_V38Topology(), num_replicas,
                                             num_stages)
  assert (assignment.num_replicas, assignment.num_cores_per_replica) == (
      num_replicas, num_stages)
  if coordinates is not None:
    assert assignment.core_assignment.tolist() == coordinates
  assert [[assignment.tpu_device(r, k, job='worker')
           for k in range(num_stages)] for r in range(num_replicas)] == [
               [f'/job:worker/task:0/device:TPU:{n}' for n in replica]
               for replica in ordinals]


def testTpuDeviceAssignmentFromSerializedTopology():
  topology = _V38Topology().serialized()
  assignment = tpu.TpuDeviceAssignment(topology, 2, 2)
  assert assignment.core_assignment.tolist() == [
      [[0, 0, 0, 0], [0, 0, 0, 1]], [[1, 0, 0, 0], [1, 0, 0, 1]]]


@pytest.mark.parametrize('topology,num_replicas,num_stages,message', [
    (None, 4, 3, r'num_stages=3 TPU cores do not form a box of the TPU mesh '
     r'\[2, 2, 1, 2\]; valid values are \[1, 2, 4, 8\]'),
    (None, 1, 16, r'num_stages=16 TPU cores do not form a box.*\[1, 2, 4, 8\]'),
    (None, 5, 2, r'num_replicas=5 x num_stages=2 needs 10 TPU cores but the '
     r'topology \(mesh \[2, 2, 1, 2\]\) has 8; use num_replicas <= 4'),
    (None, 0, 2, 'num_replicas=0 must be a positive int'),
    (None, 1, 2.0, 'num_stages=2.0 must be a positive int'),
    ('v3-8', 1, 1, "topology='v3-8' must be a tf.tpu.experimental.Topology"),
])
def testTpuDeviceAssignmentErrors(topology, num_replicas, num_stages, message):
  with pytest.raises(ValueError, match=message):
    tpu.TpuDeviceAssignment(topology or _V38Topology(), num_replicas,
                                  num_stages)


def testTpuStageDevices():
  assert tpu.TpuStageDevices(3) == [
      '/device:TPU_REPLICATED_CORE:0', '/device:TPU_REPLICATED_CORE:1',
      '/device:TPU_REPLICATED_CORE:2']
  with pytest.raises(ValueError, match='num_stages=0 must be a positive int'):
    tpu.TpuStageDevices(0)
