"""Chooses K, M, schedule, virtual stages, remat and partition under a budget.

Pure Python, no TensorFlow. Given a `profile.Profile` of a model, `Search`
lists every configuration of N devices the schedule tables offer: pipeline
depth K (a divisor of N; the other devices are R = N / K data-parallel
replicas), M micro-batches, every schedule of `schedule.SCHEDULES` the model
can run, v virtual stages and every remat mode; `PlanPartition` gives each
its partition (the exact min-max partition, under a memory limit if the
fastest partition does not fit) and `predict.Predict` its step time and
per-device peak; `Search` ranks them (`RankKey`). Six cells whose weights,
gradients and Adam slots (16 MB a cell) do not fit one device of 64 MiB:

    >>> cells = [profile_lib.CellProfile(
    ...     f'fc{i}', forward_s=profile_lib.Affine(1e-3, 1e-4),
    ...     backward_s=profile_lib.Affine(2e-3, 2e-4), update_s=1e-3,
    ...     activation_bytes=4e3, output_bytes=1e3, weight_bytes=4e6,
    ...     gradient_bytes=4e6, slot_bytes=8e6) for i in range(6)]
    >>> model = profile_lib.Profile(cells=tuple(cells), input_bytes=1e3,
    ...                             batch_size=32)
    >>> result = Search(model, num_devices=2, memory_per_device=2**26)
    >>> best = result.candidates[result.chosen]
    >>> best.Describe()
    "K=2 v=3 M=2 R=1 gpipe remat='never' [1, 1, 1, 1, 1, 1]"
    >>> round(best.predicted_step_s, 4), best.fits
    (0.0576, True)

`search_report` turns a `SearchResult` into the text `plan.py auto` prints.
"""

import dataclasses
from typing import List, Optional, Sequence, Tuple

from lingvo_gpipe.planning import checks
from lingvo_gpipe.planning import partition as partition_lib
from lingvo_gpipe.planning import predict
from lingvo_gpipe.planning import profile as profile_lib
from lingvo_gpipe.planning import schedule

Candidate = profile_lib.Candidate


def _CallSeconds(profile: profile_lib.Profile, micro: int,
                 remat: str) -> List[float]:
  """Per cell, the time of one call: forward, backward, recompute."""
  recompute = remat != 'never'
  return [
      c.forward_s(micro) * (2 if recompute else 1) + c.backward_s(micro)
      for c in profile.cells
  ]


def _CellBytes(profile: profile_lib.Profile, micro: int,
               calls_held: int) -> List[float]:
  """Per cell, the bytes a chunk holds for it: additive over a chunk's cells.

  Weights, slots, two copies of its weight gradients and the activations of
  `calls_held` calls.

  Args:
    profile: The model.
    micro: Examples per micro-batch.
    calls_held: Calls whose activations a device holds at its peak.

  Returns:
    Bytes per cell.
  """
  return [
      c.weight_bytes + c.slot_bytes + 2 * c.gradient_bytes +
      calls_held * c.activation_bytes * micro for c in profile.cells
  ]


def PlanPartition(profile: profile_lib.Profile,
                  shape: profile_lib.PipelineShape,
                  *,
                  memory_per_device: Optional[float] = None) -> Candidate:
  """The partition of a configuration, and the configuration predicted.

  First the exact min-max partition of the cells' call times into K v
  chunks (`partition.PartitionCosts`). If its predicted peak exceeds the
  budget, the partitioner runs again with a memory limit per chunk: each
  cell weighs its weights, slots, gradients and the activations of as many
  calls as the fastest partition's peak device holds, and a chunk may weigh
  (budget - that device's stage inputs and work around the pipeline) / v.
  The second partition is kept if it fits, or if neither fits and its peak
  is lower.

  Args:
    profile: The model.
    shape: The configuration.
    memory_per_device: The budget (None: no limit).

  Returns:
    The predicted `Candidate`.

  Raises:
    ValueError: if the sizes do not fit together.
  """
  micro = shape.MicroBatchSize(profile.batch_size)
  costs = _CallSeconds(profile, micro, shape.remat)
  fastest = partition_lib.PartitionCosts(costs, shape.num_chunks)
  best = predict.Predict(profile, shape, fastest,
                         memory_per_device=memory_per_device)
  if best.fits or memory_per_device is None:
    return best
  terms = best.peak_terms
  activation_per_call = sum(
      c.activation_bytes * micro for c in profile.cells) / shape.num_chunks
  calls_held = max(1, round(terms['activations'] /
                            max(activation_per_call, 1e-9)))
  fixed = (terms['stage_inputs'] + terms['outside_pipeline'] +
           terms['merged_output'])
  limit = (memory_per_device - fixed) / shape.virtual_stages
  memory = _CellBytes(profile, micro, calls_held)
  try:
    limited = partition_lib.PartitionCosts(costs, shape.num_chunks, memory,
                                           max(limit, 0.0))
  except ValueError:
    return best
  candidate = predict.Predict(profile, shape, limited,
                              memory_per_device=memory_per_device,
                              partition_rule='memory_limit')
  if candidate.fits or (candidate.predicted_peak_bytes <
                        best.predicted_peak_bytes):
    return candidate
  return best


@dataclasses.dataclass
class SearchResult:
  """What `Search` found.

  Attributes:
    candidates: Every evaluated configuration, ranked: those that fit by
      predicted step time (then peak), then the others by peak.
    chosen: Index of the winner in `candidates` (0), or None if none fits.
    skipped: Reasons why configurations were not evaluated, one line each.
    memory_per_device: The budget.
    num_devices: N.
  """
  candidates: List[Candidate]
  chosen: Optional[int]
  skipped: List[str]
  memory_per_device: float
  num_devices: int


def RankKey(candidate: Candidate) -> Tuple[int, float, float]:
  """Fitting first, by step time then peak; the others by peak."""
  if candidate.fits:
    return (0, candidate.predicted_step_s, candidate.predicted_peak_bytes)
  return (1, candidate.predicted_peak_bytes, candidate.predicted_step_s)


def _UsableSchedules(profile: profile_lib.Profile, names: Sequence[str],
                     skipped: List[str]) -> List[str]:
  """The schedules the model and its profile allow; others to skipped.

  A schedule needs the loss where the model computes it, and one that
  splits the backward (zero bubble) needs the cells' weight-gradient costs
  in the profile (`CellProfile.splits_backward`): the planner assumes none.
  """
  usable = []
  missing = profile.CellsWithoutWeightParts()
  for name in names:
    if schedule.SCHEDULES[name].loss_inside != profile.loss_inside:
      where = 'inside' if schedule.SCHEDULES[name].loss_inside else 'outside'
      has = ('computes the loss' if profile.loss_inside else
             'does not compute the loss')
      skipped.append(f'schedule {name!r}: needs the loss {where} the '
                     f'pipeline; the last cell {has}.')
    elif schedule.SCHEDULES[name].split_backward and missing:
      skipped.append(
          f'schedule {name!r}: splits the backward into input and weight '
          'gradients, but the profile has no weight_s / weight_stash_bytes '
          f'(the weight gradient\'s time and stash) for cells '
          f'{missing[:3]}{" ..." if len(missing) > 3 else ""}; profile the '
          'model again to plan it.')
    else:
      usable.append(name)
  return usable


def Search(profile: profile_lib.Profile,
           *,
           num_devices: int,
           memory_per_device: float,
           schedules: Optional[Sequence[str]] = None,
           remats: Sequence[str] = schedule.REMAT_MODES,
           max_micro_batches: Optional[int] = None,
           max_virtual_stages: Optional[int] = None) -> SearchResult:
  """Evaluates every configuration of N devices; ranks them.

  K runs over the divisors of N up to the number of cells (R = N / K
  replicas, each on B / R examples); M over the divisors of B / R (up to
  `max_micro_batches`); the schedules of `schedule.SCHEDULES` (or
  `schedules`) whose loss placement the model has (`loss_inside`) and, for
  those that split the backward, whose costs the profile has; the sizes each
  schedule runs (`schedule.CheckScheduleSizes`: 'zb1p' v = 1, 'zbv' v = 2,
  interleaved '1f1b' K dividing M); v from 1
  while K v chunks fit the cells (up to `max_virtual_stages`; only v = 1 on
  one device, where chunks change nothing but the number of calls); every
  remat mode; the partition of `PlanPartition`.

  Args:
    profile: The model.
    num_devices: N.
    memory_per_device: The budget in bytes.
    schedules: Schedule names to consider (default: all).
    remats: Remat modes to consider.
    max_micro_batches: Largest M (None: B / R).
    max_virtual_stages: Largest v (None: as many as the cells allow).

  Returns:
    The `SearchResult`.

  Raises:
    ValueError: on a non-positive N or budget, or an unknown schedule or
      remat mode.
  """
  checks.CheckPositiveInt('num_devices', num_devices)
  if not memory_per_device > 0:
    raise ValueError(f'memory_per_device={memory_per_device!r} must be > 0 '
                     '(bytes).')
  names = list(schedule.SCHEDULES) if schedules is None else list(schedules)
  for name in names:
    schedule.CheckSchedule(name)
  for remat in remats:
    schedule.CheckRemat(remat)
  skipped = []
  usable = _UsableSchedules(profile, names, skipped)
  candidates = []
  refused = {}  # Schedule -> (count, first reason) of sizes it cannot run.
  for num_stages in profile_lib.Divisors(num_devices):
    replicas = num_devices // num_stages
    if num_stages > profile.num_cells:
      skipped.append(f'K={num_stages}: more stages than the '
                     f'{profile.num_cells} cells.')
      continue
    if profile.batch_size % replicas:
      skipped.append(f'K={num_stages}: batch {profile.batch_size} does not '
                     f'split into R={replicas} replicas.')
      continue
    replica_batch = profile.batch_size // replicas
    micro_counts = [m for m in profile_lib.Divisors(replica_batch)
                    if max_micro_batches is None or m <= max_micro_batches]
    most_v = profile.num_cells // num_stages
    if num_stages == 1:
      most_v = 1
    if max_virtual_stages is not None:
      most_v = min(most_v, max_virtual_stages)
    for name in usable:
      for virtual in range(1, most_v + 1):
        for num_micro in micro_counts:
          try:
            schedule.CheckScheduleSizes(name, num_stages, num_micro, virtual)
          except ValueError as e:
            count, reason = refused.get(name, (0, str(e)))
            refused[name] = (count + 1, reason)
            continue
          for remat in remats:
            shape = profile_lib.PipelineShape(
                num_stages=num_stages, num_micro_batches=num_micro,
                virtual_stages=virtual, remat=remat, schedule=name,
                replicas=replicas)
            candidates.append(PlanPartition(
                profile, shape, memory_per_device=memory_per_device))
  for name, (count, reason) in refused.items():
    skipped.append(f'schedule {name!r}: {count} (K, v, M) it does not run, '
                   f'e.g. {reason}')
  if num_devices > 1 and profile.num_cells > 1:
    skipped.append('v > 1 with K = 1: one device runs its chunks in turn; '
                   'chunks change only the number of calls.')
  candidates.sort(key=RankKey)
  chosen = 0 if candidates and candidates[0].fits else None
  return SearchResult(candidates, chosen, skipped, memory_per_device,
                      num_devices)
