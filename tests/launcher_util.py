"""Helpers of the tests of tools/train.py, local (train_test) or on a cluster.

What a launcher run printed and wrote (its last line, its TensorBoard
losses), one traced training step built as the launcher's trainer builds it,
and which stage call a traced kernel belongs to.
"""

import os
import re

from lingvo import compat as tf
from lingvo.core import cluster_factory

MODEL = 'lm.GPipeCharLmTiny'
# The tiny LM cut into 2 stages instead of 4.
TWO_STAGES = '--model_params_override=task.stack.num_stages: 2'

_TRAINED = re.compile(
    r'^trained (\S+): steps=(\d+) loss ([\d.]+) -> ([\d.]+), ([\d.]+) '
    r'examples/s, checkpoint (\S+)$', re.MULTILINE)

# Kernels by the cell they belong to. Inside the stage functions node names
# lose the cell's scope, so cells are told apart by their layers' names.
CELL_KERNELS = {
    'embedding': r'^GatherV2$',
    'attention': r'(^|/)self_atten/.*MatMul',
    'feedforward': r'(^|/)fflayer/.*MatMul',
    'softmax': r'(^|/)proj/MatMul',
}

# Ops that move a tensor to the device that consumes it.
TRANSFER_OPS = ('_Send', '_Recv', '_HostSend', '_HostRecv', 'Identity',
                'NoOp')


def Trained(runs, name):
  """The fields of a run's last line: model, steps, first and last loss,
  examples/s and checkpoint; asserts that it exited with 0."""
  code, stdout, stderr = runs[name]
  assert code == 0, stderr[-3000:]
  (match,) = _TRAINED.findall(stdout)
  return match


def SummaryLosses(runs, name):
  """{step: loss} of a run's TensorBoard events (float32, not rounded)."""
  directory = os.path.join(runs['tmp'], name, 'train')
  (events,) = [os.path.join(directory, f) for f in os.listdir(directory)
               if f.startswith('events.')]
  losses = {}
  for event in tf.compat.v1.train.summary_iterator(events):
    for value in event.summary.value:
      if value.tag == 'loss':
        losses[event.step] = value.simple_value
  return losses


def TraceTrainStep(cfg, session):
  """Builds the trainer's step as the launcher does and runs it traced.

  Args:
    cfg: The trainer job's model params.
    session: A session of the current graph, on the launcher's master.

  Returns:
    (RunMetadata of one training step, the task).
  """
  cluster = cluster_factory.Cluster(cfg.cluster)
  cluster.InitDevices(session)
  with cluster, tf.device(cluster.GetPlacer()):
    model = cfg.Instantiate()
    model.ConstructFPropBPropGraph()
  session.run(tf.compat.v1.global_variables_initializer())
  metadata = tf.compat.v1.RunMetadata()
  session.run(model.GetTask().train_op,
              options=tf.compat.v1.RunOptions(
                  trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
              run_metadata=metadata)
  return metadata, model.GetTask()


def StageCall(node):
  """(tower, stage) of a kernel run inside a forward stage call, or None.

  Kernels without inputs are left out (as `trace.StepKernels` does): e.g.
  the constants Grappler adds for an inlined call's control inputs run
  wherever the executor puts them, and do no work of the call.

  Args:
    node: A NodeExecStats of a traced step.

  Returns:
    (tower, stage) or None.
  """
  call = re.search(
      r'/tower_0_(\d)/gpipe/chunk(\d)_mb\d+/StatefulPartitionedCall/',
      node.node_name)
  label = re.search(r'= (\w+)\((.*)\)', node.timeline_label)
  if (call and label and label.group(1) not in TRANSFER_OPS and
      label.group(2)):
    return int(call.group(1)), int(call.group(2))
  return None
