"""Stage k runs on device k: in the graph (op.device) and in the kernels run."""

import collections
import re
from unittest import mock

from absl import logging
from absl.testing import flagsaver
import pytest
from lingvo import compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils

from lingvo_gpipe.engine import pipeline
from lingvo_gpipe.engine import placement
from lingvo_gpipe.engine import tpu
import engine_util
import test_util


def testStageCallsArePlacedOnTheirDevices():
  graph, _ = test_util.TracedFCStep('always')
  devices = collections.defaultdict(set)
  for op in graph.get_operations():
    if op.type in ('StatefulPartitionedCall', 'PartitionedCall'):
      devices[re.search(r'chunk(\d)', op.name).group(1)].add(op.device)
  assert {k: sorted(v) for k, v in devices.items()} == {
      str(k): [f'/device:CPU:{k}'] for k in range(4)}


@pytest.mark.parametrize('engine,remat,forward_runs', [
    ('unrolled', 'always', 4), ('unrolled', 'never', 2), ('loop', 'always', 4)
])
def testKernelsRunOnTheStageDevice(engine, remat, forward_runs):
  """Cell k's kernels ran on CPU:k; with remat each forward ran twice."""
  with engine_util.ObservableLoops(engine):
    _, step_stats = test_util.TracedFCStep(remat, engine=engine)
  expected = {}
  for k, device in enumerate(engine_util.CPUS):
    expected[(k, device, False)] = forward_runs  # M forwards (+ M recomputes).
    expected[(k, device, True)] = 2  # One weight gradient per micro-batch.
  assert dict(test_util.FCKernelRuns(step_stats)) == expected


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'zb1p'])
def testWeightsStayOnTheirChunksDevice(schedule):
  """Under an outer device scope, as Lingvo's trainer builds, the ops between
  a chunk's weights (variables on its device) and its loops are on its
  device: no copy of the weights to the scope's device and back per step."""
  graph = tf.Graph()
  with graph.as_default(), tf.device(engine_util.CPUS[0]):
    weights = []
    for c in range(2):
      with tf.device(engine_util.CPUS[c]):
        weights.append([tf.Variable(w, name=f'chunk{c}_w{i}')
                        for i, w in enumerate(engine_util.DENSE_WEIGHTS[:2])])
    loss_inside = schedule != 'gpipe'
    pipe = pipeline.Pipeline(
        [engine_util.TanhChunk,
         engine_util.TanhLossChunk if loss_inside else engine_util.TanhChunk],
        engine_util.CPUS[:2], 4, remat='never', engine='loop',
        schedule=schedule)
    (y,), _ = pipe(weights, [tf.constant(engine_util.DENSE_X)], [(), ()])
    loss = y if loss_inside else tf.reduce_mean(y * y)
    tf.gradients(loss, [w for chunk in weights for w in chunk])
  forwarding = ('ReadVariableOp', 'Identity', 'StopGradient')
  for c, chunk in enumerate(weights):
    for w in chunk:
      reached, ops = set(), [w.handle.op]
      while ops:
        op = ops.pop()
        # TensorFlow runs a resource's reader on the resource's device.
        if op.type != 'ReadVariableOp':
          assert tf.DeviceSpec.from_string(op.device).device_index == c, (
              w.name, op.name, op.device)
        reached.add(op.type)
        ops += [consumer for out in op.outputs for consumer in out.consumers()
                if consumer.type in forwarding]
      assert 'StopGradient' in reached, (w.name, reached)


@pytest.mark.parametrize('num_micro_batches', [2, 8])
def testLoopStageCallsCarryTheirDevices(num_micro_batches):
  """The loops as they normally run hold each stage's calls on its device.

  With M = 2 < K every tick has an idle stage (calls in conds); with M = 8
  the middle ticks call every stage directly.

  Args:
    num_micro_batches: M.
  """
  graph, _ = test_util.TracedFCStep('always', num_micro_batches,
                                    engine='loop')
  assert engine_util.LoopCallDevices(graph) == {
      (phase, k): {f'/device:CPU:{k}'}
      for phase in ('forward', 'backward') for k in range(4)}


def testTwoStagesOnAFourDeviceSplitRunOnItsFirstTwoDevices():
  """K=2, devices=None, a Lingvo split of 4: cells 0-1 on CPU:0, 2-3 on CPU:1.

  Without local logical devices (as in a graph-mode Lingvo trainer, whose
  devices are its session's), only the split can spread the stages.
  """
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4)
  with mock.patch.object(placement, 'LocalDevices', return_value=None):
    _, step_stats = test_util.TracedFCStep('always', num_stages=2,
                                           cluster=cluster)
  expected = {}
  for cell in range(4):
    device = engine_util.CPUS[cell // 2]
    expected[(cell, device, False)] = 4  # M forwards + M recomputes.
    expected[(cell, device, True)] = 2  # One weight gradient per micro-batch.
  assert dict(test_util.FCKernelRuns(step_stats)) == expected


@pytest.mark.parametrize('schedule,virtual_stages,partition,expected', [
    ('gpipe', 1, [2, 1], [0, 0, 1]),
    ('gpipe', 2, [1, 1, 1, 2], [0, 1, 0, 1, 1]),  # Circular: c mod K.
    ('zbv', 2, [1, 2, 1, 1], [0, 1, 1, 1, 0]),  # The V: 0, 1, 1, 0.
])
def testCellDevicesFollowTheChunkPlacement(schedule, virtual_stages,
                                           partition, expected):
  devices = ['/device:CPU:0', '/device:CPU:1']
  pipe = test_util.PipeParams(
      test_util.FCCells(sum(partition)), num_stages=2, devices=devices,
      virtual_stages=virtual_stages, partition=partition,
      schedule=schedule, num_micro_batches=4).Instantiate()
  assert pipe.CellDevices() == [devices[k] for k in expected]


def testCellDevicesBeforeAProfilePartitionIsAnError():
  pipe = test_util.PipeParams(test_util.FCCells(4), num_stages=2,
                              partition='flops').Instantiate()
  with pytest.raises(ValueError, match=r"partition='flops' is decided"):
    pipe.CellDevices()


def testResolution():
  assert placement.StageDevices(2, explicit=['/a', '/b']) == ['/a', '/b']
  assert placement.StageDevices(2, model_split=['/x', '/y']) == ['/x', '/y']
  # A split of at least K devices: stage k on its device k (Lingvo's rule).
  assert placement.StageDevices(1, model_split=['/x', '/y']) == ['/x']
  assert placement.StageDevices(
      2, model_split=['/w', '/x', '/y', '/z']) == ['/w', '/x']
  # Fewer than K: K local devices of one type.
  assert placement.StageDevices(2, model_split=['/x']) == [
      f'/device:CPU:{k}' for k in range(2)]
  assert placement.StageDevices(4) == [f'/device:CPU:{k}' for k in range(4)]
  assert placement.StageDevices(8) == [''] * 8  # Only 4 devices: warns.
  with pytest.raises(ValueError, match=r"devices=\['/a'\] must be a list of 2"):
    placement.StageDevices(2, explicit=['/a'])


@pytest.mark.parametrize('num_stages', [4, 2])
def testLayerUsesLingvoModelSplit(num_stages):
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4)
  with cluster:
    pipe = test_util.PipeParams(test_util.FCCells(),
                                num_stages=num_stages).Instantiate()
    with mock.patch.object(logging, 'info') as log:
      devices = pipe.StageDevices()
      assert pipe.StageDevices() == devices
    assert devices == [
        cluster.WorkerDeviceInModelSplit(k) for k in range(num_stages)
    ]
    # Logged once, with the plan.
    assert [call.args[0] for call in log.call_args_list
            if 'stage devices' in str(call.args[0])] == [
                f'pipe: stage devices {devices} for partition '
                f'{pipe.partition} (model split of 4 devices)']


@pytest.mark.parametrize('num_stages,lingvo_cluster', [(4, False), (2, True)])
def testStageOpsArePlacedOnTpuCores(num_stages, lingvo_cluster):
  """Stage k's forward and gradient ops go to the replica's logical core k.

  With explicit devices from `TpuStageDevices`, or from Lingvo's TPU cluster
  (`--worker_split_size=K`), which gives the same devices. Built, not run,
  with the unrolled engine, whose op names say chunk and micro-batch (on TPU
  devices engine='auto' builds the loop engine: XLA compiles the step).

  Args:
    num_stages: K.
    lingvo_cluster: Whether the devices come from Lingvo's cluster.
  """
  if lingvo_cluster:
    cluster = cluster_factory.ForTestingWorker(
        mode='sync', job='trainer_client', tpus=8, split_size=num_stages)
    devices = None
  else:
    cluster = cluster_factory.Current()
    devices = tpu.TpuStageDevices(num_stages)
  graph = tf.Graph()
  with cluster, graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = test_util.PipeParams(test_util.FCCells(), num_stages=num_stages,
                                num_micro_batches=2, devices=devices,
                                engine='unrolled').Instantiate()
    y = pipe.FProp(pipe.theta, tf.zeros([8, 8]))
    tf.gradients(tf.reduce_sum(y * y), pipe.vars.Flatten())
  devices = collections.defaultdict(set)
  for op in graph.get_operations():
    match = re.match(r'(gradients/)?gpipe/chunk(\d+)_mb\d+/', op.name)
    if match:
      devices[(int(match.group(2)), bool(match.group(1)))].add(op.device)
  assert dict(devices) == {
      (k, is_gradient): {f'/device:TPU_REPLICATED_CORE:{k}'}
      for k in range(num_stages) for is_gradient in (False, True)}


def testLayerOnTpuUsesLogicalCores():
  """Under Lingvo's TPU flag, devices=None means the replica's cores.

  And engine='auto' builds the loop engine whatever M: under XLA only its
  recompute saves memory.
  """
  with flagsaver.flagsaver(xla_device='tpu', enable_asserts=False):
    pipe = test_util.PipeParams(test_util.FCCells(), num_stages=4).Instantiate()
    assert pipe.StageDevices() == tpu.TpuStageDevices(4)
    assert pipe.Engine(num_micro_batches=2) == 'loop'
  assert pipe.Engine(num_micro_batches=2) == 'unrolled'  # CPU, M < 16.
