"""Tests of engine.trace: a traced step's kernels and stage calls."""

from tensorflow.core.framework import step_stats_pb2

from lingvo_gpipe.engine import trace
import engine_util


def testStepKernelsAreTheKernelsThatWorkOnTheirInputs():
  """Constants, asserts, identities and transfers do not time a call."""
  stats = step_stats_pb2.StepStats()
  dev = stats.dev_stats.add(device=engine_util.CPUS[0])
  for name, label in [('c/MatMul', 'c/MatMul = MatMul(c/x, c/w)'),
                      ('c/Assert', 'c/Assert = Assert(c/ok, c/shape)'),
                      ('c/shape', 'c/shape = Const()'),
                      ('c/Identity', 'c/Identity = Identity(c/x)'),
                      ('c/x/_3', 'c/x/_3 = _Recv()')]:
    dev.node_stats.add(node_name=name, timeline_label=label,
                       all_start_micros=5, all_end_rel_micros=2)
  assert trace.StepKernels(stats) == [
      trace.Kernel('c/MatMul', 'MatMul', engine_util.CPUS[0], 5, 7)]
