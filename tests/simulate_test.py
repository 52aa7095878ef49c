"""Tests of planning.simulate's memory model: gradients and workspaces.

(Its timing, bubbles and engines are tested with the tables, in
schedule_test.py.)
"""

import pytest

from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate


def testGradientMemoryInTheTable():
  # GPipe K=2 M=2, remat 'never'; chunk c: input 1, activations 100,
  # gradients 10. Device 1 runs F1.0 F1.1 B1.1 B1.0: after both forwards it
  # holds 2 inputs + 2 activations = 202; its first backward adds the
  # gradient sum (10): 212. Its second backward holds one input and one
  # activation (101), the sum and a fresh copy (20): 121.
  table = schedule.BuildTable('gpipe', 2, 2)

  def Simulate(remat, **memory):
    return simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0], remat,
                             input_memory=[1.0, 1.0],
                             activation_memory=[100.0, 100.0], **memory)

  sim = Simulate('never', gradient_memory=[10.0, 10.0])
  assert sim.peak_memory == [212.0, 212.0]
  assert sim.peak_gradients == [10.0, 10.0]
  assert sim.peak_inputs == [2, 2] and sim.peak_activations == [2, 2]
  # 'always': two inputs, one running call's activations, then the sum and
  # the fresh copy of the second backward: max(2 + 100 + 10, 1 + 100 + 20).
  always = Simulate('always', gradient_memory=[10.0, 10.0])
  assert always.peak_memory == [121.0, 121.0]
  assert always.peak_gradients == [20.0, 20.0]
  # Without gradient memory the model is the one before.
  plain = Simulate('never')
  assert plain.peak_memory == [202.0, 202.0]
  assert plain.peak_gradients == [0.0, 0.0]
  with pytest.raises(ValueError, match='gradient_memory'):
    simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0],
                      gradient_memory=[1.0])


def testWorkspaceOfTheBackwardRunningAtThePeak():
  # K=2 v=2 M=1 'never': device 0 runs F0 F2 B2 B0. The stage inputs are
  # each chunk's own (2 for chunk 0, 4 for chunk 2), not the largest times
  # their number.
  table = schedule.BuildTable('gpipe', 2, 1, 2)
  sim = simulate.Simulate(table, [1.0] * 4, [1.0] * 4, 'never',
                          input_memory=[2.0, 3.0, 4.0, 1.0],
                          activation_memory=[10.0] * 4,
                          backward_memory=[50.0, 0.0, 3.0, 0.0])
  # Device 0 at B2: inputs 2 + 4, activations 20, workspace 3: 29; at B0:
  # 2 + 10 + 50 = 62, the peak, with B0's backward running.
  assert sim.peak_memory[0] == 62.0
  assert sim.peak_input_memory[0] == 2.0
  assert sim.peak_backward_chunk[0] == 0
  # Device 1 (chunks 1 and 3) peaks after its forwards: 3 + 1 + 20, and at
  # B3 (nothing transient) holds the same: the first such tick, a forward.
  assert sim.peak_memory[1] == 24.0 and sim.peak_backward_chunk[1] is None
  with pytest.raises(ValueError, match='backward_memory'):
    simulate.Simulate(table, [1.0] * 4, [1.0] * 4, backward_memory=[1.0])
