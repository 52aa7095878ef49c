"""Calibrates the cost of a chunk call on one measured pipelined step.

Pure Python, no TensorFlow. Profiled cells do not see what a pipeline adds
around each call (the engine's nodes, the executor's work for every node);
`plan.py auto` measures the step of `CalibrationCandidate` and sets
`Profile.call_overhead_s` to what makes `predict.Predict` agree with it.
Six cells predicted to step in 84 ms on two devices, measured at 94 ms (the
fastest of a few real training steps of `candidate`):

    >>> fc = profile_lib.CellProfile(
    ...     'fc', forward_s=profile_lib.Affine(1e-3, 1e-4),
    ...     backward_s=profile_lib.Affine(2e-3, 2e-4), update_s=1e-3,
    ...     activation_bytes=4e3, output_bytes=1e3, weight_bytes=4e6,
    ...     gradient_bytes=4e6, slot_bytes=8e6)
    >>> profile = profile_lib.Profile(cells=(fc,) * 6, input_bytes=1e3,
    ...                               batch_size=32)
    >>> candidate = CalibrationCandidate(profile, num_devices=2)
    >>> candidate.Describe(), round(candidate.predicted_step_s, 4)
    ("K=2 v=1 M=4 R=1 gpipe remat='never' [3, 3]", 0.084)
    >>> call_s = CalibrateCallOverhead(profile, candidate, 0.094)
    >>> round(call_s, 6)  # Per call of a chunk: 2 ms.
    0.002
    >>> profile = dataclasses.replace(profile, call_overhead_s=call_s)
"""

import dataclasses
import math
from typing import Optional

from lingvo_gpipe.planning import checks
from lingvo_gpipe.planning import predict
from lingvo_gpipe.planning import profile as profile_lib
from lingvo_gpipe.planning import search

# The most micro-batches of the calibrated step (several calls per device).
CALIBRATION_MICRO_BATCHES = 4


def CalibrationCandidate(profile: profile_lib.Profile,
                         num_devices: int) -> Optional[profile_lib.Candidate]:
  """The pipelined step to measure for `CalibrateCallOverhead`, or None.

  The deepest pipeline N devices run (K the largest divisor of N up to the
  number of cells; R = N / K), v = 1, GPipe, remat 'never', the fastest
  partition, and M the largest of CALIBRATION_MICRO_BATCHES, ..., 2 that
  divides the replica's batch (else 1): several calls per device, as most
  candidates have. None if K would be 1 (no pipeline to calibrate on) or
  the batch does not split into the R replicas.

  Args:
    profile: The model.
    num_devices: N.

  Returns:
    The predicted candidate, or None.
  """
  checks.CheckPositiveInt('num_devices', num_devices)
  num_stages = max(k for k in profile_lib.Divisors(num_devices)
                   if k <= profile.num_cells)
  if num_stages == 1:
    return None
  replicas = num_devices // num_stages
  if profile.batch_size % replicas:
    return None
  replica_batch = profile.batch_size // replicas
  num_micro = next((m for m in range(CALIBRATION_MICRO_BATCHES, 1, -1)
                    if replica_batch % m == 0), 1)
  shape = profile_lib.PipelineShape(
      num_stages=num_stages, num_micro_batches=num_micro, remat='never',
      schedule='gpipe', replicas=replicas)
  return search.PlanPartition(profile, shape)


def CalibrateCallOverhead(profile: profile_lib.Profile,
                          candidate: profile_lib.Candidate,
                          measured_step_s: float) -> float:
  """The call overhead that makes `candidate`'s predicted step the measured one.

  `predict.Predict`'s step grows with `profile.call_overhead_s`; this finds
  the value (by bisection, to a nanosecond) at which it equals
  `measured_step_s`, or 0 if the prediction without it is already as long.

  Args:
    profile: The model (its call_overhead_s is ignored).
    candidate: A predicted pipeline (K > 1) whose step was measured.
    measured_step_s: Its measured step, in seconds.

  Returns:
    Seconds per chunk call (forward and backward).

  Raises:
    ValueError: if measured_step_s is not a finite number > 0.
  """
  if (isinstance(measured_step_s, bool) or
      not isinstance(measured_step_s, (int, float)) or
      not math.isfinite(measured_step_s) or measured_step_s <= 0):
    raise ValueError(f'measured_step_s={measured_step_s!r} must be a finite '
                     'number of seconds > 0.')
  shape = candidate.shape

  def Step(call_s: float) -> float:
    return predict.Predict(
        dataclasses.replace(profile, call_overhead_s=call_s), shape,
        candidate.partition).predicted_step_s

  low, high = 0.0, measured_step_s
  if Step(low) >= measured_step_s:
    return 0.0
  while high - low > 1e-9:
    middle = (low + high) / 2
    if Step(middle) < measured_step_s:
      low = middle
    else:
      high = middle
  return (low + high) / 2
