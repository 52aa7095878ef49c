"""Tests of engine.loop: its per-device loops, their order and channels."""

import re

import numpy as np
import tensorflow as tf

from lingvo_gpipe.engine import loop
from lingvo_gpipe.planning import schedule
import engine_util
import test_util

F, B = schedule.FORWARD, schedule.BACKWARD
NUM_MICRO_BATCHES = 4


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


def _HloLines(engine, num_micro_batches, k=4, virtual_stages=1):
  """Lines of the XLA HLO of a training step's gradients (4 layers)."""
  ws = [tf.constant(w) for w in engine_util.DENSE_WEIGHTS]
  x = tf.constant(np.tile(engine_util.DENSE_X, [4, 1]))  # Batch 32: M up to 32.

  @tf.function(jit_compile=True, autograph=False)
  def Step():
    with tf.GradientTape() as tape:
      tape.watch(ws)
      y, states = engine_util.Piped(ws, x, k, num_micro_batches, 'always',
                                    [''] * k, engine, virtual_stages)
      loss = engine_util.Loss(y, states[-1]['aux'])
    return tape.gradient(loss, ws)

  return len(Step.experimental_get_compiler_ir()(stage='hlo').splitlines())


def testLoopGraphDoesNotGrowWithM():
  """The loop engine's compiled step is the same size for M = 4 and 32."""
  loop = [_HloLines('loop', m) for m in (4, 32)]
  unrolled = [_HloLines('unrolled', m) for m in (4, 32)]
  assert loop[0] == loop[1], loop
  assert unrolled[1] > 5 * unrolled[0], unrolled  # K x M calls.
  assert loop[1] < unrolled[1], (loop, unrolled)


def testCircularLoopGraphDoesNotGrowWithM():
  """K = 2, v = 2 on the loop engine: the same HLO for M = 4 and 32."""
  lines = [_HloLines('loop', m, k=2, virtual_stages=2) for m in (4, 32)]
  # M is a loop bound, not a count of calls: not one more line at M = 32.
  assert lines[0] == lines[1], lines
