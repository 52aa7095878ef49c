"""Chooses K, M, schedule, virtual stages, remat and partition under a budget.

Pure Python, no TensorFlow. Given a `Profile` of a model (per cell: forward
and backward time on a micro-batch, the activation bytes its backward keeps,
its output, weight, gradient and optimizer-slot bytes; around the pipeline:
the input and loss), `Search` lists every configuration of N devices the
schedule tables offer: pipeline depth K (a divisor of N; the other devices
are R = N / K data-parallel replicas), M micro-batches, every schedule of
`schedule.SCHEDULES` the model can run, v virtual stages, every remat mode,
and for each the partition of the exact min-max partitioner, under the
memory limit if the fastest partition does not fit. `Predict` gives each
one's step time and per-device peak memory; `Search` ranks them.

    profile = Profile.FromJson(json.load(open('profile.json')))
    result = Search(profile, num_devices=2, memory_per_device=2**30)
    best = result.candidates[result.chosen]
    print(best.num_stages, best.num_micro_batches, best.predicted_step_s)

The model of time: the schedule table simulated (`simulate.Simulate`) with
per-chunk forward and backward times (each cell's time is affine in the
micro-batch size, fitted on two profiled sizes), plus the work around the
pipeline on the replica's batch (input, loss and its gradient), plus the
optimizer update of the slowest device, plus what a real sequential step
costs beyond those parts (the learner's gradient norms and clipping), plus
a cost per chunk call calibrated on one measured pipelined step
(`CalibrateCallOverhead`). The model of memory is the table's
(`simulate.Simulate`: per device, the chunk inputs it holds from forward to
backward, the activations of running and kept calls, weight gradients from a
chunk's first backward, a running backward's workspace), plus per device its
chunks' weights and optimizer slots, plus the work around the pipeline on the
first device (input and loss temporaries) and the merged output on the last,
or, if more, what the learner's update holds (gradients scaled into new
tensors). docs/planning.md says where this is wrong and how far, measured.
"""

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lingvo_gpipe.planning import checks
from lingvo_gpipe.planning import partition as partition_lib
from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate

# The terms of a device's predicted peak, in the order they are reported.
MEMORY_TERMS = ('weights', 'optimizer_slots', 'gradients', 'stage_inputs',
                'activations', 'backward_workspace', 'output_gradient',
                'outside_pipeline', 'merged_output', 'update_copies',
                'replicas')


@dataclasses.dataclass(frozen=True)
class Affine:
  """A cost that grows linearly with the examples: fixed + per_example * n."""
  fixed: float
  per_example: float

  def __call__(self, examples: float) -> float:
    return self.fixed + self.per_example * examples

  @classmethod
  def Fit(cls, sizes: Sequence[float], values: Sequence[float]) -> 'Affine':
    """The line through (smallest size, its value) and (largest, its value).

    With one size, or if the line would give a negative fixed part or slope
    (noise in measured times), the cost is taken as proportional to the
    examples (fixed 0) through the largest size, or as constant (slope 0)
    at the mean value, whichever the data allow.

    Args:
      sizes: Positive example counts, one per value.
      values: Non-negative values measured at those sizes.

    Returns:
      The fitted cost.

    Raises:
      ValueError: on empty or mismatched lists, or a size that is not > 0.
    """
    if not sizes or len(sizes) != len(values):
      raise ValueError(f'sizes={list(sizes)} and values={list(values)} must '
                       'be non-empty and of the same length.')
    if min(sizes) <= 0:
      raise ValueError(f'sizes={list(sizes)} must be positive.')
    pairs = sorted(zip(sizes, values))
    (n0, v0), (n1, v1) = pairs[0], pairs[-1]
    if n1 > n0:
      slope = (v1 - v0) / (n1 - n0)
      fixed = v0 - slope * n0
      if slope >= 0 and fixed >= 0:
        return cls(fixed, slope)
      if slope < 0:
        return cls(sum(values) / len(values), 0.0)
    return cls(0.0, v1 / n1)

  def ToJson(self) -> List[float]:
    return [self.fixed, self.per_example]

  @classmethod
  def FromJson(cls, value: Sequence[float]) -> 'Affine':
    fixed, per_example = value
    return cls(float(fixed), float(per_example))


# The fields of `CellProfile` that are costs of the examples.
_AFFINE_FIELDS = ('forward_s', 'backward_s', 'workspace_bytes',
                  'kept_workspace_bytes')


@dataclasses.dataclass(frozen=True)
class CellProfile:
  """What one cell costs (see `lingvo_gpipe.costs.ProfileCells`).

  Attributes:
    name: The cell's name.
    forward_s: Seconds of its forward pass on n examples.
    backward_s: Seconds of its backward pass (gradients of its weights and
      inputs) on n examples, without a recompute.
    update_s: Seconds of the optimizer update of its variables, once a step.
    activation_bytes: Per example, the bytes its backward keeps from its
      forward (its intermediate tensors and output, not its inputs or
      weights).
    output_bytes: Per example, the bytes of its outputs (the next cell's
      inputs).
    workspace_bytes: Bytes on n examples that its running backward holds
      besides the kept activations and weight gradients (gradients of
      activations, kernels' temporaries) when it runs in one function with
      its forward, as a recomputing call's does: activations go as it
      consumes them. Measured; a fixed part, since some kernels' temporaries
      do not shrink with the micro-batch.
    kept_workspace_bytes: The same for the backward of a call that kept its
      activations, which holds all of them until it ends (it runs as a
      function call of its own): the most its own kernels hold at once.
      Measured; None (profiles written before it was): `workspace_bytes`.
    weight_bytes: Bytes of all its variables.
    gradient_bytes: Bytes of its trainable variables (one gradient each).
    slot_bytes: Bytes of the optimizer's slots for its variables.
  """
  name: str
  forward_s: Affine
  backward_s: Affine
  update_s: float
  activation_bytes: float
  output_bytes: float
  weight_bytes: float
  gradient_bytes: float
  slot_bytes: float
  workspace_bytes: Affine = Affine(0.0, 0.0)
  kept_workspace_bytes: Optional[Affine] = None

  def Workspace(self, keeps: bool) -> Affine:
    """A running backward's workspace (see the attributes).

    Args:
      keeps: Whether the call kept its activations (did not recompute).

    Returns:
      Bytes on n examples.
    """
    if keeps and self.kept_workspace_bytes is not None:
      return self.kept_workspace_bytes
    return self.workspace_bytes

  def ToJson(self) -> Dict[str, Any]:
    result = dataclasses.asdict(self)
    for name in _AFFINE_FIELDS:
      value = getattr(self, name)
      result[name] = None if value is None else value.ToJson()
    return result

  @classmethod
  def FromJson(cls, value: Dict[str, Any]) -> 'CellProfile':
    fields = dict(value)
    for name in _AFFINE_FIELDS:
      if fields.get(name) is None:
        continue
      if isinstance(fields[name], (int, float)):
        # Profiles written before workspaces had a fixed part: per example.
        fields[name] = Affine(0.0, float(fields[name]))
      else:
        fields[name] = Affine.FromJson(fields[name])
    return cls(**fields)


@dataclasses.dataclass(frozen=True)
class Profile:
  """A model as the planner sees it.

  Attributes:
    cells: Per cell, in order.
    input_bytes: Per example, the bytes of the pipeline's input (the first
      cell's inputs).
    batch_size: B, the examples of one step over all replicas.
    loss_inside: Whether the last cell computes the loss (a scalar per
      micro-batch), as schedules with `loss_inside` need.
    outside_s: Seconds, on a replica's batch, of the work around the
      pipeline: the input, the loss and its gradient.
    outside_bytes: Bytes that work allocates at its peak, on a replica's
      batch (on the replica's first device, where Lingvo runs it).
    step_overhead_s: Seconds of a real step beyond its parts (the cells'
      forward and backward, their updates, the work around the pipeline),
      measured on the task's step with the pipeline sequential on one
      micro-batch: the learner's gradient norms, clipping and counters, the
      session call.
    replica_overhead_s: Seconds a data-parallel step (R > 1) takes beyond
      the model of it: the gradients' aggregation across replicas, Lingvo's
      per-replica copies, the replicas' contention for the machine. Measured
      as the real step of K = 1, R = N minus its prediction without it.
    replica_overhead_bytes: Bytes the same data-parallel step holds on a
      device beyond the model of it, measured the same way.
    call_overhead_s: Seconds a call of a chunk (its forward and its
      backward together) takes in a pipeline beyond its cells' profiled
      times: the engine's nodes around the cells and the executor's work
      for every node, which a device cannot hide while the other devices
      keep the machine's cores busy. Half is added to each forward (and
      recompute), half to each backward. Calibrated by `plan.py auto` on one
      measured pipelined step (`CalibrateCallOverhead`).
    model: The model's name (for messages and override lines).
    stack_path: Where its GPipeSequentialLayer is, e.g. 'task.stack'.
    profiled_sizes: The micro-batch sizes the cells were timed on.
    stack_settings: The pipeline params as the model sets them
      (num_stages, num_micro_batches, micro_batch_size, remat, partition,
      ...), to write override lines that Lingvo can parse.
  """
  cells: Tuple[CellProfile, ...]
  input_bytes: float
  batch_size: int
  loss_inside: bool = False
  outside_s: Affine = Affine(0.0, 0.0)
  outside_bytes: Affine = Affine(0.0, 0.0)
  step_overhead_s: float = 0.0
  replica_overhead_s: float = 0.0
  replica_overhead_bytes: float = 0.0
  call_overhead_s: float = 0.0
  model: str = ''
  stack_path: str = 'task.stack'
  profiled_sizes: Tuple[int, ...] = ()
  stack_settings: Dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def num_cells(self) -> int:
    return len(self.cells)

  def ToJson(self) -> Dict[str, Any]:
    return {
        'cells': [c.ToJson() for c in self.cells],
        'input_bytes': self.input_bytes,
        'batch_size': self.batch_size,
        'loss_inside': self.loss_inside,
        'outside_s': self.outside_s.ToJson(),
        'outside_bytes': self.outside_bytes.ToJson(),
        'step_overhead_s': self.step_overhead_s,
        'replica_overhead_s': self.replica_overhead_s,
        'replica_overhead_bytes': self.replica_overhead_bytes,
        'call_overhead_s': self.call_overhead_s,
        'model': self.model,
        'stack_path': self.stack_path,
        'profiled_sizes': list(self.profiled_sizes),
        'stack_settings': dict(self.stack_settings),
    }

  @classmethod
  def FromJson(cls, value: Dict[str, Any]) -> 'Profile':
    return cls(
        cells=tuple(CellProfile.FromJson(c) for c in value['cells']),
        input_bytes=float(value['input_bytes']),
        batch_size=int(value['batch_size']),
        loss_inside=bool(value.get('loss_inside', False)),
        outside_s=Affine.FromJson(value.get('outside_s', [0.0, 0.0])),
        outside_bytes=Affine.FromJson(value.get('outside_bytes', [0.0, 0.0])),
        step_overhead_s=float(value.get('step_overhead_s', 0.0)),
        replica_overhead_s=float(value.get('replica_overhead_s', 0.0)),
        replica_overhead_bytes=float(
            value.get('replica_overhead_bytes', 0.0)),
        call_overhead_s=float(value.get('call_overhead_s', 0.0)),
        model=value.get('model', ''),
        stack_path=value.get('stack_path', 'task.stack'),
        profiled_sizes=tuple(value.get('profiled_sizes', ())),
        stack_settings=dict(value.get('stack_settings', {})))


@dataclasses.dataclass
class Candidate:
  """One configuration and what the planner predicts for it.

  Attributes:
    num_stages: K, devices of one pipeline.
    num_micro_batches: M.
    schedule: A key of `schedule.SCHEDULES`.
    virtual_stages: v, chunks per device.
    remat: One of `schedule.REMAT_MODES`.
    partition: Cells per chunk (K v counts).
    replicas: R = N / K data-parallel pipelines.
    engine: The engine GPipeSequentialLayer's engine='auto' builds.
    predicted_step_s: Seconds of one training step.
    predicted_peak_bytes: The largest predicted peak over the devices.
    fits: Whether predicted_peak_bytes <= the memory per device.
    device_peak_bytes: Predicted peak of each device of one pipeline.
    peak_device: The device with the largest peak.
    peak_terms: {term of `MEMORY_TERMS`: bytes} of the peak device's peak.
    step_terms: {'pipeline', 'outside_pipeline', 'update', 'overhead':
      seconds}.
    partition_rule: 'fastest' (the min-max partition) or 'memory_limit'
      (the min-max partition under a per-chunk memory limit).
    bubble_fraction: The simulated idle share of the pipeline.
    measured_step_s: Measured step seconds, the fastest of the verified
      steps (after verification).
    measured_peak_bytes: Measured largest per-device peak (after
      verification).
    measured_device_peak_bytes: Measured peak of each device.
    measured_median_step_s: The median of the verified steps.
  """
  num_stages: int
  num_micro_batches: int
  schedule: str
  virtual_stages: int
  remat: str
  partition: List[int]
  replicas: int
  engine: str
  predicted_step_s: float
  predicted_peak_bytes: float
  fits: bool
  device_peak_bytes: List[float]
  peak_device: int
  peak_terms: Dict[str, float]
  step_terms: Dict[str, float]
  partition_rule: str = 'fastest'
  bubble_fraction: float = 0.0
  measured_step_s: Optional[float] = None
  measured_peak_bytes: Optional[float] = None
  measured_device_peak_bytes: Optional[List[float]] = None
  measured_median_step_s: Optional[float] = None

  def Describe(self) -> str:
    """E.g. "K=2 v=1 M=4 R=1 gpipe remat='never' [3, 3]"."""
    return (f'K={self.num_stages} v={self.virtual_stages} '
            f'M={self.num_micro_batches} R={self.replicas} {self.schedule} '
            f'remat={self.remat!r} {self.partition}')

  def ToJson(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


def MicroBatchSize(batch_size: int, replicas: int,
                   num_micro_batches: int) -> int:
  """Examples per micro-batch: B / (R M); ValueError unless it divides."""
  if batch_size % (replicas * num_micro_batches):
    raise ValueError(
        f'batch_size={batch_size} does not split into replicas={replicas} x '
        f'num_micro_batches={num_micro_batches}; use a divisor of '
        f'{batch_size // math.gcd(batch_size, replicas)} for M.')
  return batch_size // (replicas * num_micro_batches)


CALIBRATION_MICRO_BATCHES = 4


def CalibrationCandidate(profile: Profile,
                         num_devices: int) -> Optional[Candidate]:
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
  num_stages = max(k for k in _Divisors(num_devices) if k <= profile.num_cells)
  if num_stages == 1:
    return None
  replicas = num_devices // num_stages
  if profile.batch_size % replicas:
    return None
  replica_batch = profile.batch_size // replicas
  num_micro = next((m for m in range(CALIBRATION_MICRO_BATCHES, 1, -1)
                    if replica_batch % m == 0), 1)
  return PlanPartition(profile, num_stages, num_micro, 'never', replicas,
                       'gpipe', 1, None)


def CalibrateCallOverhead(profile: Profile, candidate: Candidate,
                          measured_step_s: float) -> float:
  """The call overhead that makes `candidate`'s predicted step the measured one.

  `Predict`'s step grows with `profile.call_overhead_s`; this finds the
  value (by bisection, to a nanosecond) at which it equals
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

  def Step(call_s: float) -> float:
    return Predict(
        dataclasses.replace(profile, call_overhead_s=call_s),
        candidate.num_stages, candidate.num_micro_batches, candidate.remat,
        candidate.partition, candidate.replicas, candidate.schedule,
        candidate.virtual_stages).predicted_step_s

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


def _ChunkSums(values: Sequence[float], counts: Sequence[int]) -> List[float]:
  sums, start = [], 0
  for count in counts:
    sums.append(sum(values[start:start + count]))
    start += count
  return sums


def Predict(profile: Profile,
            num_stages: int,
            num_micro_batches: int,
            remat: str,
            partition: Sequence[int],
            replicas: int = 1,
            schedule_name: str = 'gpipe',
            virtual_stages: int = 1,
            memory_per_device: Optional[float] = None,
            partition_rule: str = 'fastest') -> Candidate:
  """The predicted step time and per-device peak of one configuration.

  Time: `simulate.Simulate` of the schedule table as dataflow (in the
  graph mode of Lingvo's trainer the loop engine runs one loop per device:
  neither engine runs ticks in lockstep) with per-chunk forward and backward
  times on the micro-batch (its cells' times plus half of
  `profile.call_overhead_s` each), plus `profile.outside_s` on the
  replica's batch, plus the largest per-device sum of its cells' update
  times, plus `profile.step_overhead_s`, plus `profile.replica_overhead_s`
  if R > 1.

  Memory, per device k of one pipeline: its chunks' weights, optimizer slots
  and (from their first backward) weight gradients; the table's stage inputs
  and activations (`simulate.Simulate` with byte sizes: the input of chunk c
  is the output of chunk c - 1, or the pipeline's input for c = 0); the
  workspace of the backward running at the device's worst tick (the largest of
  its chunk's cells', in the form for a call that kept its activations where
  the chunk has one) and the gradient of its outputs that it receives; on the
  first device, `profile.outside_bytes` (input and loss temporaries); on the
  device of the last chunk, the merged output of the replica's batch. After
  the pipeline the learner scales every weight gradient into a new tensor
  (Lingvo's gradient norm clipping needs all of them first): the device then
  holds its weights, slots, gradients and the largest of its cells' gradients
  once more; where that exceeds the pipeline's peak, the difference is the
  term 'update_copies'. With R > 1, every device adds
  `profile.replica_overhead_bytes` (the term 'replicas').

  Args:
    profile: The model.
    num_stages: K.
    num_micro_batches: M.
    remat: One of `schedule.REMAT_MODES`.
    partition: Cells per chunk, K v counts.
    replicas: R.
    schedule_name: A key of `schedule.SCHEDULES`.
    virtual_stages: v.
    memory_per_device: The budget that `fits` compares with; None: fits.
    partition_rule: Recorded in the candidate.

  Returns:
    The `Candidate`.

  Raises:
    ValueError: if the sizes do not fit together (batch, cells, chunks).
  """
  checks.CheckPositiveInt('num_stages', num_stages)
  checks.CheckPositiveInt('replicas', replicas)
  counts = partition_lib.CheckPartition(partition, profile.num_cells,
                                        num_stages * virtual_stages)
  micro = MicroBatchSize(profile.batch_size, replicas, num_micro_batches)
  replica_batch = micro * num_micro_batches
  table = schedule.BuildTable(schedule_name, num_stages, num_micro_batches,
                              virtual_stages)
  engine = schedule.ChooseEngine('auto', num_stages, num_micro_batches, remat,
                                 schedule=schedule_name,
                                 virtual_stages=virtual_stages)
  cells = profile.cells
  half_call = profile.call_overhead_s / 2
  forward = [t + half_call for t in _ChunkSums(
      [c.forward_s(micro) for c in cells], counts)]
  backward = [t + half_call for t in _ChunkSums(
      [c.backward_s(micro) for c in cells], counts)]
  activations = _ChunkSums([c.activation_bytes * micro for c in cells],
                           counts)
  gradients = _ChunkSums([c.gradient_bytes for c in cells], counts)
  weights = _ChunkSums([c.weight_bytes for c in cells], counts)
  slots = _ChunkSums([c.slot_bytes for c in cells], counts)
  updates = _ChunkSums([c.update_s for c in cells], counts)
  ends = [sum(counts[:c + 1]) for c in range(len(counts))]
  inputs = [profile.input_bytes * micro] + [
      cells[end - 1].output_bytes * micro for end in ends[:-1]]
  # A running backward holds the workspace of one of its cells (the
  # largest; as a backward of a call that kept its activations if the chunk
  # has one) and the gradient of its outputs, which it receives.
  recomputes = schedule.RecomputedCalls(table, remat)
  keeps = [not all(recomputes[c, m] for m in range(table.num_micro_batches))
           for c in range(table.num_chunks)]
  workspace = [
      max(c.Workspace(keeps[chunk])(micro)
          for c in cells[end - count:end])
      for chunk, (end, count) in enumerate(zip(ends, counts))
  ]
  output_gradients = [cells[end - 1].output_bytes * micro for end in ends]
  sim = simulate.Simulate(
      table, forward, backward, remat,
      input_memory=inputs, activation_memory=activations,
      gradient_memory=gradients,
      backward_memory=[w + g for w, g in zip(workspace, output_gradients)])
  merged_output = cells[-1].output_bytes * replica_batch
  last_device = table.Device(table.num_chunks - 1)
  device_peaks, device_terms = [], []
  for k in range(num_stages):
    own = range(k, table.num_chunks, num_stages)
    # The table's peak: inputs, gradients, the running backward's transient
    # bytes and, the rest, activations.
    running = sim.peak_backward_chunk[k]
    running_workspace, received = ((0.0, 0.0) if running is None else
                                   (workspace[running],
                                    output_gradients[running]))
    terms = {
        'weights': sum(weights[c] for c in own),
        'optimizer_slots': sum(slots[c] for c in own),
        'gradients': sim.peak_gradients[k],
        'stage_inputs': sim.peak_input_memory[k],
        'activations': (sim.peak_memory[k] - sim.peak_gradients[k] -
                        sim.peak_input_memory[k] - running_workspace -
                        received),
        'backward_workspace': running_workspace,
        'output_gradient': received,
        'outside_pipeline': (profile.outside_bytes(replica_batch)
                             if k == 0 else 0.0),
        'merged_output': merged_output if k == last_device else 0.0,
    }
    own_cells = [cell for c in own
                 for cell in cells[ends[c] - counts[c]:ends[c]]]
    update_peak = (terms['weights'] + terms['optimizer_slots'] +
                   sum(gradients[c] for c in own) +
                   max([cell.gradient_bytes for cell in own_cells],
                       default=0.0))
    terms['update_copies'] = max(update_peak - sum(terms.values()), 0.0)
    terms['replicas'] = (profile.replica_overhead_bytes if replicas > 1 else
                         0.0)
    device_terms.append(terms)
    device_peaks.append(sum(terms.values()))
  peak_device = max(range(num_stages), key=lambda k: device_peaks[k])
  outside = profile.outside_s(replica_batch)
  update = max(sum(updates[c] for c in range(k, table.num_chunks,
                                               num_stages))
               for k in range(num_stages))
  replica_s = profile.replica_overhead_s if replicas > 1 else 0.0
  step = (sim.step_time + outside + update + profile.step_overhead_s +
          replica_s)
  peak = device_peaks[peak_device]
  return Candidate(
      num_stages=num_stages,
      num_micro_batches=num_micro_batches,
      schedule=schedule_name,
      virtual_stages=virtual_stages,
      remat=remat,
      partition=counts,
      replicas=replicas,
      engine=engine,
      predicted_step_s=step,
      predicted_peak_bytes=peak,
      fits=memory_per_device is None or peak <= memory_per_device,
      device_peak_bytes=device_peaks,
      peak_device=peak_device,
      peak_terms=device_terms[peak_device],
      step_terms={'pipeline': sim.step_time, 'outside_pipeline': outside,
                  'update': update, 'overhead': profile.step_overhead_s,
                  'replicas': replica_s},
      partition_rule=partition_rule,
      bubble_fraction=sim.bubble_fraction)


def ProfileSizes(batch_size: int,
                 num_devices: int) -> Tuple[List[int], List[int]]:
  """Micro-batch sizes to profile the cells on, and replica batch sizes.

  The cells are timed on the largest micro-batch a configuration can have
  (B / R with the fewest replicas R = N / K) and an eighth of it, which
  brackets most candidates' micro-batches; the work around the pipeline on
  every replica batch B / R.

  Args:
    batch_size: B.
    num_devices: N.

  Returns:
    (micro-batch sizes, replica batch sizes), each sorted.

  Raises:
    ValueError: if B splits into the replicas of no K dividing N.
  """
  checks.CheckPositiveInt('batch_size', batch_size)
  checks.CheckPositiveInt('num_devices', num_devices)
  replica = sorted({batch_size // (num_devices // k)
                    for k in _Divisors(num_devices)
                    if batch_size % (num_devices // k) == 0})
  if not replica:
    raise ValueError(f'batch_size={batch_size} does not split into the '
                     f'replicas of any K dividing num_devices={num_devices}.')
  largest = replica[-1]
  return sorted({max(1, largest // 8), largest}), replica


def _Divisors(n: int) -> List[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _CellCosts(profile: Profile, micro: int, remat: str) -> List[float]:
  """Per cell, the time of one call: forward, backward, recompute."""
  recompute = remat != 'never'
  return [
      c.forward_s(micro) * (2 if recompute else 1) + c.backward_s(micro)
      for c in profile.cells
  ]


def _CellMemory(profile: Profile, micro: int, calls_held: int) -> List[float]:
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


def PlanPartition(profile: Profile, num_stages: int, num_micro_batches: int,
                  remat: str, replicas: int, schedule_name: str,
                  virtual_stages: int,
                  memory_per_device: Optional[float]) -> Candidate:
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
    num_stages: K.
    num_micro_batches: M.
    remat: The remat mode.
    replicas: R.
    schedule_name: The schedule.
    virtual_stages: v.
    memory_per_device: The budget (None: no limit).

  Returns:
    The predicted `Candidate`.

  Raises:
    ValueError: if the sizes do not fit together.
  """
  micro = MicroBatchSize(profile.batch_size, replicas, num_micro_batches)
  num_chunks = num_stages * virtual_stages
  costs = _CellCosts(profile, micro, remat)
  fastest = partition_lib.PartitionCosts(costs, num_chunks)
  best = Predict(profile, num_stages, num_micro_batches, remat, fastest,
                 replicas, schedule_name, virtual_stages, memory_per_device)
  if best.fits or memory_per_device is None:
    return best
  terms = best.peak_terms
  activation_per_call = sum(
      c.activation_bytes * micro for c in profile.cells) / num_chunks
  calls_held = max(1, round(terms['activations'] /
                            max(activation_per_call, 1e-9)))
  fixed = (terms['stage_inputs'] + terms['outside_pipeline'] +
           terms['merged_output'])
  limit = (memory_per_device - fixed) / virtual_stages
  memory = _CellMemory(profile, micro, calls_held)
  try:
    limited = partition_lib.PartitionCosts(costs, num_chunks, memory,
                                           max(limit, 0.0))
  except ValueError:
    return best
  candidate = Predict(profile, num_stages, num_micro_batches, remat, limited,
                      replicas, schedule_name, virtual_stages,
                      memory_per_device, 'memory_limit')
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


def Search(profile: Profile,
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
  `schedules`) whose loss placement the model has (`loss_inside`); v from 1
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
  usable = []
  for name in names:
    if schedule.SCHEDULES[name].loss_inside != profile.loss_inside:
      where = 'inside' if schedule.SCHEDULES[name].loss_inside else 'outside'
      has = ('computes the loss' if profile.loss_inside else
             'does not compute the loss')
      skipped.append(f'schedule {name!r}: needs the loss {where} the '
                     f'pipeline; the last cell {has}.')
    else:
      usable.append(name)
  candidates = []
  for num_stages in _Divisors(num_devices):
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
    micro_counts = [m for m in _Divisors(replica_batch)
                    if max_micro_batches is None or m <= max_micro_batches]
    most_v = profile.num_cells // num_stages
    if num_stages == 1:
      most_v = 1
    if max_virtual_stages is not None:
      most_v = min(most_v, max_virtual_stages)
    for name in usable:
      for virtual in range(1, most_v + 1):
        for num_micro in micro_counts:
          for remat in remats:
            candidates.append(PlanPartition(
                profile, num_stages, num_micro, remat, replicas, name,
                virtual, memory_per_device))
  if num_devices > 1 and profile.num_cells > 1:
    skipped.append('v > 1 with K = 1: one device runs its chunks in turn; '
                   'chunks change only the number of calls.')
  candidates.sort(key=RankKey)
  chosen = 0 if candidates and candidates[0].fits else None
  return SearchResult(candidates, chosen, skipped, memory_per_device,
                      num_devices)


def FormatBytes(size: float) -> str:
  """1536 -> '1.5 KiB'."""
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if abs(size) < 1024 or unit == 'GiB':
      return f'{size:.1f} {unit}' if unit != 'B' else f'{size:.0f} B'
    size /= 1024
  return f'{size:.1f} GiB'


def DominantTerm(candidate: Candidate) -> Tuple[str, float]:
  """The largest term of the candidate's peak, and its bytes."""
  name = max(candidate.peak_terms, key=lambda t: candidate.peak_terms[t])
  return name, candidate.peak_terms[name]


def Reason(result: SearchResult) -> str:
  """Why the winner won, in a sentence or two."""
  if result.chosen is None:
    return NothingFits(result)
  best = result.candidates[result.chosen]
  fitting = [c for c in result.candidates if c.fits]
  text = (f'{best.Describe()}: the fastest predicted step '
          f'({best.predicted_step_s * 1e3:.1f} ms) of the {len(fitting)} of '
          f'{len(result.candidates)} configurations that fit '
          f'{FormatBytes(result.memory_per_device)} per device; bubble '
          f'{best.bubble_fraction:.2f}, peak '
          f'{FormatBytes(best.predicted_peak_bytes)} '
          f'({best.predicted_peak_bytes / result.memory_per_device:.0%} of '
          f'the budget) on device {best.peak_device}')
  term, size = DominantTerm(best)
  text += f', mostly {term} ({FormatBytes(size)}).'
  if len(fitting) > 1:
    second = fitting[1]
    text += (f' Next: {second.Describe()} at '
             f'{second.predicted_step_s * 1e3:.1f} ms '
             f'(+{second.predicted_step_s / best.predicted_step_s - 1:.1%}).')
  faster = [c for c in result.candidates if not c.fits and
            c.predicted_step_s < best.predicted_step_s]
  if faster:
    quickest = min(faster, key=lambda c: c.predicted_step_s)
    text += (f' Faster but over budget: {quickest.Describe()} at '
             f'{quickest.predicted_step_s * 1e3:.1f} ms, peak '
             f'{FormatBytes(quickest.predicted_peak_bytes)}.')
  return text


def NothingFits(result: SearchResult, budget: Optional[str] = None) -> str:
  """The message when no configuration fits: the smallest peak and its term.

  Args:
    result: The search.
    budget: How to name the budget searched with (default:
      'memory_per_device=<bytes> (<size>)').

  Returns:
    The message.
  """
  if not result.candidates:
    return 'no configuration could be evaluated: ' + ' '.join(result.skipped)
  smallest = min(result.candidates, key=lambda c: c.predicted_peak_bytes)
  term, size = DominantTerm(smallest)
  if budget is None:
    budget = (f'memory_per_device={result.memory_per_device:.0f} '
              f'({FormatBytes(result.memory_per_device)})')
  return (f'nothing fits {budget}: the smallest predicted '
          f'peak is {smallest.predicted_peak_bytes:.0f} bytes '
          f'({FormatBytes(smallest.predicted_peak_bytes)}, '
          f'{smallest.Describe()}, device {smallest.peak_device}), dominated '
          f'by {term}: {FormatBytes(size)} '
          f'({size / smallest.predicted_peak_bytes:.0%}). Give more memory '
          f'per device, more devices or a smaller batch.')


def OverrideLines(profile: Profile, candidate: Candidate) -> List[str]:
  """The `--model_params_override` lines that select a candidate.

  num_stages and micro_batch_size are set only where the model sets them
  (Lingvo's text format cannot turn a None into an int); the partition
  (K v counts) gives K anyway, and M micro-batches of B / (R M) examples
  agree with either. input.batch_size is the batch of one replica (Lingvo's
  is per model split).

  Args:
    profile: The model.
    candidate: The configuration.

  Returns:
    'key: value' lines.
  """
  path = profile.stack_path
  settings = profile.stack_settings
  lines = []
  if settings.get('num_stages') is not None:
    lines.append(f'{path}.num_stages: {candidate.num_stages}')
  lines += [
      f'{path}.virtual_stages: {candidate.virtual_stages}',
      f'{path}.num_micro_batches: {candidate.num_micro_batches}',
  ]
  if settings.get('micro_batch_size') is not None:
    micro = MicroBatchSize(profile.batch_size, candidate.replicas,
                           candidate.num_micro_batches)
    lines.append(f'{path}.micro_batch_size: {micro}')
  lines += [
      f'{path}.schedule: {candidate.schedule}',
      f'{path}.remat: {candidate.remat}',
      f'{path}.partition: {candidate.partition}',
      f'input.batch_size: {profile.batch_size // candidate.replicas}',
  ]
  return lines


def FormatTable(result: SearchResult, top: Optional[int] = None) -> str:
  """The ranked candidates as a fixed-width table.

  Args:
    result: From `Search`.
    top: Rows to show (None: all); a last line says how many were left out.

  Returns:
    The table.
  """
  header = (f'{"rank":>4}  {"K":>2} {"v":>2} {"M":>3} {"R":>2}  '
            f'{"schedule":<8} {"remat":<11} {"engine":<8} '
            f'{"step ms":>9} {"peak":>11}  {"fits":<4}  partition')
  lines = [header, '-' * len(header)]
  rows = result.candidates if top is None else result.candidates[:top]
  for i, c in enumerate(rows):
    lines.append(
        f'{i:>4}  {c.num_stages:>2} {c.virtual_stages:>2} '
        f'{c.num_micro_batches:>3} {c.replicas:>2}  {c.schedule:<8} '
        f'{c.remat:<11} {c.engine:<8} {c.predicted_step_s * 1e3:>9.2f} '
        f'{FormatBytes(c.predicted_peak_bytes):>11}  '
        f'{"yes" if c.fits else "no":<4}  {c.partition}'
        f'{" (memory limit)" if c.partition_rule == "memory_limit" else ""}')
  if len(rows) < len(result.candidates):
    lines.append(f'({len(result.candidates) - len(rows)} more; --json_out '
                 'lists every candidate)')
  return '\n'.join(lines)
