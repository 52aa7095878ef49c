"""Re-materialization saves memory: the order of calls, and peak bytes.

The saving rests on the order in which a stage's calls run (docs/design.md):
its recomputes start only after all its forward calls, and its backward calls
(recompute, then gradients) run one micro-batch at a time in reverse order,
so that one micro-batch's activations live at once. The order is read from
RunMetadata step stats of a real step; the saving from the CPU allocator's
peak (`tf.config.experimental.get_memory_info`, which needs oneDNN's
allocator, TensorFlow's default).
"""

import re

import numpy as np
import pytest
from lingvo import compat as tf

from lingvo_gpipe.engine import trace
from lingvo_gpipe.planning import schedule
import engine_util
import test_util

NUM_STAGES = 4
NUM_MICRO_BATCHES = 4


@pytest.mark.parametrize('remat', ['always', 'except_last'])
def testUnrolledStageCallsRunInScheduleOrder(remat):
  """Per stage: forwards in order, then backward calls in reverse order.

  From the traced step's stage calls (`trace.StepEvents`): every call that
  re-materializes starts its recompute after the stage's last forward call,
  and the backward call of micro-batch m (recompute and gradients) starts
  only after that of m + 1 has ended.

  Args:
    remat: The remat mode ('never' leaves the backward to TensorFlow).
  """
  _, step_stats = test_util.TracedFCStep(remat, NUM_MICRO_BATCHES)
  events, _ = trace.StepEvents(
      trace.StepKernels(step_stats),
      schedule.BuildTable('gpipe', NUM_STAGES, NUM_MICRO_BATCHES), remat,
      'unrolled')
  windows = {(e.stage, e.micro_batch, e.phase): (e.start, e.end)
             for e in events}
  for k in range(NUM_STAGES):
    forward = [windows[k, m, 'forward'] for m in range(NUM_MICRO_BATCHES)]
    # The backward call of m: its recompute (if any) and its gradients.
    backward = [(windows.get((k, m, 'recompute'),
                             windows[k, m, 'backward'])[0],
                 windows[k, m, 'backward'][1])
                for m in range(NUM_MICRO_BATCHES)]
    for m in range(1, NUM_MICRO_BATCHES):
      assert forward[m][0] >= forward[m - 1][1], (k, m, forward)
      assert backward[m - 1][0] >= backward[m][1], (k, m, backward)
    recomputes = [windows[k, m, 'recompute'][0]
                  for m in range(NUM_MICRO_BATCHES)
                  if (k, m, 'recompute') in windows]
    assert len(recomputes) == (NUM_MICRO_BATCHES if remat == 'always' else
                               NUM_MICRO_BATCHES - 1)
    assert min(recomputes) >= forward[-1][1], (k, recomputes, forward)


def testLoopStageRecomputesEachCallRightBeforeItsGradient():
  """Loop engine, per stage device: M forwards, then M (recompute, gradient).

  The kernels of the lowered loops (`engine_util.ObservableLoops`) on each
  stage's device, in the order they started: first the forward pass's ReLUs
  of all micro-batches, then for each micro-batch its recomputed ReLU
  directly followed by its weight gradient. Which micro-batch each tick
  takes is the schedule table (`schedule.BuildTable`, schedule_test.py).
  """
  with engine_util.ObservableLoops('loop'):
    _, step_stats = test_util.TracedFCStep('always', NUM_MICRO_BATCHES,
                                           engine='loop')
  kernels = {}
  for dev in step_stats.dev_stats:
    for node in dev.node_stats:
      match = re.search(r'fc(\d)/(Relu$|MatMul_grad/MatMul_1$)',
                        node.node_name)
      if match:
        kind = 'relu' if match.group(2) == 'Relu' else 'gradient'
        kernels.setdefault(dev.device, []).append(
            (node.all_start_micros, kind))
  assert sorted(kernels) == engine_util.CPUS
  for device, runs in kernels.items():
    assert [kind for _, kind in sorted(runs)] == (
        ['relu'] * NUM_MICRO_BATCHES +
        ['relu', 'gradient'] * NUM_MICRO_BATCHES), device


def _PeakMiB(engine, remat):
  """Peak allocated MiB of one training step of 16 FC cells at K=1, M=4.

  Batch 4096 x 128 floats: each cell's activations are 2 MiB for the whole
  batch, its weights 64 KiB, so activations dominate the peak.

  Args:
    engine: The pipeline engine.
    remat: The remat mode.

  Returns:
    The allocator's peak during the step, less what was allocated before.
  """
  pipe = test_util.PipeParams(
      test_util.FCCells(16, 128), num_stages=1,
      num_micro_batches=NUM_MICRO_BATCHES, remat=remat,
      engine=engine).Instantiate()
  x = tf.constant(np.random.RandomState(0).randn(4096, 128), tf.float32)

  @tf.function(autograph=False)
  def Step():
    with tf.GradientTape() as tape:
      y = pipe.FProp(pipe.theta, x)
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, pipe.vars.Flatten())

  Step()  # Traced and run once: only the step itself is measured.
  tf.config.experimental.reset_memory_stats('CPU:0')
  before = tf.config.experimental.get_memory_info('CPU:0')['current']
  Step()
  return (tf.config.experimental.get_memory_info('CPU:0')['peak'] -
          before) / 2**20


def testRematHalvesPeakMemory():
  """remat='always' peaks below half of 'never' at M=4, in either engine.

  Measured: about 34.5 MiB without re-materialization, 11-12.5 MiB with it
  (unrolled) and 13.5-14.5 MiB (loop); a recompute that ran too early, or
  kept several micro-batches' activations at once, would come near 'never'.
  """
  never = _PeakMiB('unrolled', 'never')
  assert never > 30  # 16 cells x 2 MiB of activations, at least.
  for engine in ('unrolled', 'loop'):
    always = _PeakMiB(engine, 'always')
    assert always < 0.5 * never, (engine, always, never)
