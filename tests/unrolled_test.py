"""Tests of engine.unrolled: the order its stage calls run in.

The order is read from RunMetadata step stats of a real step, and where the
step stats alone would depend on the timing of threads, from the
dependencies of the graph that ran (the saving of re-materialization rests on
it: memory_test.py, docs/design.md).
"""

import re

import pytest
import tensorflow as tf

from lingvo_gpipe.engine import pipeline
from lingvo_gpipe.engine import trace
from lingvo_gpipe.engine import unrolled
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


def testCheckTableAcceptsOnlyBackwardsInReverseForwardOrder():
  """GPipe's tables (also circular) run; 1F1B interleaves and is refused."""
  for k, v in ((2, 1), (4, 1), (2, 2)):
    unrolled.CheckTable(schedule.BuildTable('gpipe', k, 8, v))
  with pytest.raises(ValueError, match="schedule='1f1b' does not on device 0; "
                     "use engine='loop'"):
    unrolled.CheckTable(schedule.BuildTable('1f1b', 2, 4))


@pytest.mark.parametrize('remat', schedule.REMAT_MODES)
def testForwardCallsWithSideEffectsAreInlinedInGraphMode(remat):
  """Grappler inlines the unrolled engine's forward calls of stateful bodies.

  It inlines a call with side effects (here an Assert, as Lingvo's layers
  have) only where the call has outgoing control edges; a call left as a
  call runs as a multi-device function of several executor runs.

  Args:
    remat: The remat mode.
  """

  def AssertingStage(theta, inputs, state, micro_batch_id):
    del micro_batch_id
    (x,) = inputs
    with tf.control_dependencies(
        [tf.debugging.Assert(tf.reduce_all(tf.math.is_finite(x)), [x])]):
      x = tf.identity(x)
    return (engine_util.Plain(theta, x),), state

  graph = tf.Graph()
  with graph.as_default():
    ws = [tf.constant(w) for w in engine_util.DENSE_WEIGHTS]
    pipe = pipeline.Pipeline([AssertingStage] * 2, engine_util.CPUS[:2], 2,
                             remat=remat, engine='unrolled')
    (y,), _ = pipe([ws[:2], ws[2:]], [tf.constant(engine_util.DENSE_X)],
                   [tf.constant(0)] * 2)
    grads = tf.gradients(tf.reduce_sum(y * y), ws)
    with tf.compat.v1.Session(
        graph=graph, config=engine_util.SessionConfig()) as sess:
      metadata = tf.compat.v1.RunMetadata()
      sess.run(grads,
               options=tf.compat.v1.RunOptions(output_partition_graphs=True),
               run_metadata=metadata)
  calls = [n.name for g in metadata.partition_graphs for n in g.node
           if n.op == 'StatefulPartitionedCall' and
           not n.name.startswith('gradients/')]
  assert not calls
