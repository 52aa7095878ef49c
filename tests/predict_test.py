"""Tests of planning.predict: the planner's step time and memory model."""

import pytest

from lingvo_gpipe.planning import predict
from lingvo_gpipe.planning import profile as profile_lib
from planning_util import Affine
from planning_util import Cell
from planning_util import Profile
from planning_util import Shape
from planning_util import TWO_CELLS


def testPredictTimeAndMemoryByHand():
  cells = [
      Cell('a', activation=10.0, output=3.0, weight=100.0, gradient=40.0,
           slot=80.0, update=0.5),
      Cell('b', activation=20.0, output=5.0, weight=200.0, gradient=60.0,
           slot=120.0, update=0.25),
  ]
  profile = Profile(cells, batch_size=4, outside_s=Affine(0.1, 0.0),
                    outside_bytes=Affine(0.0, 7.0), step_overhead_s=0.2)
  profile = profile_lib.Profile(**{**profile.__dict__, 'input_bytes': 2.0})
  c = predict.Predict(profile, Shape(2, 2, 'never'), partition=[1, 1],
                      memory_per_device=1e9)
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
  assert c.shape == Shape(2, 2, 'never')
  assert not predict.Predict(profile, Shape(2, 2, 'never'), [1, 1],
                             memory_per_device=515).fits


def testTheLearnersGradientCopies():
  # One device, two cells of 100 weight and 100 gradient bytes, no slots or
  # activations: the pipeline holds 200 + 200 (the gradient sum); the update
  # scales each gradient into a new tensor: 200 + 200 + 100, so 100 more.
  cells = [Cell('a', weight=100.0, gradient=100.0),
           Cell('b', weight=100.0, gradient=100.0)]
  c = predict.Predict(Profile(cells), Shape(1, 1, 'never'), [2])
  assert c.peak_terms['gradients'] == 200
  assert c.peak_terms['update_copies'] == 100
  assert c.predicted_peak_bytes == 200 + 200 + 100
  # With two devices each holds one cell: 100 + 100, then 100 + 100 + 100.
  c = predict.Predict(Profile(cells), Shape(2, 1, 'never'), [1, 1])
  assert c.device_peak_bytes == [300, 300]


def testReplicasPayTheirMeasuredOverhead():
  profile = Profile(TWO_CELLS, replica_overhead_s=0.3,
                    replica_overhead_bytes=1000.0)
  one = predict.Predict(profile, Shape(2, 1, 'always'), [1, 1])
  two = predict.Predict(profile, Shape(1, 1, 'always', replicas=2), [2])
  assert one.step_terms['replicas'] == 0.0
  assert two.step_terms['replicas'] == 0.3
  assert two.predicted_step_s == pytest.approx(
      sum(v for k, v in two.step_terms.items()))
  assert one.peak_terms['replicas'] == 0.0
  assert two.peak_terms['replicas'] == 1000.0
  without = predict.Predict(Profile(TWO_CELLS),
                            Shape(1, 1, 'always', replicas=2), [2])
  assert two.predicted_peak_bytes == without.predicted_peak_bytes + 1000.0
  assert profile_lib.Profile.FromJson(profile.ToJson()) == profile


def testBackwardWorkspace():
  # A running backward needs its largest cell's workspace on the
  # micro-batch: 3 + 5 x 2 bytes on device 0 (a kernel's temporary need not
  # shrink with the examples) next to its two inputs' worth of nothing and
  # one call's activations.
  cells = [Cell('a', activation=10.0, weight=1.0),
           Cell('b', weight=1.0)]
  cells[0] = profile_lib.CellProfile(**{**cells[0].__dict__,
                                        'workspace_bytes': Affine(3.0, 5.0)})
  c = predict.Predict(Profile(cells), Shape(2, 2, 'always'), [1, 1])
  assert c.device_peak_bytes[0] == 1 + 20 + 3 + 10
  assert c.device_peak_bytes[1] == 1


def testBackwardWorkspaceOfACallThatKeptItsActivations():
  # Such a backward holds all the call's activations while its own kernels
  # peak (7 bytes an example here, against 5 when forward and backward run
  # in one function): device 0 charges it when one of its calls keeps.
  cells = [Cell('a', activation=10.0, weight=1.0),
           Cell('b', weight=1.0)]
  cells[0] = profile_lib.CellProfile(
      **{**cells[0].__dict__, 'workspace_bytes': Affine(0.0, 5.0),
         'kept_workspace_bytes': Affine(0.0, 7.0)})
  profile = Profile(cells)
  peaks = {remat: predict.Predict(profile, Shape(2, 2, remat),
                                  [1, 1]).device_peak_bytes[0]
           for remat in ('always', 'except_last', 'never')}
  # 'always': one recomputed call's activations; 'except_last': the last
  # micro-batch's call keeps them (its backward follows its forward on
  # device 0); 'never': both calls keep them.
  assert peaks == {'always': 1 + 20 + 5 * 2, 'except_last': 1 + 20 + 7 * 2,
                   'never': 1 + 40 + 7 * 2}


def testWorkspaceOfTheBackwardRunningAtThePeak():
  # K=2 v=2 M=1 'never', cells a b c d of 1 example. Device 0 runs F0 F2
  # B2 B0; cell a's backward needs a large workspace (50), c's a small one
  # (2). At B2 the device holds both calls' activations (10 + 10), both
  # inputs and c's workspace: 20 + 2 + 6 (inputs 2 + 4) + 1 (gradient of
  # c's output); at B0 only a's input and activations, a's workspace and
  # the gradient of a's output: 2 + 10 + 50 + 3. The peak is B0's; the
  # largest workspace next to all activations (the old model) would be
  # 20 + 50 + 6 + 3.
  def WorkspaceCell(name, workspace, output):
    return profile_lib.CellProfile(**{
        **Cell(name, activation=10.0, output=output).__dict__,
        'workspace_bytes': Affine(workspace, 0.0),
        'kept_workspace_bytes': Affine(workspace, 0.0)})
  cells = [WorkspaceCell('a', 50.0, 3.0), WorkspaceCell('b', 0.0, 4.0),
           WorkspaceCell('c', 2.0, 1.0), WorkspaceCell('d', 0.0, 1.0)]
  profile = profile_lib.Profile(cells=tuple(cells), input_bytes=2.0,
                                batch_size=1)
  c = predict.Predict(profile, Shape(2, 1, 'never', virtual_stages=2),
                      [1, 1, 1, 1])
  assert c.device_peak_bytes[0] == 2 + 10 + 50 + 3
  assert c.peak_device == 0 and c.peak_terms['backward_workspace'] == 50
  assert c.peak_terms['stage_inputs'] == 2


def testSizesThatDoNotFit():
  with pytest.raises(ValueError, match='batch_size=4 does not split'):
    predict.Predict(Profile(TWO_CELLS), Shape(1, 3, 'always'), [2])
  with pytest.raises(ValueError, match='partition'):
    predict.Predict(Profile(TWO_CELLS), Shape(2, 1, 'always'), [2])


# Zero bubble: the backward split into B and W.


def _SplitCells(count=4, stash=1.0):
  """Cells of F = B = W = 1 s a micro-batch of 1 (backward 2 s, W 1 s)."""
  return [profile_lib.CellProfile(
      f'fc{i}', forward_s=Affine(0.0, 1.0), backward_s=Affine(0.0, 2.0),
      update_s=0.0, activation_bytes=4.0, output_bytes=1.0, weight_bytes=0.0,
      gradient_bytes=0.0, slot_bytes=0.0, weight_s=Affine(0.0, 1.0),
      weight_stash_bytes=stash) for i in range(count)]


def testPredictZeroBubbleStepsFromTheWeightPart():
  """2 cells on K = 2, M = 4 micro-batches of 1: the unit-cost steps."""
  profile = Profile(_SplitCells(2), batch_size=4, loss_inside=True)
  steps = {name: predict.Predict(profile, Shape(2, 4, 'never', schedule=name),
                                 [1, 1]).step_terms['pipeline']
           for name in ('1f1b', 'zb1p')}
  assert steps == {'1f1b': 15.0, 'zb1p': 13.0}
  zbv = predict.Predict(Profile(_SplitCells(4), batch_size=4,
                                loss_inside=True),
                        Shape(2, 4, 'never', schedule='zbv',
                              virtual_stages=2), [1, 1, 1, 1])
  assert zbv.step_terms['pipeline'] == 25.0  # 2 cells a device, not 1.
  # The stash held from B to W is a term of the peak: device 1 of zb1p
  # holds one call's input (1 byte), activations (4) and the gradient it
  # receives (1) next to one stash (1), and the merged output (4).
  zb1p = predict.Predict(profile, Shape(2, 4, 'never', schedule='zb1p'),
                         [1, 1])
  assert zb1p.peak_device == 1 and zb1p.device_peak_bytes[1] == 11.0
  assert {t: zb1p.peak_terms[t] for t in (
      'stage_inputs', 'activations', 'output_gradient', 'weight_stash',
      'merged_output')} == {'stage_inputs': 1.0, 'activations': 4.0,
                            'output_gradient': 1.0, 'weight_stash': 1.0,
                            'merged_output': 4.0}
  assert 'weight_stash' not in predict.Predict(
      profile, Shape(2, 4, 'never', schedule='1f1b'), [1, 1]).peak_terms


def testPredictRefusesZeroBubbleWithoutTheWeightPart():
  profile = Profile(TWO_CELLS, loss_inside=True)
  with pytest.raises(ValueError, match=r"schedule='zb1p' splits the "
                     r"backward, but the profile has no weight_s / "
                     r"weight_stash_bytes for cells \['a', 'b'\]"):
    predict.Predict(profile, Shape(2, 2, 'never', schedule='zb1p'), [1, 1])


def testWeightPartsRoundTripAndOldProfilesLoad():
  cell = _SplitCells(1)[0]
  assert profile_lib.CellProfile.FromJson(cell.ToJson()) == cell
  assert cell.ToJson()['weight_s'] == [0.0, 1.0]
  old = cell.ToJson()
  del old['weight_s'], old['weight_stash_bytes']
  loaded = profile_lib.CellProfile.FromJson(old)
  assert loaded.weight_s is None and not loaded.splits_backward
