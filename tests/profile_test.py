"""Tests of planning.profile: the planner's data model and its JSON."""

import json

import pytest

from lingvo_gpipe.planning import predict
from lingvo_gpipe.planning import profile as profile_lib
from planning_util import Affine
from planning_util import Cell
from planning_util import Profile
from planning_util import Shape
from planning_util import TWO_CELLS


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


def testProfileJson():
  profile = Profile(TWO_CELLS, outside_s=Affine(1.0, 2.0),
                    replica_overhead_s=0.3, replica_overhead_bytes=1000.0,
                    call_overhead_s=0.25)
  assert profile_lib.Profile.FromJson(
      json.loads(json.dumps(profile.ToJson()))) == profile


def testCellProfileJsonOfOlderProfiles():
  cell = profile_lib.CellProfile(
      **{**Cell('a', activation=10.0, weight=1.0).__dict__,
         'workspace_bytes': Affine(0.0, 5.0),
         'kept_workspace_bytes': Affine(0.0, 7.0)})
  assert profile_lib.CellProfile.FromJson(cell.ToJson()) == cell
  # Profiles written before the kept workspace was measured (and when the
  # one workspace they have was bytes per example) fall back to it.
  old = dict(cell.ToJson(), workspace_bytes=5.0)
  del old['kept_workspace_bytes']
  fallback = profile_lib.CellProfile.FromJson(old)
  assert fallback.kept_workspace_bytes is None
  assert fallback.Workspace(keeps=True) == Affine(0.0, 5.0)
  assert fallback.Workspace(keeps=False) == Affine(0.0, 5.0)


def testPipelineShape():
  shape = Shape(2, 4, 'never', virtual_stages=2, replicas=2)
  assert shape.num_chunks == 4 and shape.schedule == 'gpipe'
  assert shape.MicroBatchSize(16) == 2
  with pytest.raises(ValueError, match='batch_size=12 does not split into '
                     'replicas=2 x num_micro_batches=4; use a divisor of 6'):
    shape.MicroBatchSize(12)
  with pytest.raises(ValueError, match='num_micro_batches'):
    Shape(2, 0, 'never')
  with pytest.raises(ValueError, match="remat='sometimes'"):
    Shape(2, 1, 'sometimes')
  with pytest.raises(ValueError, match="schedule='nope'"):
    Shape(2, 1, 'never', schedule='nope')
  with pytest.raises(TypeError):
    profile_lib.PipelineShape(2, 4)  # Keywords only: K, M, v never swap.


def testCandidateJson():
  candidate = predict.Predict(Profile(TWO_CELLS), Shape(2, 2, 'always'),
                              [1, 1])
  row = json.loads(json.dumps(candidate.ToJson()))
  # The row is the candidate's fields: it builds the same candidate again.
  assert profile_lib.Candidate(**row) == candidate
  # Micro-batches of 2 examples: forward 1 + 2 = 3 s, backward with its
  # recompute 3 + (1 + 2 * 2) = 8 s; GPipe runs (M + K - 1) = 3 ticks of each.
  assert row['predicted_step_s'] == 3 * (3 + 8) == row['step_terms'][
      'pipeline']
  assert row['bubble_fraction'] == pytest.approx(1 / 3)  # (K-1)/(M+K-1).
  # No activations, inputs or slots: each device holds its cell's weights.
  assert row['device_peak_bytes'] == [100.0, 100.0]
  assert row['predicted_peak_bytes'] == 100.0 and row['fits']
  assert row['peak_terms']['weights'] == 100.0
  assert sum(row['peak_terms'].values()) == 100.0
  assert {key: row[key] for key in (
      'num_stages', 'num_micro_batches', 'schedule', 'virtual_stages',
      'remat', 'partition', 'replicas', 'engine', 'peak_device',
      'partition_rule')} == dict(
          num_stages=2, num_micro_batches=2, schedule='gpipe',
          virtual_stages=1, remat='always', partition=[1, 1], replicas=1,
          engine='unrolled', peak_device=0, partition_rule='fastest')
  assert all(row[key] is None for key in (
      'measured_step_s', 'measured_peak_bytes', 'measured_device_peak_bytes',
      'measured_median_step_s'))
  assert candidate.Describe() == "K=2 v=1 M=2 R=1 gpipe remat='always' [1, 1]"


def testProfileSizes():
  assert profile_lib.ProfileSizes(32, 2) == ([4, 32], [16, 32])
  assert profile_lib.ProfileSizes(8, 4) == ([1, 8], [2, 4, 8])
  with pytest.raises(ValueError, match='num_devices'):
    profile_lib.ProfileSizes(8, 0)
