"""Times and sizes a GPipe step from per-stage costs, without running it.

Pure Python. `Simulate` replays the engine's order of calls with given forward
and backward costs; `StageOccupancy` reads the same numbers (step time, bubble,
utilization) off simulated or measured events.

    >>> Simulate([1.0, 1.0], [2.0, 2.0], num_micro_batches=3).bubble_fraction
    0.25
"""

import dataclasses
import functools
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

from lingvo_gpipe.planning import checks
from lingvo_gpipe.planning import schedule


class Event(NamedTuple):
  """One phase of one stage call: what a stage did from `start` to `end`."""
  stage: int
  micro_batch: int
  phase: str  # One of schedule.PHASES.
  start: float
  end: float


class Occupancy(NamedTuple):
  """How busy the stages were during a step (see `StageOccupancy`)."""
  step_time: float
  bubble_fraction: float
  utilization: List[float]


@dataclasses.dataclass(frozen=True)
class Simulation:
  """The simulated timing and memory of one GPipe step (see `Simulate`).

  Attributes:
    step_time: From the first forward's start (0) to the last backward's end.
    forward_time: When the last forward ends and the backward pass begins.
    bubble_fraction: Idle stage-time / total stage-time, i.e.
      1 - sum(busy) / (K * step_time).
    utilization: Per stage, its busy time / step_time.
    peak_memory: Per stage, the most activation memory it holds at once, in
      the units of `input_memory` and `activation_memory`.
    peak_inputs: Per stage, how many micro-batch inputs it holds at that peak.
    peak_activations: Per stage, how many calls' full activations it holds at
      that peak.
    forward_starts: forward_starts[k][m], when stage k starts the forward of
      micro-batch m.
    backward_starts: backward_starts[k][m], when stage k starts the backward
      call of micro-batch m (its recompute, if it recomputes).
    forward_costs: The K forward costs simulated.
    backward_costs: The K backward costs simulated.
    recomputes: recomputes[m], whether the calls of micro-batch m recompute.
    events: Every phase of every call, by stage, then by start (built on first
      access: K * M * 3 tuples for large K and M).
  """
  step_time: float
  forward_time: float
  bubble_fraction: float
  utilization: List[float]
  peak_memory: List[float]
  peak_inputs: List[int]
  peak_activations: List[int]
  forward_starts: List[List[float]] = dataclasses.field(repr=False)
  backward_starts: List[List[float]] = dataclasses.field(repr=False)
  forward_costs: List[float] = dataclasses.field(repr=False)
  backward_costs: List[float] = dataclasses.field(repr=False)
  recomputes: List[bool] = dataclasses.field(repr=False)

  @functools.cached_property
  def events(self) -> List[Event]:
    """Every phase of every call: (stage, micro_batch, phase, start, end)."""
    events = []
    for k, (forward, backward) in enumerate(
        zip(self.forward_costs, self.backward_costs)):
      for m, start in enumerate(self.forward_starts[k]):
        events.append(Event(k, m, 'forward', start, start + forward))
      starts = self.backward_starts[k]
      for m in reversed(range(len(starts))):
        start = starts[m]
        if self.recomputes[m]:
          events.append(Event(k, m, 'recompute', start, start + forward))
          start += forward
        events.append(Event(k, m, 'backward', start, start + backward))
    return events


def StageOccupancy(events: Sequence[Event], num_stages: int) -> Occupancy:
  """Step time, bubble fraction and per-stage utilization of some events.

  Works for simulated and for measured events alike; a stage's phases must not
  overlap each other (they do not in a GPipe step).

  Args:
    events: Phases of stage calls, stages in [0, num_stages).
    num_stages: K.

  Returns:
    The span from the earliest start to the latest end, the idle share of the
    K stages over that span, and each stage's busy share (0 when the span is
    empty).

  Raises:
    ValueError: if K is not a positive int, there are no events, or an event's
      stage is out of range.
  """
  checks.CheckPositiveInt('num_stages', num_stages)
  if not events:
    raise ValueError('events is empty; a step has at least one event.')
  busy = [0.0] * num_stages
  first, last = math.inf, -math.inf
  for e in events:
    if not 0 <= e.stage < num_stages:
      raise ValueError(f'event {e} has stage={e.stage}, outside [0, '
                       f'{num_stages}).')
    busy[e.stage] += e.end - e.start
    first = min(first, e.start)
    last = max(last, e.end)
  step_time = last - first
  if step_time <= 0:
    return Occupancy(0.0, 0.0, [0.0] * num_stages)
  utilization = [b / step_time for b in busy]
  return Occupancy(step_time, 1.0 - sum(utilization) / num_stages,
                   utilization)


def _CheckCosts(name: str, values: Sequence[float],
                length: Optional[int] = None) -> List[float]:
  """Checks a per-stage list of finite non-negative numbers; returns floats."""
  if isinstance(values, (str, bytes)) or not hasattr(values, '__len__'):
    raise ValueError(f'{name}={values!r} must be a list of numbers, one per '
                     'stage.')
  if length is None and not values:
    raise ValueError(f'{name} is empty; give one number per stage.')
  if length is not None and len(values) != length:
    raise ValueError(f'{name} has {len(values)} entries {list(values)}, '
                     f'expected {length} (one per stage).')
  result = []
  for i, v in enumerate(values):
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or
        not math.isfinite(v) or v < 0):
      raise ValueError(f'{name}[{i}]={v!r} must be a finite number >= 0.')
    result.append(float(v))
  return result


def _MemoryCheckpoints(num_micro_batches: int,
                       remat: str) -> List[Tuple[int, int]]:
  """The (inputs, full activations) a stage holds while each call runs.

  One pair per call phase, in the order a stage runs them; see `Simulate`
  for the model. Only the pairs no other pair dominates are returned: the
  peak for any non-negative sizes is among them.

  Args:
    num_micro_batches: M.
    remat: One of `REMAT_MODES`.

  Returns:
    The Pareto-maximal (inputs, activations) pairs.
  """
  inputs = activations = 0
  pairs = set()
  for m in range(num_micro_batches):
    inputs += 1
    activations += 1
    pairs.add((inputs, activations))
    if schedule.Recomputes(remat, m, num_micro_batches):
      activations -= 1
  for m in reversed(range(num_micro_batches)):
    if schedule.Recomputes(remat, m, num_micro_batches):
      activations += 1
    pairs.add((inputs, activations))
    inputs -= 1
    activations -= 1
  frontier, most_activations = [], -1
  for n_in, n_act in sorted(pairs, reverse=True):
    if n_act > most_activations:
      frontier.append((n_in, n_act))
      most_activations = n_act
  return frontier


def Simulate(forward_costs: Sequence[float],
             backward_costs: Sequence[float],
             num_micro_batches: int,
             remat: str = 'always',
             transfer_cost: float = 0.0,
             input_memory: Optional[Sequence[float]] = None,
             activation_memory: Optional[Sequence[float]] = None
            ) -> Simulation:
  """Times one GPipe training step from per-stage costs.

  The step runs as the engine (`engine.pipeline.Pipeline`) orders it; a stage
  does one thing at a time and nothing waits that need not:

  * forward of (k, m) starts once stage k finished the forward of m - 1 and
    stage k - 1 finished the forward of m, plus `transfer_cost`;
  * the backward pass starts when every forward has finished (the loss needs
    the merged output of all micro-batches);
  * the backward of (k, m) starts once stage k finished the backward of
    m + 1 and stage k + 1 finished the backward of m, plus `transfer_cost`;
    a call that recomputes first runs its forward again (a 'recompute' event
    of the forward cost), then its backward.

  Memory model, per stage, counting only micro-batch activations (not
  weights, their gradients or the merged output): from its forward until its
  backward ends a call keeps its micro-batch input (`input_memory`). While a
  call's forward, recompute or backward runs, and for a call that does not
  recompute from its forward until its backward ends, the call also holds its
  full activations (`activation_memory`, the intermediate tensors the backward
  needs, without the input). So with M micro-batches the peak is
  M inputs + 1 activations for 'always' (during the last forward and the
  first recompute) and for 'except_last' (M - 1 inputs + 1 kept call), and
  M inputs + M activations for 'never'. By default an input counts 0 and a
  call's activations 1: `peak_memory` is in "one micro-batch's stage
  activations"; pass byte sizes to get bytes.

  With equal stages and no transfer cost the bubble fraction is the closed
  form `schedule.BubbleFraction(K, M)` for 'always' and 'never'. Runs in
  O(K * M).

  Args:
    forward_costs: K forward times of one micro-batch, one per stage (any
      time unit, e.g. seconds).
    backward_costs: K backward times (without the recompute), same unit.
    num_micro_batches: M.
    remat: One of `REMAT_MODES`.
    transfer_cost: Time to pass one micro-batch's activations (forward) or
      gradients (backward) from one stage to the next.
    input_memory: Optional K sizes of one micro-batch input of each stage
      (default 0 each).
    activation_memory: Optional K sizes of one call's full activations of
      each stage (default 1 each).

  Returns:
    A `Simulation`.

  Raises:
    ValueError: naming the argument, if a list is empty, has another length
      than forward_costs or a negative or non-finite entry, if all costs are
      zero, if M is not a positive int, if remat is unknown or if
      transfer_cost is negative or not finite.
  """
  forward = _CheckCosts('forward_costs', forward_costs)
  num_stages = len(forward)
  backward = _CheckCosts('backward_costs', backward_costs, num_stages)
  checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
  num_micro = num_micro_batches
  schedule.CheckRemat(remat)
  if (isinstance(transfer_cost, bool) or
      not isinstance(transfer_cost, (int, float)) or
      not math.isfinite(transfer_cost) or transfer_cost < 0):
    raise ValueError(f'transfer_cost={transfer_cost!r} must be a finite '
                     'number >= 0.')
  if not any(forward) and not any(backward):
    raise ValueError('forward_costs and backward_costs are all zero; a step '
                     'must cost something.')
  inputs = ([0.0] * num_stages if input_memory is None else
            _CheckCosts('input_memory', input_memory, num_stages))
  activations = ([1.0] * num_stages if activation_memory is None else
                 _CheckCosts('activation_memory', activation_memory,
                             num_stages))
  recomputes = [
      schedule.Recomputes(remat, m, num_micro) for m in range(num_micro)
  ]

  # ready[m]: when micro-batch m's input (forward) or gradient (backward) has
  # left the neighbouring stage. Stages are visited in dependency order.
  forward_starts = []
  ready = [0.0] * num_micro
  for k in range(num_stages):
    delay = transfer_cost if k > 0 else 0.0
    cost, starts, free = forward[k], [], 0.0
    for m in range(num_micro):
      start = ready[m] + delay
      if start < free:
        start = free
      starts.append(start)
      free = ready[m] = start + cost
    forward_starts.append(starts)
  forward_end = max(ready)
  ready = [forward_end] * num_micro
  backward_starts = [None] * num_stages
  for k in reversed(range(num_stages)):
    delay = transfer_cost if k < num_stages - 1 else 0.0
    recompute, cost = forward[k], backward[k]
    starts, free = [0.0] * num_micro, forward_end
    for m in reversed(range(num_micro)):
      start = ready[m] + delay
      if start < free:
        start = free
      starts[m] = start
      free = ready[m] = start + (recompute + cost if recomputes[m] else cost)
    backward_starts[k] = starts
  step_time = max(ready)

  num_recomputes = sum(recomputes)
  busy = [num_micro * (f + b) + num_recomputes * f
          for f, b in zip(forward, backward)]
  checkpoints = _MemoryCheckpoints(num_micro, remat)
  peaks = [
      max((n_in * size_in + n_act * size_act, n_in, n_act)
          for n_in, n_act in checkpoints)
      for size_in, size_act in zip(inputs, activations)
  ]
  return Simulation(
      step_time=step_time,
      forward_time=forward_end,
      bubble_fraction=1.0 - sum(busy) / (num_stages * step_time),
      utilization=[b / step_time for b in busy],
      peak_memory=[p[0] for p in peaks],
      peak_inputs=[p[1] for p in peaks],
      peak_activations=[p[2] for p in peaks],
      forward_starts=forward_starts,
      backward_starts=backward_starts,
      forward_costs=forward,
      backward_costs=backward,
      recomputes=recomputes)

