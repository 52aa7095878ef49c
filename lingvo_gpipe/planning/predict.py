"""The planner's cost model: a configuration's step time and per-device peak.

Pure Python, no TensorFlow. `Predict` turns a `profile.Profile`, a
`profile.PipelineShape` and a partition into a `profile.Candidate`. Six
cells of 1 ms + 0.1 ms per example forward, twice that backward, on K = 2
devices:

    >>> from lingvo_gpipe.planning.profile import Affine, CellProfile
    >>> fc = CellProfile('fc', forward_s=Affine(1e-3, 1e-4),
    ...                  backward_s=Affine(2e-3, 2e-4), update_s=1e-3,
    ...                  activation_bytes=4e3, output_bytes=1e3,
    ...                  weight_bytes=4e6, gradient_bytes=4e6, slot_bytes=8e6)
    >>> profile = profile_lib.Profile(cells=(fc,) * 6, input_bytes=1e3,
    ...                               batch_size=32)
    >>> shape = profile_lib.PipelineShape(num_stages=2, num_micro_batches=4,
    ...                                   remat='never')
    >>> candidate = Predict(profile, shape, [3, 3], memory_per_device=2**30)
    >>> round(candidate.predicted_step_s, 4), candidate.fits
    (0.084, True)
    >>> candidate.peak_terms['optimizer_slots']  # Device 0's three cells.
    24000000.0

The model of time: the schedule table simulated (`simulate.Simulate`) with
per-chunk forward and backward times (each cell's time is affine in the
micro-batch size, fitted on two profiled sizes), plus the work around the
pipeline on the replica's batch (input, loss and its gradient), plus the
optimizer update of the slowest device, plus what a real sequential step
costs beyond those parts (the learner's gradient norms and clipping), plus a
cost per chunk call calibrated on one measured pipelined step
(`calibrate.CalibrateCallOverhead`). The model of memory is the table's
(`simulate.Simulate`: per device, the chunk inputs it holds from forward to
backward, the activations of running and kept calls, weight gradients from a
chunk's first backward, a running backward's workspace), plus per device its
chunks' weights and optimizer slots, plus the work around the pipeline on the
first device (input and loss temporaries) and the merged output on the last,
or, if more, what the learner's update holds (gradients scaled into new
tensors). Each term is one small function below; docs/planning.md says where
the model is wrong and how far, measured.
"""

import dataclasses
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from lingvo_gpipe.planning import partition as partition_lib
from lingvo_gpipe.planning import profile as profile_lib
from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate

CellProfile = profile_lib.CellProfile


@dataclasses.dataclass(frozen=True)
class _Step:
  """One configuration's step, as the terms of the model read it.

  Attributes:
    profile: The model.
    shape: The configuration.
    table: Its schedule table.
    chunks: Per chunk, its cells.
    micro: Examples per micro-batch.
    workspace: Per chunk, the workspace bytes of its running backward.
    output_gradients: Per chunk, the bytes of the gradient of its outputs,
      which its backward receives.
    sim: The table simulated with the chunks' times and bytes.
  """
  profile: profile_lib.Profile
  shape: profile_lib.PipelineShape
  table: schedule.Table
  chunks: List[Sequence[CellProfile]]
  micro: int
  workspace: List[float]
  output_gradients: List[float]
  sim: simulate.Simulation

  @property
  def replica_batch(self) -> int:
    return self.micro * self.shape.num_micro_batches

  def DeviceChunks(self, k: int) -> Tuple[int, ...]:
    """The chunks of device k, as the table places them."""
    return self.table.device_chunks[k]

  def DeviceSum(self, k: int, value: Callable[[CellProfile], float]) -> float:
    """`value` summed over device k's cells, chunk by chunk."""
    return sum(sum(value(cell) for cell in self.chunks[c])
               for c in self.DeviceChunks(k))


def _ChunkSums(chunks: Sequence[Sequence[CellProfile]],
               value: Callable[[CellProfile], float]) -> List[float]:
  """Per chunk, `value` summed over its cells."""
  return [sum(value(cell) for cell in chunk) for chunk in chunks]


def _SplitCells(cells: Sequence[CellProfile],
                counts: Sequence[int]) -> List[Sequence[CellProfile]]:
  """The cells of each chunk, `counts[c]` of them in chunk c."""
  ends = itertools.accumulate(counts)
  return [cells[end - count:end] for end, count in zip(ends, counts)]


def _ChunkSeconds(
    profile: profile_lib.Profile, chunks: Sequence[Sequence[CellProfile]],
    micro: int, split_backward: bool = False
) -> Tuple[List[float], List[float], Optional[List[float]]]:
  """Per chunk, the forward, backward and weight-gradient seconds of a call.

  Each is its cells' profiled time on the micro-batch plus half of the
  calibrated call overhead. When the backward is split, its two actions are
  calls of their own: B (the backward minus the weight part) and W (the
  cells' `weight_s`, at most their backward) each pay half the overhead.

  Args:
    profile: The model.
    chunks: Per chunk, its cells.
    micro: Examples per micro-batch.
    split_backward: Whether the table splits the backward.

  Returns:
    (forward seconds, backward seconds (B and W together), weight seconds
    or None if not split), one per chunk each.
  """
  half_call = profile.call_overhead_s / 2
  forward = _ChunkSums(chunks, lambda c: c.forward_s(micro))
  backward = _ChunkSums(chunks, lambda c: c.backward_s(micro))
  forward = [t + half_call for t in forward]
  backward = [t + half_call for t in backward]
  if not split_backward:
    return forward, backward, None
  weight = [t + half_call for t in _ChunkSums(
      chunks, lambda c: min(c.weight_s(micro), c.backward_s(micro)))]
  return forward, [t + half_call for t in backward], weight


def _CheckWeightParts(profile: profile_lib.Profile,
                      shape: profile_lib.PipelineShape) -> None:
  """ValueError unless a schedule that splits the backward has its costs."""
  missing = profile.CellsWithoutWeightParts()
  if schedule.SCHEDULES[shape.schedule].split_backward and missing:
    raise ValueError(
        f'schedule={shape.schedule!r} splits the backward, but the profile '
        f'has no weight_s / weight_stash_bytes for cells {missing}; profile '
        'the model again to plan it.')


def _StageInputBytes(profile: profile_lib.Profile,
                     chunks: Sequence[Sequence[CellProfile]],
                     micro: int) -> List[float]:
  """Per chunk, its input on a micro-batch: the previous chunk's outputs."""
  return [profile.input_bytes * micro] + [
      chunk[-1].output_bytes * micro for chunk in chunks[:-1]]


def _OutputGradientBytes(chunks: Sequence[Sequence[CellProfile]],
                         micro: int) -> List[float]:
  """Per chunk, the gradient of its outputs on a micro-batch."""
  return [chunk[-1].output_bytes * micro for chunk in chunks]


def _WorkspaceBytes(table: schedule.Table, remat: str,
                    chunks: Sequence[Sequence[CellProfile]],
                    micro: int) -> List[float]:
  """Per chunk, the workspace of its running backward.

  The largest of its cells' (`CellProfile.Workspace`), in the form for a
  call that kept its activations if one of the chunk's calls does.

  Args:
    table: The schedule table.
    remat: The remat mode.
    chunks: Per chunk, its cells.
    micro: Examples per micro-batch.

  Returns:
    Bytes per chunk.
  """
  recomputes = schedule.RecomputedCalls(table, remat)
  keeps = [not all(recomputes[c, m] for m in range(table.num_micro_batches))
           for c in range(table.num_chunks)]
  return [max(cell.Workspace(keeps[c])(micro) for cell in chunk)
          for c, chunk in enumerate(chunks)]


def _BuildStep(profile: profile_lib.Profile,
               shape: profile_lib.PipelineShape,
               counts: Sequence[int]) -> _Step:
  """The table of a configuration, simulated with its chunks' costs."""
  micro = shape.MicroBatchSize(profile.batch_size)
  _CheckWeightParts(profile, shape)
  table = schedule.BuildTable(shape.schedule,
                              num_devices=shape.num_stages,
                              num_micro_batches=shape.num_micro_batches,
                              virtual_stages=shape.virtual_stages)
  chunks = _SplitCells(profile.cells, counts)
  forward, backward, weight = _ChunkSeconds(profile, chunks, micro,
                                            table.split_backward)
  stashes = (_ChunkSums(chunks, lambda c: c.weight_stash_bytes * micro)
             if table.split_backward else None)
  workspace = _WorkspaceBytes(table, shape.remat, chunks, micro)
  output_gradients = _OutputGradientBytes(chunks, micro)
  sim = simulate.Simulate(
      table, forward, backward, shape.remat,
      input_memory=_StageInputBytes(profile, chunks, micro),
      activation_memory=_ChunkSums(chunks,
                                   lambda c: c.activation_bytes * micro),
      gradient_memory=_ChunkSums(chunks, lambda c: c.gradient_bytes),
      backward_memory=[w + g for w, g in zip(workspace, output_gradients)],
      weight_costs=weight, weight_memory=stashes)
  return _Step(profile, shape, table, chunks, micro, workspace,
               output_gradients, sim)


def _TableBytes(step: _Step, k: int) -> Dict[str, float]:
  """Device k's peak in the simulated table, by term.

  The weight gradients held, the stage inputs, the workspace of the
  backward running at the peak and the gradient it receives; the rest of
  the table's peak is activations.

  Args:
    step: The configuration's step.
    k: The device.

  Returns:
    {'gradients', 'stage_inputs', 'activations', 'backward_workspace',
    'output_gradient': bytes}, and 'weight_stash' (what calls hold from B to
    W) if the table splits the backward.
  """
  sim = step.sim
  running = sim.peak_backward_chunk[k]
  workspace, received = ((0.0, 0.0) if running is None else
                         (step.workspace[running],
                          step.output_gradients[running]))
  stash = sim.peak_weight_stash[k]
  terms = {
      'gradients': sim.peak_gradients[k],
      'stage_inputs': sim.peak_input_memory[k],
      'activations': (sim.peak_memory[k] - sim.peak_gradients[k] -
                      sim.peak_input_memory[k] - workspace - received -
                      stash),
      'backward_workspace': workspace,
      'output_gradient': received,
  }
  if step.table.split_backward:
    terms['weight_stash'] = stash
  return terms


def _OutsidePipelineBytes(step: _Step, k: int) -> float:
  """The input and loss temporaries on the replica's batch, on device 0."""
  if k:
    return 0.0
  return step.profile.outside_bytes(step.replica_batch)


def _MergedOutputBytes(step: _Step, k: int) -> float:
  """The replica's merged output, on the device of the last chunk."""
  if k != step.table.Device(step.table.num_chunks - 1):
    return 0.0
  return step.profile.cells[-1].output_bytes * step.replica_batch


def _UpdateCopyBytes(step: _Step, k: int, weights: float, slots: float,
                     pipeline_peak: float) -> float:
  """What the learner's update holds on device k beyond the pipeline's peak.

  After the pipeline the learner scales every weight gradient into a new
  tensor (Lingvo's gradient norm clipping needs all of them first): the
  device holds its weights, slots and gradients, and the largest of its
  cells' gradients once more.

  Args:
    step: The configuration's step.
    k: The device.
    weights: Its weight bytes.
    slots: Its optimizer slot bytes.
    pipeline_peak: Its peak in the pipeline, every other term.

  Returns:
    Bytes, 0 where the pipeline's peak is higher.
  """
  own_cells = [cell for c in step.DeviceChunks(k) for cell in step.chunks[c]]
  update_peak = (weights + slots +
                 step.DeviceSum(k, lambda c: c.gradient_bytes) +
                 max([cell.gradient_bytes for cell in own_cells],
                     default=0.0))
  return max(update_peak - pipeline_peak, 0.0)


def _ReplicaBytes(step: _Step) -> float:
  """What data parallelism holds beyond the model (R > 1), measured."""
  if step.shape.replicas == 1:
    return 0.0
  return step.profile.replica_overhead_bytes


def _DeviceBytes(step: _Step, k: int) -> Dict[str, float]:
  """Device k's predicted peak, by term, in the order they are reported."""
  terms = {
      'weights': step.DeviceSum(k, lambda c: c.weight_bytes),
      'optimizer_slots': step.DeviceSum(k, lambda c: c.slot_bytes),
      **_TableBytes(step, k),
      'outside_pipeline': _OutsidePipelineBytes(step, k),
      'merged_output': _MergedOutputBytes(step, k),
  }
  terms['update_copies'] = _UpdateCopyBytes(
      step, k, terms['weights'], terms['optimizer_slots'],
      sum(terms.values()))
  terms['replicas'] = _ReplicaBytes(step)
  return terms


def _UpdateSeconds(step: _Step) -> float:
  """The optimizer update of the slowest device's cells."""
  return max(step.DeviceSum(k, lambda c: c.update_s)
             for k in range(step.shape.num_stages))


def _ReplicaSeconds(step: _Step) -> float:
  """What data parallelism costs beyond the model (R > 1), measured."""
  if step.shape.replicas == 1:
    return 0.0
  return step.profile.replica_overhead_s


def _StepSeconds(step: _Step) -> Dict[str, float]:
  """The step's predicted seconds, by term, in the order they are reported."""
  return {
      'pipeline': step.sim.step_time,
      'outside_pipeline': step.profile.outside_s(step.replica_batch),
      'update': _UpdateSeconds(step),
      'overhead': step.profile.step_overhead_s,
      'replicas': _ReplicaSeconds(step),
  }


def Predict(profile: profile_lib.Profile,
            shape: profile_lib.PipelineShape,
            partition: Sequence[int],
            *,
            memory_per_device: Optional[float] = None,
            partition_rule: str = 'fastest') -> profile_lib.Candidate:
  """The predicted step time and per-device peak of one configuration.

  Time (`Candidate.step_terms`): `simulate.Simulate` of the schedule table
  as dataflow (in the graph mode of Lingvo's trainer the loop engine runs
  one loop per device: neither engine runs ticks in lockstep) with per-chunk
  forward and backward times on the micro-batch (its cells' times plus half
  of `profile.call_overhead_s` each), plus `profile.outside_s` on the
  replica's batch, plus the largest per-device sum of its cells' update
  times, plus `profile.step_overhead_s`, plus `profile.replica_overhead_s`
  if R > 1.

  Memory (`Candidate.peak_terms`), per device k of one pipeline: its chunks'
  weights, optimizer slots and (from their first backward) weight
  gradients; the table's stage inputs and activations (`simulate.Simulate`
  with byte sizes: the input of chunk c is the output of chunk c - 1, or the
  pipeline's input for c = 0); the workspace of the backward running at the
  device's worst tick (the largest of its chunk's cells', in the form for a
  call that kept its activations where the chunk has one) and the gradient
  of its outputs that it receives; on the first device,
  `profile.outside_bytes` (input and loss temporaries); on the device of the
  last chunk, the merged output of the replica's batch; for a schedule that
  splits the backward (zero bubble), the W stashes held at the peak
  (`CellProfile.weight_stash_bytes`, the term 'weight_stash'), the cells'
  `weight_s` being the W action's time (B takes the rest of `backward_s`;
  each is a call, with half the call overhead). Where the learner's
  update holds more than that (see `_UpdateCopyBytes`), the difference is
  the term 'update_copies'. With R > 1, every device adds
  `profile.replica_overhead_bytes` (the term 'replicas').

  Args:
    profile: The model.
    shape: The configuration.
    partition: Cells per chunk, K v counts.
    memory_per_device: The budget that `fits` compares with; None: fits.
    partition_rule: Recorded in the candidate.

  Returns:
    The `Candidate`.

  Raises:
    ValueError: if the sizes do not fit together (batch, cells, chunks), or
      the schedule splits the backward and the profile lacks the weight
      parts (`CellProfile.splits_backward`).
  """
  counts = partition_lib.CheckPartition(partition, profile.num_cells,
                                        shape.num_chunks)
  step = _BuildStep(profile, shape, counts)
  engine = schedule.ChooseEngine(
      'auto', shape.num_stages, shape.num_micro_batches, shape.remat,
      schedule=shape.schedule, virtual_stages=shape.virtual_stages)
  device_terms = [_DeviceBytes(step, k) for k in range(shape.num_stages)]
  device_peaks = [sum(terms.values()) for terms in device_terms]
  peak_device = max(range(shape.num_stages), key=lambda k: device_peaks[k])
  step_terms = _StepSeconds(step)
  peak = device_peaks[peak_device]
  return profile_lib.Candidate(
      **dataclasses.asdict(shape),
      partition=counts,
      engine=engine,
      predicted_step_s=sum(step_terms.values()),
      predicted_peak_bytes=peak,
      fits=memory_per_device is None or peak <= memory_per_device,
      device_peak_bytes=device_peaks,
      peak_device=peak_device,
      peak_terms=device_terms[peak_device],
      step_terms=step_terms,
      partition_rule=partition_rule,
      bubble_fraction=step.sim.bubble_fraction)
