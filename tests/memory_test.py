"""Re-materialization saves memory: the allocator's peak of a step.

The saving rests on the order in which a stage's calls run (docs/design.md):
its recomputes start only after all its forward calls, and its backward calls
(recompute, then gradients) run one micro-batch at a time in reverse order,
so that one micro-batch's activations live at once. That order is tested per
engine (unrolled_test.py, loop_test.py); here the saving itself, from the CPU
allocator's peak (`benchmarks.host`: conftest.py starts TensorFlow with an
allocator that keeps it on every host).
"""

import numpy as np
from lingvo import compat as tf

from benchmarks import host
import test_util

NUM_MICRO_BATCHES = 4


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


def testRematKeepsOneOrTwoMicroBatchesOfActivations():
  """remat='always' peaks far below 'never' at M=4, in either engine.

  Measured: about 34.5 MiB without re-materialization (all 4 micro-batches'
  activations, 8 MiB each, kept), 11-13 MiB with it (unrolled) and 15-17.3
  MiB (loop; 17.3 with the other test process beside it: a micro-batch's
  recompute may overlap the previous backward, as the threads run them).
  At most two micro-batches' activations stay below 0.7 of 'never'; a
  recompute that ran too early, or kept several micro-batches' activations
  at once, would come near 'never'.
  """
  never = _PeakMiB('unrolled', 'never')
  assert never > 30  # 16 cells x 2 MiB of activations, at least.
  for engine in ('unrolled', 'loop'):
    always = _PeakMiB(engine, 'always')
    assert always < 0.7 * never, (engine, always, never)


