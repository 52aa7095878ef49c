"""Tests of engine.trace: a traced step's kernels and stage calls."""

import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import step_stats_pb2

from lingvo_gpipe.engine import control_flow
from lingvo_gpipe.engine import loop
from lingvo_gpipe.engine import pipeline
from lingvo_gpipe.engine import trace
from lingvo_gpipe.planning import lowering
from lingvo_gpipe.planning import schedule
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


def _Stats(kernels):
  """StepStats of (device index, node name, op, start, duration) kernels."""
  stats = step_stats_pb2.StepStats()
  devices = {}
  for k, name, op, start, duration in kernels:
    if k not in devices:
      devices[k] = stats.dev_stats.add(device=engine_util.CPUS[k])
    devices[k].node_stats.add(node_name=name,
                              timeline_label=f'{name} = {op}(x)',
                              all_start_micros=start,
                              all_end_rel_micros=duration)
  return stats


def _PerDevice1F1BStats():
  """A per-device 1F1B step of K = 2, M = 2 as its lowered loops name it.

  Each device's loop 'step_device<k>' picks its instruction in a branch:
  'then' for backwards, 'else' for forwards (the names do not say which),
  a forward built inline (remat 'always'), a backward a function call whose
  body kernels show their own names (recompute, then 'gradients/...'). The
  queue ops (transfers) and a buffer write are in the instructions too.
  """
  table = schedule.BuildTable('1f1b', 2, 2)
  loops = ['gpipe/device0/step_device0/body/_1/device0_backward_forward',
           'gpipe/device1/step_device1/body/_9/device1_backward_forward']
  kernels, time = [], [0, 0]
  for k, order in enumerate(table.device_orders):
    time[k] = 50 * k
    for phase, c, _ in order:
      path = (f'{loops[k]}/{"then" if phase == "backward" else "else"}'
              f'/_{3 + k}/chunk{c}')
      if phase == 'forward':
        kernels += [(k, f'{path}/edge0_Dequeue', 'QueueDequeueV2', time[k], 9),
                    (k, f'{path}/inline_forward/fc/MatMul', 'MatMul',
                     time[k] + 10, 10),
                    (k, f'{path}/TensorArrayV2Write/TensorListSetItem',
                     'TensorListSetItem', time[k] + 21, 1),
                    (1 - k, f'{path}/edge1_enqueue', 'QueueEnqueueV2',
                     time[k] + 22, 1)]
        time[k] += 25
      else:
        kernels += [(k, f'{path}/StatefulPartitionedCall',
                     'StatefulPartitionedCall', time[k], 30),
                    (k, 'fc/MatMul', 'MatMul', time[k] + 1, 10),
                    (k, 'gradients/fc/MatMul_grad/MatMul', 'MatMul',
                     time[k] + 12, 17)]
        time[k] += 35
  return table, kernels


def testPerDeviceStepPassReadsInTableOrder():
  """The 'step' pass interleaves F and B on each device as the table says."""
  table, kernels = _PerDevice1F1BStats()
  found = trace.StepKernels(_Stats(kernels))
  assert trace.Executor(found) == 'per_device'
  events, devices = trace.StepEvents(found, table, 'always', 'loop')
  for k in range(2):
    ran = [(e.phase, e.chunk, e.micro_batch) for e in events
           if e.stage == k and e.phase != 'recompute']
    assert ran == [tuple(a) for a in table.device_orders[k]], k
    assert devices[k] == [engine_util.CPUS[k]]
  assert [f'{e.phase[0]}{e.micro_batch}' for e in events if e.stage == 0] == [
      'f0', 'f1', 'r0', 'b0', 'r1', 'b1']
  # A forward is its inline body (not the queue ops, nor the buffer write);
  # a backward's recompute ends with the last kernel that repeats it.
  first = events[0]
  assert (first.start, first.end) == pytest.approx((0.0, 10e-6))
  r0, b0 = events[2], events[3]
  assert (r0.end - r0.start, b0.end - b0.start) == pytest.approx(
      (11e-6, 19e-6))


def testLockstepLoopsAreReadToo():
  """Lockstep loops are '<pass>_<i>', a device's branch inside them."""
  table, kernels = _PerDevice1F1BStats()
  renamed = [(k, re.sub(r'gpipe/device(\d)/step_device\d/body/_\d+/',
                        r'gpipe/step_0/body/_1/device\1/', name), op, s, d)
             for k, name, op, s, d in kernels]
  found = trace.StepKernels(_Stats(renamed))
  assert trace.Executor(found) == 'lockstep'
  events, _ = trace.StepEvents(found, table, 'always', 'loop')
  assert [(e.phase, e.chunk, e.micro_batch) for e in events
          if e.stage == 0 and e.phase != 'recompute'] == [
              tuple(a) for a in table.device_orders[0]]


def testMissingInstructionsAreAnError():
  table, kernels = _PerDevice1F1BStats()
  # F0.0 left only its transfers: no instruction of its own.
  found = trace.StepKernels(_Stats(kernels[:1] + kernels[3:]))
  with pytest.raises(ValueError, match='device 0 ran 3 instructions in the '
                     'traced loops, its table has 4 actions'):
    trace.StepEvents(found, table, 'always', 'loop')


def _TracedLossInsideStep(num_micro):
  """A traced 1F1B step built as training builds it: executor 'auto'.

  Two tanh chunks on two CPU devices, the loss in the last; the loops
  lowered so that step stats show them (`control_flow.ObservableLoops`).

  Returns:
    (the pipeline, the executor 'auto' resolves to here, the kernels).
  """

  def Chunk(theta, inputs, state, micro_batch_id):
    del micro_batch_id
    return (tf.tanh(tf.matmul(inputs[0], theta)),), state

  def LossChunk(theta, inputs, state, micro_batch_id):
    (y,), state = Chunk(theta, inputs, state, micro_batch_id)
    return (tf.reduce_mean(tf.square(y)),), state

  devices = engine_util.CPUS[:2]
  pipe = pipeline.Pipeline([Chunk, LossChunk], devices, num_micro,
                           remat='except_last', engine='loop',
                           schedule='1f1b')
  rng = np.random.RandomState(0)
  with tf.Graph().as_default(), control_flow.ObservableLoops():
    thetas = [tf.constant(rng.randn(4, 4).astype(np.float32))
              for _ in range(2)]
    (loss,), _ = pipe(thetas, [tf.constant(rng.randn(
        2 * num_micro, 4).astype(np.float32))])
    grads = tf.gradients(loss, thetas)
    step = lowering.Lower(pipe.table, lowering.Edges(2, ()), 'except_last',
                          True)
    expected = loop.ChooseExecutor('auto', step, devices)
    options = tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    run_metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(config=engine_util.SessionConfig()) as sess:
      sess.run([loss, grads])
      sess.run([loss, grads], options=options, run_metadata=run_metadata)
  return pipe, expected, trace.StepKernels(run_metadata.step_stats)


def testTracedOneFOneBStepIsTheExecutorTrainingRuns():
  """In a TF1 graph 'auto' runs per-device loops; traced, so do they."""
  pipe, expected, kernels = _TracedLossInsideStep(num_micro=4)
  assert expected == 'per_device'
  assert trace.Executor(kernels) == expected
  events, _ = trace.StepEvents(kernels, pipe.table, 'except_last', 'loop')
  orders = [' '.join(f'{e.phase[0].upper()}{e.chunk}.{e.micro_batch}'
                     for e in events if e.stage == k and e.phase != 'recompute')
            for k in range(2)]
  # Stage 0 interleaves after K - 1 = 1 warm-up forward, as the table says.
  assert orders[0] == 'F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3'
  for k in range(2):
    assert orders[k].split() == [
        f'{a.phase[0].upper()}{a.chunk}.{a.micro_batch}'
        for a in pipe.table.device_orders[k]]
  for k in range(2):  # Device k's calls start after the previous one ends.
    mine = [e for e in events if e.stage == k]
    assert all(a.end <= b.start + 1e-6 for a, b in zip(mine, mine[1:]))
