"""Tests of planning.planner (search, time and memory model) and the gradient
term of the simulator's memory model."""

import dataclasses
import json

import pytest

from lingvo_gpipe.planning import planner
from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate

Affine = planner.Affine


def _Cell(name, forward=(1.0, 1.0), backward=(1.0, 2.0), update=0.0,
          activation=0.0, output=0.0, weight=0.0, gradient=0.0, slot=0.0):
  return planner.CellProfile(
      name=name, forward_s=Affine(*forward), backward_s=Affine(*backward),
      update_s=update, activation_bytes=activation, output_bytes=output,
      weight_bytes=weight, gradient_bytes=gradient, slot_bytes=slot)


def _Profile(cells, batch_size=4, **kwargs):
  return planner.Profile(cells=tuple(cells), input_bytes=0.0,
                         batch_size=batch_size, **kwargs)


# Two cells; a call of one cell on n examples: forward 1 + n, backward
# 1 + 2n (seconds); 100 bytes of weights each.
TWO_CELLS = [_Cell('a', weight=100.0), _Cell('b', weight=100.0)]


def testAffineFit():
  assert Affine.Fit([2, 10], [3.0, 7.0]) == Affine(2.0, 0.5)
  assert Affine.Fit([4], [8.0]) == Affine(0.0, 2.0)
  # A negative fixed part (noise): proportional through the largest size.
  assert Affine.Fit([2, 4], [1.0, 4.0]) == Affine(0.0, 1.0)
  # A negative slope: constant at the mean.
  assert Affine.Fit([2, 4], [3.0, 1.0]) == Affine(2.0, 0.0)
  assert Affine(2.0, 0.5)(4) == 4.0
  with pytest.raises(ValueError, match='positive'):
    Affine.Fit([0, 2], [1.0, 2.0])


def testGradientMemoryInTheTable():
  # GPipe K=2 M=2, remat 'never'; chunk c: input 1, activations 100,
  # gradients 10. Device 1 runs F1.0 F1.1 B1.1 B1.0: after both forwards it
  # holds 2 inputs + 2 activations = 202; its first backward adds the
  # gradient sum (10): 212. Its second backward holds one input and one
  # activation (101), the sum and a fresh copy (20): 121.
  table = schedule.BuildTable('gpipe', 2, 2)
  sim = simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0], 'never',
                          input_memory=[1.0, 1.0],
                          activation_memory=[100.0, 100.0],
                          gradient_memory=[10.0, 10.0])
  assert sim.peak_memory == [212.0, 212.0]
  assert sim.peak_gradients == [10.0, 10.0]
  assert sim.peak_inputs == [2, 2] and sim.peak_activations == [2, 2]
  # 'always': two inputs, one running call's activations, then the sum and
  # the fresh copy of the second backward: max(2 + 100 + 10, 1 + 100 + 20).
  always = simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0], 'always',
                             input_memory=[1.0, 1.0],
                             activation_memory=[100.0, 100.0],
                             gradient_memory=[10.0, 10.0])
  assert always.peak_memory == [121.0, 121.0]
  assert always.peak_gradients == [20.0, 20.0]
  # Without gradient memory the model is the one before.
  plain = simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0], 'never',
                            input_memory=[1.0, 1.0],
                            activation_memory=[100.0, 100.0])
  assert plain.peak_memory == [202.0, 202.0]
  assert plain.peak_gradients == [0.0, 0.0]
  with pytest.raises(ValueError, match='gradient_memory'):
    simulate.Simulate(table, [1.0, 1.0], [2.0, 2.0],
                      gradient_memory=[1.0])


def testPredictTimeAndMemoryByHand():
  cells = [
      _Cell('a', activation=10.0, output=3.0, weight=100.0, gradient=40.0,
            slot=80.0, update=0.5),
      _Cell('b', activation=20.0, output=5.0, weight=200.0, gradient=60.0,
            slot=120.0, update=0.25),
  ]
  profile = _Profile(cells, batch_size=4, outside_s=Affine(0.1, 0.0),
                     outside_bytes=Affine(0.0, 7.0), step_overhead_s=0.2)
  profile = planner.Profile(**{**profile.__dict__, 'input_bytes': 2.0})
  c = planner.Predict(profile, num_stages=2, num_micro_batches=2,
                      remat='never', partition=[1, 1], memory_per_device=1e9)
  # Micro-batches of 2: forward 3 s, backward 5 s per chunk. Forward ticks
  # F0.0 [0, 3], F0.1 and F1.0 [3, 6], F1.1 [6, 9]; backward B1.1 [9, 14],
  # B1.0 and B0.1 [14, 19], B0.0 [19, 24]. Then the work around the
  # pipeline (0.1), the slower update (0.5) and the overhead (0.2).
  assert c.step_terms == {'pipeline': 24.0, 'outside_pipeline': 0.1,
                          'update': 0.5, 'overhead': 0.2, 'replicas': 0.0}
  assert c.predicted_step_s == pytest.approx(24.8)
  # Device 0 (cell a) runs F0.0 F0.1 B0.1 B0.0. After both forwards: two
  # inputs (2 examples x 2 bytes) and two calls' activations (2 x 10 x 2),
  # 48; B0.1 adds the gradient sum (40): 88. B0.0 holds one input and one
  # call's activations (24), the sum and its own fresh gradients (80): 104,
  # the peak. Around it: weights 100, slots 80 and the work around the
  # pipeline on 4 examples (7 x 4); a backward receives the gradient of its
  # output (3 x 2).
  assert c.device_peak_bytes[0] == 100 + 80 + 80 + 4 + 20 + 6 + 28
  # Device 1 (cell b): its inputs are a's outputs (3 x 2); at B1.0: one
  # input (6), one call's activations (40) and 2 x 60 of gradients; the
  # gradient of its output (5 x 2); the merged output of 4 examples (5 x 4).
  assert c.device_peak_bytes[1] == 200 + 120 + 120 + 6 + 40 + 10 + 20
  assert c.peak_device == 1
  assert c.peak_terms == {'weights': 200, 'optimizer_slots': 120,
                          'gradients': 120, 'stage_inputs': 6,
                          'activations': 40, 'backward_workspace': 0,
                          'output_gradient': 10, 'outside_pipeline': 0,
                          'merged_output': 20, 'update_copies': 0,
                          'replicas': 0}
  assert c.predicted_peak_bytes == 516 and c.fits
  assert c.engine == 'unrolled' and c.replicas == 1
  assert not planner.Predict(profile, 2, 2, 'never', [1, 1],
                             memory_per_device=515).fits


def testTheLearnersGradientCopies():
  # One device, two cells of 100 weight and 100 gradient bytes, no slots or
  # activations: the pipeline holds 200 + 200 (the gradient sum); the update
  # scales each gradient into a new tensor: 200 + 200 + 100, so 100 more.
  cells = [_Cell('a', weight=100.0, gradient=100.0),
           _Cell('b', weight=100.0, gradient=100.0)]
  c = planner.Predict(_Profile(cells), 1, 1, 'never', [2])
  assert c.peak_terms['gradients'] == 200
  assert c.peak_terms['update_copies'] == 100
  assert c.predicted_peak_bytes == 200 + 200 + 100
  # With two devices each holds one cell: 100 + 100, then 100 + 100 + 100.
  c = planner.Predict(_Profile(cells), 2, 1, 'never', [1, 1])
  assert c.device_peak_bytes == [300, 300]


def testReplicasPayTheirMeasuredOverhead():
  profile = _Profile(TWO_CELLS, replica_overhead_s=0.3,
                     replica_overhead_bytes=1000.0)
  one = planner.Predict(profile, 2, 1, 'always', [1, 1])
  two = planner.Predict(profile, 1, 1, 'always', [2], replicas=2)
  assert one.step_terms['replicas'] == 0.0
  assert two.step_terms['replicas'] == 0.3
  assert two.predicted_step_s == pytest.approx(
      sum(v for k, v in two.step_terms.items()))
  assert one.peak_terms['replicas'] == 0.0
  assert two.peak_terms['replicas'] == 1000.0
  without = planner.Predict(_Profile(TWO_CELLS), 1, 1, 'always', [2],
                            replicas=2)
  assert two.predicted_peak_bytes == without.predicted_peak_bytes + 1000.0
  assert planner.Profile.FromJson(profile.ToJson()) == profile


def testBackwardWorkspace():
  # A running backward needs its largest cell's workspace on the
  # micro-batch: 3 + 5 x 2 bytes on device 0 (a kernel's temporary need not
  # shrink with the examples) next to its two inputs' worth of nothing and
  # one call's activations.
  cells = [_Cell('a', activation=10.0, weight=1.0),
           _Cell('b', weight=1.0)]
  cells[0] = planner.CellProfile(**{**cells[0].__dict__,
                                    'workspace_bytes': Affine(3.0, 5.0)})
  c = planner.Predict(_Profile(cells), 2, 2, 'always', [1, 1])
  assert c.device_peak_bytes[0] == 1 + 20 + 3 + 10
  assert c.device_peak_bytes[1] == 1


def testBackwardWorkspaceOfACallThatKeptItsActivations():
  # Such a backward holds all the call's activations while its own kernels
  # peak (7 bytes an example here, against 5 when forward and backward run
  # in one function): device 0 charges it when one of its calls keeps.
  cells = [_Cell('a', activation=10.0, weight=1.0),
           _Cell('b', weight=1.0)]
  cells[0] = planner.CellProfile(
      **{**cells[0].__dict__, 'workspace_bytes': Affine(0.0, 5.0),
         'kept_workspace_bytes': Affine(0.0, 7.0)})
  profile = _Profile(cells)
  peaks = {remat: planner.Predict(profile, 2, 2, remat,
                                  [1, 1]).device_peak_bytes[0]
           for remat in ('always', 'except_last', 'never')}
  # 'always': one recomputed call's activations; 'except_last': the last
  # micro-batch's call keeps them (its backward follows its forward on
  # device 0); 'never': both calls keep them.
  assert peaks == {'always': 1 + 20 + 5 * 2, 'except_last': 1 + 20 + 7 * 2,
                   'never': 1 + 40 + 7 * 2}
  # Profiles written before the kept workspace was measured (and when the
  # one workspace they have was bytes per example) fall back to it.
  old = dict(cells[0].ToJson(), workspace_bytes=5.0)
  del old['kept_workspace_bytes']
  fallback = planner.CellProfile.FromJson(old)
  assert fallback.kept_workspace_bytes is None
  assert fallback.Workspace(keeps=True) == Affine(0.0, 5.0)
  assert fallback.Workspace(keeps=False) == Affine(0.0, 5.0)
  assert planner.CellProfile.FromJson(cells[0].ToJson()) == cells[0]


def testWorkspaceOfTheBackwardRunningAtThePeak():
  # K=2 v=2 M=1 'never', cells a b c d of 1 example. Device 0 runs F0 F2
  # B2 B0; cell a's backward needs a large workspace (50), c's a small one
  # (2). At B2 the device holds both calls' activations (10 + 10), both
  # inputs and c's workspace: 20 + 2 + 6 (inputs 2 + 4) + 1 (gradient of
  # c's output); at B0 only a's input and activations, a's workspace and
  # the gradient of a's output: 2 + 10 + 50 + 3. The peak is B0's; the
  # largest workspace next to all activations (the old model) would be
  # 20 + 50 + 6 + 3.
  def Cell(name, workspace, output):
    return planner.CellProfile(**{
        **_Cell(name, activation=10.0, output=output).__dict__,
        'workspace_bytes': Affine(workspace, 0.0),
        'kept_workspace_bytes': Affine(workspace, 0.0)})
  cells = [Cell('a', 50.0, 3.0), Cell('b', 0.0, 4.0), Cell('c', 2.0, 1.0),
           Cell('d', 0.0, 1.0)]
  profile = planner.Profile(cells=tuple(cells), input_bytes=2.0, batch_size=1)
  c = planner.Predict(profile, 2, 1, 'never', [1, 1, 1, 1], virtual_stages=2)
  assert c.device_peak_bytes[0] == 2 + 10 + 50 + 3
  assert c.peak_device == 0 and c.peak_terms['backward_workspace'] == 50
  assert c.peak_terms['stage_inputs'] == 2
  # The stage inputs are each chunk's own (2 for chunk 0, 4 for chunk 2),
  # not the largest times their number.
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


def testCallOverheadCalibration():
  profile = _Profile(TWO_CELLS, batch_size=8)
  candidate = planner.CalibrationCandidate(profile, num_devices=2)
  # The deepest pipeline of 2 devices, 4 micro-batches, no recompute.
  assert (candidate.num_stages, candidate.num_micro_batches,
          candidate.virtual_stages, candidate.remat, candidate.replicas,
          candidate.partition) == (2, 4, 1, 'never', 1, [1, 1])
  # GPipe K=2 M=4 of equal chunks: 5 forward ticks then 5 backward ticks
  # on the critical path, each call c seconds more: the step grows by 5 c.
  measured = candidate.predicted_step_s + 5 * 0.25
  call_s = planner.CalibrateCallOverhead(profile, candidate, measured)
  assert call_s == pytest.approx(0.25, abs=1e-8)
  calibrated = dataclasses.replace(profile, call_overhead_s=call_s)
  assert planner.Predict(calibrated, 2, 4, 'never', [1, 1]).predicted_step_s \
      == pytest.approx(measured)
  # Half to a forward (and its recompute), half to a backward. One chunk of
  # both cells on 8 examples (forward 9, backward 17 per cell): forward,
  # recompute and backward, each with its half.
  one = planner.Predict(calibrated, 1, 1, 'always', [2])
  assert one.step_terms['pipeline'] == pytest.approx(
      (18 + 0.125) * 2 + 34 + 0.125)
  # A step measured faster than predicted calls for no overhead.
  assert planner.CalibrateCallOverhead(
      profile, candidate, candidate.predicted_step_s / 2) == 0.0
  with pytest.raises(ValueError, match='measured_step_s'):
    planner.CalibrateCallOverhead(profile, candidate, float('nan'))
  # No pipeline on one device or one cell; M = 1 when the batch is odd.
  assert planner.CalibrationCandidate(profile, 1) is None
  assert planner.CalibrationCandidate(_Profile(TWO_CELLS[:1]), 2) is None
  assert planner.CalibrationCandidate(_Profile(TWO_CELLS, batch_size=6),
                                      2).num_micro_batches == 3
  assert planner.CalibrationCandidate(_Profile(TWO_CELLS, batch_size=5),
                                      2).num_micro_batches == 1
  assert planner.Profile.FromJson(calibrated.ToJson()) == calibrated


def testSearchFindsTheHandOptimum():
  # Pure per-example costs plus 1 s per call: K=1 with R=2 replicas and one
  # micro-batch of 2 examples costs 6 s forward + 10 s backward = 16 s, no
  # recompute; K=2 (R=1) is at best 24 s (M=2, see above); recomputing
  # costs 6 s more.
  result = planner.Search(_Profile(TWO_CELLS), num_devices=2,
                          memory_per_device=1e9)
  best = result.candidates[result.chosen]
  assert result.chosen == 0
  assert (best.num_stages, best.replicas, best.num_micro_batches) == (1, 2, 1)
  assert best.remat in ('except_last', 'never')  # The same at M=1.
  assert best.predicted_step_s == 16.0
  steps = [c.predicted_step_s for c in result.candidates]
  assert steps == sorted(steps)  # All fit: ranked by step time.
  # K in {1, 2}; M in the divisors of 2 (R=2) or 4 (R=1); v = 1 on one
  # device, v in {1} for K=2 (2 cells); 3 remat modes.
  assert len(result.candidates) == (2 + 3) * 3


def testSearchUnderABudgetPicksTheFastestThatFits():
  # 150 bytes per device: K=1 holds both cells' 200 bytes of weights.
  result = planner.Search(_Profile(TWO_CELLS), 2, memory_per_device=150)
  best = result.candidates[result.chosen]
  assert (best.num_stages, best.num_micro_batches, best.remat) == (
      2, 2, 'never')
  assert best.predicted_step_s == 24.0
  assert best.predicted_peak_bytes == 100.0
  fits = [c.fits for c in result.candidates]
  assert fits == sorted(fits, reverse=True)  # Those that fit come first.
  assert not any(c.fits for c in result.candidates if c.num_stages == 1)
  text = planner.Reason(result)
  assert "K=2 v=1 M=2 R=1 gpipe remat='never' [1, 1]" in text
  assert 'Faster but over budget: K=1' in text


def testNothingFits():
  result = planner.Search(_Profile(TWO_CELLS), 2, memory_per_device=50)
  assert result.chosen is None
  message = planner.NothingFits(result)
  assert 'nothing fits memory_per_device=50' in message
  assert 'the smallest predicted peak is 100 bytes' in message
  assert 'dominated by weights: 100 B (100%)' in message
  assert planner.Reason(result) == message


def testMemoryLimitedPartition():
  # Equal costs: the fastest partition is [2, 2], whose first stage holds
  # 310 bytes of weights; under 305 the partitioner moves cells: [1, 3].
  cells = [_Cell(f'c{i}', weight=w) for i, w in enumerate([300, 10, 10, 10])]
  profile = _Profile(cells, batch_size=2)
  free = planner.PlanPartition(profile, 2, 1, 'never', 1, 'gpipe', 1, None)
  assert free.partition == [2, 2] and free.partition_rule == 'fastest'
  limited = planner.PlanPartition(profile, 2, 1, 'never', 1, 'gpipe', 1, 305)
  assert limited.partition == [1, 3]
  assert limited.partition_rule == 'memory_limit'
  assert limited.fits and limited.predicted_peak_bytes == 300


def testSchedulesComeFromTheTables(monkeypatch):
  # A schedule added to the tables is searched without planner code.
  monkeypatch.setitem(schedule.SCHEDULES, 'copy', schedule.Schedule(
      schedule.GPipeTable, False, 'GPipe under another name'))
  result = planner.Search(_Profile(TWO_CELLS), 2, 1e9)
  assert {c.schedule for c in result.candidates} == {'gpipe', 'copy'}
  # One whose loss is inside the pipeline needs a last cell with the loss.
  monkeypatch.setitem(schedule.SCHEDULES, 'inside', schedule.Schedule(
      schedule.GPipeTable, True, 'needs the loss inside'))
  result = planner.Search(_Profile(TWO_CELLS), 2, 1e9)
  assert 'inside' not in {c.schedule for c in result.candidates}
  assert ("schedule 'inside': needs the loss inside the pipeline; the last "
          'cell does not compute the loss.') in result.skipped


def testCandidateJson():
  result = planner.Search(_Profile(TWO_CELLS), 2, 1e9)
  row = json.loads(json.dumps(result.candidates[0].ToJson()))
  for key in ('num_stages', 'num_micro_batches', 'schedule',
              'virtual_stages', 'remat', 'partition', 'replicas',
              'predicted_step_s', 'predicted_peak_bytes', 'fits',
              'measured_step_s', 'measured_peak_bytes'):
    assert key in row, key
  assert row['measured_step_s'] is None
  profile = _Profile(TWO_CELLS, outside_s=Affine(1.0, 2.0))
  assert planner.Profile.FromJson(
      json.loads(json.dumps(profile.ToJson()))) == profile


def testOverrideLines():
  profile = _Profile(TWO_CELLS, stack_path='task.stack',
                     stack_settings={'num_stages': 4,
                                     'micro_batch_size': None})
  c = planner.Predict(profile, 2, 2, 'always', [1, 1])
  assert planner.OverrideLines(profile, c) == [
      'task.stack.num_stages: 2', 'task.stack.virtual_stages: 1',
      'task.stack.num_micro_batches: 2', 'task.stack.schedule: gpipe',
      'task.stack.remat: always', 'task.stack.partition: [1, 1]',
      'input.batch_size: 4'
  ]


def testProfileSizes():
  assert planner.ProfileSizes(32, 2) == ([4, 32], [16, 32])
  assert planner.ProfileSizes(8, 4) == ([1, 8], [2, 4, 8])
  with pytest.raises(ValueError, match='num_devices'):
    planner.ProfileSizes(8, 0)


def testBadSearchArguments():
  with pytest.raises(ValueError, match='memory_per_device'):
    planner.Search(_Profile(TWO_CELLS), 2, 0)
  with pytest.raises(ValueError, match="schedule='nope'"):
    planner.Search(_Profile(TWO_CELLS), 2, 1.0, schedules=['nope'])
  with pytest.raises(ValueError, match='batch_size=4 does not split'):
    planner.Predict(_Profile(TWO_CELLS), 1, 3, 'always', [2])

