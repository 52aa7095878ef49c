"""Re-materialization saves memory: the order of calls, and peak bytes.

The saving rests on the order in which a stage's calls run (docs/design.md):
its recomputes start only after all its forward calls, and its backward calls
(recompute, then gradients) run one micro-batch at a time in reverse order,
so that one micro-batch's activations live at once. The order is read from
RunMetadata step stats of a real step, and where the step stats alone would
depend on the timing of threads, from the dependencies of the graph that ran;
the saving from the CPU allocator's peak (`benchmarks.host`: conftest.py
starts TensorFlow with an allocator that keeps it on every host).
"""

import re

import numpy as np
import pytest
from lingvo import compat as tf
from tensorflow.core.framework import step_stats_pb2

from benchmarks import host
from lingvo_gpipe.engine import trace
from lingvo_gpipe.planning import schedule
import engine_util
import test_util

NUM_STAGES = 4
NUM_MICRO_BATCHES = 4


# The kernels of the unrolled engine's stage calls, by the names trace.py
# reads: the call of chunk (stage) k on micro-batch m runs under
# 'gpipe/chunk<k>_mb<m>'. Its forward is the call of the stage's tf.function,
# or the kernels under it once TensorFlow has inlined it; its backward is the
# call of its gradient function (recompute.py's, never inlined, or
# TensorFlow's own without recompute, inlined) under
# 'gradients/gpipe/chunk<k>_mb<m>/<op>_grad/'.
_FORWARD_KERNEL_RE = re.compile(
    r'^gpipe/chunk(\d+)_mb(\d+)/(?:Stateful)?PartitionedCall(?:/|$)')
_BACKWARD_KERNEL_RE = re.compile(
    r'^gradients/gpipe/chunk(\d+)_mb(\d+)/[^/]+_grad/'
    r'(?:Stateful)?PartitionedCall(?:/|$)')
TABLE = schedule.BuildTable('gpipe', NUM_STAGES, NUM_MICRO_BATCHES)


class _UnrolledStep:
  """One traced unrolled step of FC cells: its calls' times and dependencies.

  Attributes:
    windows: {(stage, micro-batch, phase): (start, end)} from
      `trace.StepEvents`, phases 'forward', 'recompute' and 'backward'.
    calls: {(stage, micro-batch, phase): names of the call's kernels}, phases
      'forward' and 'backward' (the recompute is part of the backward call).
    ancestors: A kernel's name -> the nodes it waited for in the graph that
      ran (`engine_util.ExecutedAncestors`).
  """

  def __init__(self, remat):
    _, metadata = test_util.TracedFCRun(remat, NUM_MICRO_BATCHES)
    kernels = trace.StepKernels(metadata.step_stats)
    events, _ = trace.StepEvents(kernels, TABLE, remat, 'unrolled')
    self.windows = {(e.stage, e.micro_batch, e.phase): (e.start, e.end)
                    for e in events}
    self.calls = {}
    for kernel in kernels:
      for phase, pattern in (('forward', _FORWARD_KERNEL_RE),
                             ('backward', _BACKWARD_KERNEL_RE)):
        match = pattern.match(kernel.name)
        if match:
          key = (int(match.group(1)), int(match.group(2)), phase)
          self.calls.setdefault(key, []).append(kernel.name)
    assert sorted(self.calls) == [
        (k, m, phase) for k in range(NUM_STAGES)
        for m in range(NUM_MICRO_BATCHES) for phase in ('backward', 'forward')]
    self.ancestors = engine_util.ExecutedAncestors(metadata.partition_graphs)

  def Window(self, k, m, phase):
    """(start, end) of a forward call, or a backward call with its recompute."""
    if phase == 'forward':
      return self.windows[k, m, 'forward']
    return (self.windows.get((k, m, 'recompute'),
                             self.windows[k, m, 'backward'])[0],
            self.windows[k, m, 'backward'][1])

  def AssertRunsAfter(self, earlier, later):
    """Call `later` started after call `earlier` had ended.

    Asserted first in the graph: every kernel of `later` waits for every
    kernel of `earlier` (data or control edges, possibly across devices).
    Given that, the step stats must show it too, exactly: the executor
    records a kernel's end before it schedules the kernels that wait for it.
    The order of two calls that the graph leaves free is a matter of threads
    and load (2 cores for 4 logical CPU devices and the test's neighbours):
    checked on the step stats alone, such an order held in most runs and
    failed in some (remat='except_last': 2 runs in 40).

    Args:
      earlier: (stage, micro-batch, phase) of the call that comes first.
      later: (stage, micro-batch, phase) of the call that comes after it.
    """
    for kernel in self.calls[later]:
      missing = set(self.calls[earlier]) - self.ancestors(kernel)
      assert not missing, (
          f'{later} kernel {kernel} does not wait for {earlier} kernels '
          f'{sorted(missing)}')
    assert self.Window(*later)[0] >= self.Window(*earlier)[1], (
        earlier, self.Window(*earlier), later, self.Window(*later))


@pytest.mark.parametrize('remat', ['always', 'except_last'])
def testUnrolledStageCallsRunInScheduleOrder(remat):
  """Per stage: forwards in order, then backward calls in reverse order.

  From the traced step's stage calls (`trace.StepEvents`) and the graph that
  ran (`_UnrolledStep.AssertRunsAfter`): every call that re-materializes
  starts its recompute after the stage's last forward call, and the backward
  call of micro-batch m (recompute and gradients) starts only after that of
  m + 1 has ended, where m + 1 re-materializes. After a call that does not
  (the last with 'except_last'), see
  testUnrolledBackwardWaitsForTheCallWithoutRecompute.

  Args:
    remat: The remat mode ('never' leaves the backward to TensorFlow).
  """
  step = _UnrolledStep(remat)
  recomputed = schedule.RecomputedCalls(TABLE, remat)
  recomputes = [m for m in range(NUM_MICRO_BATCHES) if recomputed[0, m]]
  assert recomputes == list(range(NUM_MICRO_BATCHES if remat == 'always'
                                  else NUM_MICRO_BATCHES - 1))
  for k in range(NUM_STAGES):
    # The trace found each recompute (kernels of the forward body that the
    # backward call ran again) and no other.
    assert [m for m in range(NUM_MICRO_BATCHES)
            if (k, m, 'recompute') in step.windows] == recomputes, k
    for m in range(1, NUM_MICRO_BATCHES):
      step.AssertRunsAfter((k, m - 1, 'forward'), (k, m, 'forward'))
      if m in recomputes:
        step.AssertRunsAfter((k, m, 'backward'), (k, m - 1, 'backward'))
    for m in recomputes:
      step.AssertRunsAfter((k, NUM_MICRO_BATCHES - 1, 'forward'),
                           (k, m, 'backward'))


def testUnrolledBackwardWaitsForTheCallWithoutRecompute():
  """'except_last': the backward of M-2 starts after that of M-1 has ended.

  The last call keeps its activations and TensorFlow differentiates it; the
  recompute of micro-batch M-2 must still wait for all of that gradient (its
  weight gradients and the gradient sent to the previous stage), or two
  micro-batches' activations live at once. (With control dependencies on
  the outputs of TensorFlow's inlined gradient function it waited for the
  function's side effects only: `recompute.Gate` gates with data.)
  """
  step = _UnrolledStep('except_last')
  last = NUM_MICRO_BATCHES - 1
  for k in range(NUM_STAGES):
    step.AssertRunsAfter((k, last, 'backward'), (k, last - 1, 'backward'))


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
  # The order is exact, not a matter of timing: a call's recomputed ReLU and
  # its weight gradient are linked by data (Relu -> ReluGrad -> MatMul_1);
  # the ticks of a loop run one after another (parallel_iterations=1: the
  # executor starts no kernel of tick t + 1 before every kernel of tick t has
  # ended), a loop starts when the previous one has ended (loop.py), and the
  # backward loop needs the loss. The executor records a kernel's end, and
  # appends its stats to node_stats, before it starts any kernel waiting for
  # it; so the start times, ties broken by the position in node_stats, give
  # that order. (By start microseconds and kind alone, a ReLU and its gradient
  # starting in the same microsecond would sort the gradient first.)
  kernels = {}
  for dev in step_stats.dev_stats:
    for position, node in enumerate(dev.node_stats):
      match = re.search(r'fc(\d)/(Relu$|MatMul_grad/MatMul_1$)',
                        node.node_name)
      if match:
        kind = 'relu' if match.group(2) == 'Relu' else 'gradient'
        kernels.setdefault(dev.device, []).append(
            (node.all_start_micros, position, kind))
  assert sorted(kernels) == engine_util.CPUS
  for device, runs in kernels.items():
    assert [kind for _, _, kind in sorted(runs)] == (
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
  before = host.ResetMemoryStats()
  Step()
  return (host.PeakBytes() - before) / 2**20


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
