"""Tests of planning.calibrate: the call overhead from a measured step."""

import dataclasses

import pytest

from lingvo_gpipe.planning import calibrate
from lingvo_gpipe.planning import predict
from lingvo_gpipe.planning import profile as profile_lib
from planning_util import Profile
from planning_util import Shape
from planning_util import TWO_CELLS


def testCallOverheadCalibration():
  profile = Profile(TWO_CELLS, batch_size=8)
  candidate = calibrate.CalibrationCandidate(profile, num_devices=2)
  # The deepest pipeline of 2 devices, 4 micro-batches, no recompute.
  assert (candidate.num_stages, candidate.num_micro_batches,
          candidate.virtual_stages, candidate.remat, candidate.replicas,
          candidate.partition) == (2, 4, 1, 'never', 1, [1, 1])
  # GPipe K=2 M=4 of equal chunks: 5 forward ticks then 5 backward ticks
  # on the critical path, each call c seconds more: the step grows by 5 c.
  measured = candidate.predicted_step_s + 5 * 0.25
  call_s = calibrate.CalibrateCallOverhead(profile, candidate, measured)
  assert call_s == pytest.approx(0.25, abs=1e-8)
  calibrated = dataclasses.replace(profile, call_overhead_s=call_s)
  assert predict.Predict(calibrated, Shape(2, 4, 'never'),
                         [1, 1]).predicted_step_s == pytest.approx(measured)
  # Half to a forward (and its recompute), half to a backward. One chunk of
  # both cells on 8 examples (forward 9, backward 17 per cell): forward,
  # recompute and backward, each with its half.
  one = predict.Predict(calibrated, Shape(1, 1, 'always'), [2])
  assert one.step_terms['pipeline'] == pytest.approx(
      (18 + 0.125) * 2 + 34 + 0.125)
  # A step measured faster than predicted calls for no overhead.
  assert calibrate.CalibrateCallOverhead(
      profile, candidate, candidate.predicted_step_s / 2) == 0.0
  with pytest.raises(ValueError, match='measured_step_s'):
    calibrate.CalibrateCallOverhead(profile, candidate, float('nan'))
  assert profile_lib.Profile.FromJson(calibrated.ToJson()) == calibrated


def testNoCalibrationCandidate():
  profile = Profile(TWO_CELLS, batch_size=8)
  # No pipeline on one device or one cell; M = 1 when the batch is odd.
  assert calibrate.CalibrationCandidate(profile, 1) is None
  assert calibrate.CalibrationCandidate(Profile(TWO_CELLS[:1]), 2) is None
  assert calibrate.CalibrationCandidate(Profile(TWO_CELLS, batch_size=6),
                                        2).num_micro_batches == 3
  assert calibrate.CalibrationCandidate(Profile(TWO_CELLS, batch_size=5),
                                        2).num_micro_batches == 1
