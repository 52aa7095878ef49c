"""Stage k runs on device k: in the graph (op.device) and in the kernels run."""

import collections
import re

import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils

from lingvo_gpipe import placement
import test_util


def _TracedStep(remat, num_micro_batches=2):
  """One traced training step of 4 FC cells on 4 stages.

  Args:
    remat: The remat mode.
    num_micro_batches: M.

  Returns:
    (graph, step_stats): the graph and the RunMetadata step stats.
  """
  p = test_util.PipeParams(test_util.FCCells(), num_stages=4,
                           num_micro_batches=num_micro_batches, remat=remat)
  graph = tf.Graph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = p.Instantiate()
    y = pipe.FProp(pipe.theta, tf.constant(np.ones([8, 8], np.float32)))
    # Without recompute the gradient of a stage call is TensorFlow's own;
    # Lingvo's trainer colocates gradients with their ops, so do we here.
    grads = tf.compat.v1.gradients(
        tf.reduce_sum(y * y), pipe.vars.Flatten(),
        colocate_gradients_with_ops=remat != 'always')
    with tf.compat.v1.Session(
        graph=graph, config=test_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      metadata = tf.compat.v1.RunMetadata()
      sess.run(grads,
               options=tf.compat.v1.RunOptions(
                   trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
               run_metadata=metadata)
  return graph, metadata.step_stats


def _KernelRuns(step_stats):
  """{(cell, device, is_gradient): runs} of FC kernels.

  The forward marker is fc<k>/Relu (Grappler fuses the forward matmul with the
  bias add), the gradient marker the weight gradient's matmul.

  Args:
    step_stats: RunMetadata step stats.

  Returns:
    A Counter.
  """
  runs = collections.Counter()
  for dev in step_stats.dev_stats:
    device = int(re.search(r'CPU:(\d+)$', dev.device).group(1))
    for node in dev.node_stats:
      match = re.search(r'fc(\d)/(Relu$|MatMul_grad/MatMul_1$)',
                        node.node_name)
      if match:
        runs[(int(match.group(1)), device,
              'gradients/' in node.node_name)] += 1
  return runs


def testStageCallsArePlacedOnTheirDevices():
  graph, _ = _TracedStep('always')
  devices = collections.defaultdict(set)
  for op in graph.get_operations():
    if op.type in ('StatefulPartitionedCall', 'PartitionedCall'):
      devices[re.search(r'stage(\d)', op.name).group(1)].add(op.device)
  assert {k: sorted(v) for k, v in devices.items()} == {
      str(k): [f'/device:CPU:{k}'] for k in range(4)}


@pytest.mark.parametrize('remat,forward_runs', [('always', 4), ('never', 2)])
def testKernelsRunOnTheStageDevice(remat, forward_runs):
  """Cell k's kernels ran on CPU:k; with remat each forward ran twice."""
  _, step_stats = _TracedStep(remat)
  runs = _KernelRuns(step_stats)
  expected = {}
  for k in range(4):
    expected[(k, k, False)] = forward_runs  # M forwards (+ M recomputes).
    expected[(k, k, True)] = 2  # One weight gradient per micro-batch.
  assert dict(runs) == expected


def testResolution():
  assert placement.StageDevices(2, explicit=['/a', '/b']) == ['/a', '/b']
  assert placement.StageDevices(2, model_split=['/x', '/y']) == ['/x', '/y']
  assert placement.StageDevices(1, model_split=['/x', '/y']) == ['']
  assert placement.StageDevices(4) == [f'/device:CPU:{k}' for k in range(4)]
  assert placement.StageDevices(8) == [''] * 8  # Only 4 devices: warns.
  with pytest.raises(ValueError, match=r"devices=\['/a'\] must be a list of 2"):
    placement.StageDevices(2, explicit=['/a'])


def testLayerUsesLingvoModelSplit():
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4)
  with cluster:
    pipe = test_util.PipeParams(test_util.FCCells(), num_stages=4).Instantiate()
    assert pipe.StageDevices() == [
        cluster.WorkerDeviceInModelSplit(k) for k in range(4)
    ]
