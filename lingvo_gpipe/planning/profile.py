"""What the planner knows of a model, what it predicts, and their JSON.

Pure Python, no TensorFlow. A `Profile` is a model as `plan.py auto` sees
it: per cell (`CellProfile`) its forward and backward time on a micro-batch
(`Affine` in the examples), the activation bytes its backward keeps, its
output, weight, gradient and optimizer-slot bytes; around the pipeline the
input, the loss and what a real step costs beyond its parts. A
`PipelineShape` is one configuration of N devices without its partition,
and a `Candidate` is a configuration with its partition and what the cost
model (`predict.Predict`) says of it. All of them write and read the JSON
that `plan.py auto --profile_out / --profile_in / --json_out` uses. Six
cells of 1 ms + 0.1 ms per example forward, twice that backward:

    >>> cell = {'name': 'fc', 'forward_s': [1e-3, 1e-4],
    ...         'backward_s': [2e-3, 2e-4], 'update_s': 1e-3,
    ...         'activation_bytes': 4e3, 'output_bytes': 1e3,
    ...         'weight_bytes': 4e6, 'gradient_bytes': 4e6, 'slot_bytes': 8e6}
    >>> profile = Profile.FromJson({'cells': [cell] * 6, 'input_bytes': 1e3,
    ...                             'batch_size': 32})
    >>> profile.cells[0].forward_s
    Affine(fixed=0.001, per_example=0.0001)
    >>> shape = PipelineShape(num_stages=2, num_micro_batches=4, remat='never')
    >>> shape.MicroBatchSize(profile.batch_size)  # B / (R M) examples
    8

`lingvo_gpipe.profiling` measures a profile's cells; `ProfileSizes` says on
which micro-batch sizes.
"""

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lingvo_gpipe.planning import checks
from lingvo_gpipe.planning import schedule


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
                  'kept_workspace_bytes', 'weight_s')


@dataclasses.dataclass(frozen=True)
class CellProfile:
  """What one cell costs (see `lingvo_gpipe.profiling.ProfileCells`).

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
    weight_s: Seconds, on n examples, of the part of `backward_s` that
      computes the gradients of its weights, when a schedule splits the
      backward (zero bubble: `schedule.Table.split_backward`): the weight
      action W takes it, the backward action B takes `backward_s` minus
      it. None (profiles written before it was, or not measured): zero
      bubble schedules are not planned for the model.
    weight_stash_bytes: Per example, the bytes a call holds from its B to
      its W when the backward is split: what the weight gradients need
      (e.g. the inputs of its matmuls and the gradients of their outputs),
      as held while the call waits for W, beyond nothing (the call's
      activations and input are freed at B). None: as for `weight_s`.
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
  weight_s: Optional[Affine] = None
  weight_stash_bytes: Optional[float] = None

  @property
  def splits_backward(self) -> bool:
    """Whether the profile has the weight-gradient part (zero bubble)."""
    return self.weight_s is not None and self.weight_stash_bytes is not None

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
      measured pipelined step (`calibrate.CalibrateCallOverhead`).
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

  def CellsWithoutWeightParts(self) -> List[str]:
    """The cells without `weight_s` or `weight_stash_bytes`, by name."""
    return [c.name for c in self.cells if not c.splits_backward]

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineShape:
  """One configuration of N = K R devices, all but its partition.

  The knobs of GPipeSequentialLayer that the planner chooses (with their
  defaults), and the data-parallel replicas around the pipeline:

      >>> shape = PipelineShape(num_stages=2, num_micro_batches=4,
      ...                       virtual_stages=2)
      >>> shape.num_chunks, shape.remat, shape.schedule
      (4, 'always', 'gpipe')
      >>> PipelineShape(num_stages=2, num_micro_batches=0)
      Traceback (most recent call last):
      ValueError: num_micro_batches=0 must be a positive int.

  Attributes:
    num_stages: K, devices of one pipeline.
    num_micro_batches: M.
    virtual_stages: v, chunks per device.
    remat: One of `schedule.REMAT_MODES`.
    schedule: A key of `schedule.SCHEDULES`.
    replicas: R = N / K data-parallel pipelines.

  Raises:
    ValueError: naming the field, on a count that is not a positive int or
      an unknown remat mode or schedule.
  """
  num_stages: int
  num_micro_batches: int
  virtual_stages: int = 1
  remat: str = 'always'
  schedule: str = 'gpipe'
  replicas: int = 1

  def __post_init__(self):
    for name in ('num_stages', 'num_micro_batches', 'virtual_stages',
                 'replicas'):
      checks.CheckPositiveInt(name, getattr(self, name))
    schedule.CheckRemat(self.remat)
    schedule.CheckSchedule(self.schedule)

  @property
  def num_chunks(self) -> int:
    """K v chunks."""
    return self.num_stages * self.virtual_stages

  def MicroBatchSize(self, batch_size: int) -> int:
    """Examples per micro-batch of a step of B examples: B / (R M).

    Args:
      batch_size: B, the examples of one step over all replicas.

    Returns:
      The micro-batch size.

    Raises:
      ValueError: unless R M divides B.
    """
    if batch_size % (self.replicas * self.num_micro_batches):
      raise ValueError(
          f'batch_size={batch_size} does not split into replicas='
          f'{self.replicas} x num_micro_batches={self.num_micro_batches}; use '
          f'a divisor of {batch_size // math.gcd(batch_size, self.replicas)} '
          'for M.')
    return batch_size // (self.replicas * self.num_micro_batches)


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
    peak_terms: {term: bytes} of the peak device's peak, the terms of
      `predict.Predict` in its order.
    step_terms: {'pipeline', 'outside_pipeline', 'update', 'overhead',
      'replicas': seconds}.
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

  @property
  def shape(self) -> PipelineShape:
    """The configuration without its partition."""
    return PipelineShape(
        num_stages=self.num_stages, num_micro_batches=self.num_micro_batches,
        virtual_stages=self.virtual_stages, remat=self.remat,
        schedule=self.schedule, replicas=self.replicas)

  def Describe(self) -> str:
    """E.g. "K=2 v=1 M=4 R=1 gpipe remat='never' [3, 3]"."""
    return (f'K={self.num_stages} v={self.virtual_stages} '
            f'M={self.num_micro_batches} R={self.replicas} {self.schedule} '
            f'remat={self.remat!r} {self.partition}')

  def ToJson(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


def Divisors(n: int) -> List[int]:
  """The divisors of n > 0, ascending."""
  return [d for d in range(1, n + 1) if n % d == 0]


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
                    for k in Divisors(num_devices)
                    if batch_size % (num_devices // k) == 0})
  if not replica:
    raise ValueError(f'batch_size={batch_size} does not split into the '
                     f'replicas of any K dividing num_devices={num_devices}.')
  largest = replica[-1]
  return sorted({max(1, largest // 8), largest}), replica
