"""Tests of keras.devices: the stage devices of each replica's pipeline."""

import pytest
import tensorflow as tf

from lingvo_gpipe.keras import devices
import engine_util


def testOneReplicaUsesTheStageDevicesOfPlacement():
  assert devices.Replica() == (0, 1)
  assert devices.ReplicaStageDevices(2, ['/cpu:3', '/cpu:1']) == [
      '/cpu:3', '/cpu:1']
  with pytest.raises(ValueError, match='must be a list of 2'):
    devices.ReplicaStageDevices(2, ['/cpu:0'])


def testReplicaRRunsStageKOnLocalDeviceRTimesKPlusK():
  """Two replicas of K = 2 stages share the four CPU devices."""
  strategy = tf.distribute.MirroredStrategy(engine_util.CPUS[:2])
  seen = []
  strategy.extended.call_for_each_replica(lambda: seen.append(
      (devices.Replica(), devices.ReplicaStageDevices(2))))
  assert sorted(seen) == [
      ((0, 2), ['/device:CPU:0', '/device:CPU:1']),
      ((1, 2), ['/device:CPU:2', '/device:CPU:3'])]
  with pytest.raises(ValueError, match='need 6 local devices of one type'):
    strategy.extended.call_for_each_replica(
        lambda: devices.ReplicaStageDevices(3))
