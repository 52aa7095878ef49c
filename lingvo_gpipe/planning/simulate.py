"""Times and sizes a training step from per-chunk costs, without running it.

Pure Python. `Simulate` replays a schedule table (`schedule.Table`) with given
forward and backward costs per chunk (and the weight-gradient part of the
backward, for tables that split it) and returns when every call phase runs,
the bubble, and what each device holds at its peak; `StageOccupancy` reads
the same numbers (step time, bubble, utilization) off simulated or measured
events.

    >>> table = schedule.BuildTable('gpipe', num_devices=2, num_micro_batches=3)
    >>> Simulate(table, [1.0, 1.0], [2.0, 2.0]).bubble_fraction
    0.25
"""

import dataclasses
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from lingvo_gpipe.planning import checks
from lingvo_gpipe.planning import schedule


class Event(NamedTuple):
  """One phase of one call: what a device did from `start` to `end`."""
  stage: int  # The device (pipeline stage) that ran it.
  chunk: int  # The chunk of cells (= stage when v = 1, placed by default).
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
  """The simulated timing and memory of one training step (see `Simulate`).

  Attributes:
    table: The schedule table simulated.
    step_time: From the first forward's start (0) to the last action's end.
    forward_time: When the last forward ends.
    bubble_fraction: Idle device-time / total device-time, i.e.
      1 - sum(busy) / (K * step_time).
    utilization: Per device, its busy time / step_time.
    peak_memory: Per device, the most activation memory it holds at once, in
      the units of `input_memory` and `activation_memory`.
    peak_inputs: Per device, how many chunk inputs it holds at that peak.
    peak_activations: Per device, how many calls' full activations it holds
      at that peak.
    peak_gradients: Per device, the weight-gradient memory it holds at that
      peak (0 unless `gradient_memory` is given).
    peak_input_memory: Per device, the size of the chunk inputs it holds at
      that peak (0 unless `input_memory` is given).
    peak_backward_chunk: Per device, the chunk whose backward runs at that
      peak (its `backward_memory` is in the peak), or None if a forward
      or a weight gradient makes it.
    peak_weight_stash: Per device, the size of the weight-gradient stashes
      (`weight_memory`) it holds at that peak: calls whose backward ran and
      whose weight gradient has not ended (0 unless the table splits the
      backward).
    peak_weights_waiting: Per device, how many such calls it holds then.
    events: Every phase of every call, by device, then by start.
    recomputes: {(chunk, micro_batch): whether its backward recomputes}.
  """
  table: schedule.Table = dataclasses.field(repr=False)
  step_time: float
  forward_time: float
  bubble_fraction: float
  utilization: List[float]
  peak_memory: List[float]
  peak_inputs: List[int]
  peak_activations: List[int]
  events: List[Event] = dataclasses.field(repr=False)
  recomputes: Dict[Tuple[int, int], bool] = dataclasses.field(repr=False)
  peak_gradients: List[float] = dataclasses.field(default_factory=list)
  peak_input_memory: List[float] = dataclasses.field(default_factory=list)
  peak_backward_chunk: List[Optional[int]] = dataclasses.field(
      default_factory=list)
  peak_weight_stash: List[float] = dataclasses.field(default_factory=list)
  peak_weights_waiting: List[int] = dataclasses.field(default_factory=list)


class _Peak(NamedTuple):
  """What a device holds at one moment of `_Peaks`' walk."""
  memory: float
  inputs: int
  activations: int
  gradients: float
  input_memory: float
  weights_waiting: int
  weight_stash: float
  backward_chunk: Optional[int]


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
                length: int) -> List[float]:
  """Checks a per-chunk list of finite non-negative numbers; returns floats."""
  if isinstance(values, (str, bytes)) or not hasattr(values, '__len__'):
    raise ValueError(f'{name}={values!r} must be a list of numbers, one per '
                     'chunk.')
  if len(values) != length:
    raise ValueError(f'{name} has {len(values)} entries {list(values)}, '
                     f'expected {length} (one per chunk: K x v).')
  result = []
  for i, v in enumerate(values):
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or
        not math.isfinite(v) or v < 0):
      raise ValueError(f'{name}[{i}]={v!r} must be a finite number >= 0.')
    result.append(float(v))
  return result


def _Peaks(table: schedule.Table, recomputes: Dict[Tuple[int, int], bool],
           inputs: Sequence[float], activations: Sequence[float],
           gradients: Sequence[float],
           backward_memory: Sequence[float],
           weight_memory: Sequence[float]) -> List[_Peak]:
  """Per device, what it holds at its peak.

  Walks each device's actions in table order (see `Simulate` for the model).

  Args:
    table: The step.
    recomputes: From `schedule.RecomputedCalls`.
    inputs: Per chunk, the size of one micro-batch's input.
    activations: Per chunk, the size of one call's full activations.
    gradients: Per chunk, the size of its weight gradients.
    backward_memory: Per chunk, what its backward holds only while it runs.
    weight_memory: Per chunk, what a call holds from its backward to its
      weight gradient, in a table that splits the backward.

  Returns:
    One `_Peak` per device; of equal peaks, the one that holds the most
    inputs, then activations.
  """
  split = table.split_backward
  peaks = []
  for order in table.device_orders:
    held_inputs = held_activations = waiting = 0
    size = held_gradients = input_size = stash = 0.0
    summed = set()  # Chunks whose gradient sum exists.
    peak = _Peak(0.0, 0, 0, 0.0, 0.0, 0, 0.0, None)
    for phase, c, m in order:
      kept = not recomputes[c, m]
      if phase == schedule.FORWARD:
        held_inputs += 1
        size += inputs[c]
        input_size += inputs[c]
        # Running, the call holds its activations; a kept call keeps them.
        candidate = _Peak(size + activations[c], held_inputs,
                          held_activations + 1, held_gradients, input_size,
                          waiting, stash, None)
        if kept:
          held_activations += 1
          size += activations[c]
        if candidate[:-1] > peak[:-1]:
          peak = candidate
        continue
      # The call's weight gradients, made by its backward or, when the table
      # splits it, by its weight action; from the chunk's second call on,
      # next to the sum of the earlier ones.
      fresh = 0.0
      if phase == schedule.WEIGHT or not split:
        fresh = gradients[c]
        if c not in summed:
          summed.add(c)
          held_gradients += gradients[c]
          size += gradients[c]
          fresh = 0.0
      if phase == schedule.WEIGHT:
        candidate = _Peak(size + fresh, held_inputs, held_activations,
                          held_gradients + fresh, input_size, waiting, stash,
                          None)
        waiting -= 1
        stash -= weight_memory[c]
        size -= weight_memory[c]
      else:
        running = 0 if kept else 1
        candidate = _Peak(
            size + running * activations[c] + fresh + backward_memory[c],
            held_inputs, held_activations + running, held_gradients + fresh,
            input_size, waiting, stash, c)
        held_inputs -= 1
        size -= inputs[c]
        input_size -= inputs[c]
        if kept:
          held_activations -= 1
          size -= activations[c]
        if split:  # What the weight gradient needs, until it runs.
          waiting += 1
          stash += weight_memory[c]
          size += weight_memory[c]
      # Of equal peaks, the one holding the most (every field but the
      # running chunk, which has no order).
      if candidate[:-1] > peak[:-1]:
        peak = candidate
    peaks.append(peak)
  return peaks


def _SendsAcross(table: schedule.Table, action: schedule.Action) -> bool:
  """Whether an action's result goes to another device: a forward's outputs
  to the next chunk, a backward's input gradients to the previous one."""
  phase, c, _ = action
  if phase == schedule.FORWARD:
    reader = c + 1
  elif phase == schedule.BACKWARD:
    reader = c - 1
  else:
    return False
  return (0 <= reader < table.num_chunks and
          table.Device(reader) != table.Device(c))


def Simulate(table: schedule.Table,
             forward_costs: Sequence[float],
             backward_costs: Sequence[float],
             remat: str = 'always',
             transfer_cost: float = 0.0,
             input_memory: Optional[Sequence[float]] = None,
             activation_memory: Optional[Sequence[float]] = None,
             lockstep: bool = False,
             tick_overhead: float = 0.0,
             gradient_memory: Optional[Sequence[float]] = None,
             backward_memory: Optional[Sequence[float]] = None,
             weight_costs: Optional[Sequence[float]] = None,
             weight_memory: Optional[Sequence[float]] = None,
             transfers_busy: bool = False) -> Simulation:
  """Times one training step of a schedule table from per-chunk costs.

  Each device runs its actions in table order, one at a time. Timing, two
  ways:

  * dataflow (`lockstep=False`: the unrolled engine, and the loop engine's
    per-device loops in a TF1 graph): an action starts once its device is
    free and the actions it needs have ended (the previous chunk's forward
    of the micro-batch; the next chunk's backward and its own forward; with
    the loss outside the pipeline, every forward of the last chunk), plus
    `transfer_cost` for what comes from another device (with
    `transfers_busy`, the transfer occupies both devices instead: the
    sender for `transfer_cost` after its action, then the receiver for as
    long before its own, as where a CPU process serializes what it sends
    and parses what it receives);
  * lockstep (the loop engine's one loop for all devices, inside
    `tf.function`, under XLA or eager): tick t starts when every action of
    tick t - 1 has ended, and lasts as long as its longest action (plus
    `transfer_cost` if an action of the tick reads from another device)
    plus `tick_overhead`.

  A backward action that re-materializes (`schedule.RecomputedCalls`) first
  runs its forward again (a 'recompute' event of the forward cost), then its
  backward. In a table that splits the backward (`Table.split_backward`),
  a backward action ('backward' event) takes `backward_costs` minus
  `weight_costs`, and a weight action ('weight' event, which never
  recomputes) takes `weight_costs`; it starts once its device is free and
  its own backward has ended.

  Memory model, per device, counting micro-batch activations and, if given,
  weight gradients (not weights, optimizer slots or the merged output; the
  planner adds those, `predict.Predict`): from its forward until its
  backward ends a call keeps its chunk's input (`input_memory`). While a
  call's forward, recompute or backward runs, and for a call that does not
  recompute from its forward until its backward ends, the call also holds its
  full activations (`activation_memory`, the intermediate tensors the backward
  needs, without the input), and a backward holds its `backward_memory`
  while it runs. So for GPipe with M micro-batches the peak is
  M inputs + 1 activations for 'always' and 'except_last', M inputs + M
  activations for 'never'. In a table that splits the backward, a call frees
  its input and activations when its backward (input gradients) ends, as
  above, and holds its `weight_memory` from then until its weight action
  ends (what the weight gradient needs: e.g. the inputs of its matmuls and
  the gradients of their outputs); its weight gradients appear (in the
  chunk's sum, or fresh next to it) while the weight action runs, not the
  backward. By default an input counts 0 and a call's
  activations 1: `peak_memory` is in "one call's activations"; pass byte
  sizes to get bytes.

  With equal chunks and no transfer cost a GPipe table's bubble fraction is
  the closed form `schedule.BubbleFraction(K, M, v)` (v = 1, or K dividing
  M). Runs in O(ticks x K).

  Args:
    table: The step, e.g. `schedule.BuildTable('gpipe', K, M, v)`.
    forward_costs: Per chunk (C = K v), the forward time of one micro-batch
      (any time unit, e.g. seconds).
    backward_costs: Per chunk, the backward time without the recompute.
    remat: One of `REMAT_MODES`.
    transfer_cost: Time to pass one micro-batch's activations (forward) or
      gradients (backward) from one device to another.
    input_memory: Optional per-chunk sizes of one micro-batch's input
      (default 0 each).
    activation_memory: Optional per-chunk sizes of one call's full
      activations (default 1 each).
    lockstep: Whether ticks run in lockstep (see above).
    tick_overhead: With lockstep, the cost of a tick beyond its work.
    gradient_memory: Optional per-chunk sizes of the chunk's weight
      gradients (default 0 each).
    backward_memory: Optional per-chunk sizes of what a backward of the
      chunk holds only while it runs, e.g. its kernels' temporaries and the
      gradient it receives (default 0 each).
    weight_costs: Per chunk, the part of `backward_costs` that the weight
      gradient takes; required if the table splits the backward (ignored
      otherwise), each at most the chunk's backward cost.
    weight_memory: Optional per-chunk sizes of what a call holds from its
      backward to its weight action in a table that splits the backward
      (default 0 each).
    transfers_busy: Whether a transfer occupies the sending and the
      receiving device rather than only delaying the receiver (dataflow
      timing; a lockstep tick counts it as its own time either way). Calls'
      events leave the transfers out.

  Returns:
    A `Simulation`.

  Raises:
    ValueError: naming the argument, if a list has another length than the
      chunks or a negative or non-finite entry, if all costs are zero, if
      remat is unknown, if transfer_cost or tick_overhead is negative or
      not finite, or if the table splits the backward and weight_costs is
      missing or above backward_costs.
  """
  num_chunks, num_devices = table.num_chunks, table.num_devices
  forward = _CheckCosts('forward_costs', forward_costs, num_chunks)
  backward = _CheckCosts('backward_costs', backward_costs, num_chunks)
  for name, value in (('transfer_cost', transfer_cost),
                      ('tick_overhead', tick_overhead)):
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or
        not math.isfinite(value) or value < 0):
      raise ValueError(f'{name}={value!r} must be a finite number >= 0.')
  if not any(forward) and not any(backward):
    raise ValueError('forward_costs and backward_costs are all zero; a step '
                     'must cost something.')
  inputs = ([0.0] * num_chunks if input_memory is None else
            _CheckCosts('input_memory', input_memory, num_chunks))
  activations = ([1.0] * num_chunks if activation_memory is None else
                 _CheckCosts('activation_memory', activation_memory,
                             num_chunks))
  gradients = ([0.0] * num_chunks if gradient_memory is None else
               _CheckCosts('gradient_memory', gradient_memory, num_chunks))
  transient = ([0.0] * num_chunks if backward_memory is None else
               _CheckCosts('backward_memory', backward_memory, num_chunks))
  stashes = ([0.0] * num_chunks if weight_memory is None else
             _CheckCosts('weight_memory', weight_memory, num_chunks))
  weight = [0.0] * num_chunks
  if table.split_backward:
    if weight_costs is None:
      raise ValueError(
          f'weight_costs is required: the {table.schedule} table splits the '
          'backward into input gradients (B) and weight gradients (W); give '
          'per chunk the part of backward_costs that W takes.')
    weight = _CheckCosts('weight_costs', weight_costs, num_chunks)
    for c, (w, b) in enumerate(zip(weight, backward)):
      if w > b:
        raise ValueError(f'weight_costs[{c}]={w!r} is above backward_costs['
                         f'{c}]={b!r}; the weight gradient is part of the '
                         'backward.')
  recomputes = schedule.RecomputedCalls(table, remat)

  end = {}  # Action -> when it ended.
  free = [0.0] * num_devices
  loss_ready = 0.0
  last_chunk = num_chunks - 1
  tick_start = 0.0
  events = [[] for _ in range(num_devices)]
  for tick in table.ticks:
    tick_end = tick_start
    for k, action in enumerate(tick):
      if action is None:
        continue
      phase, c, m = action
      if phase == schedule.FORWARD:
        source = schedule.Action(phase, c - 1, m) if c else None
        durations = [('forward', forward[c])]
      elif phase == schedule.WEIGHT:
        source = None  # Its own backward, on this device (below).
        durations = [('weight', weight[c])]
      else:
        source = (schedule.Action(phase, c + 1, m) if c < last_chunk else
                  None)
        durations = ([('recompute', forward[c])] if recomputes[c, m] else [])
        durations.append(('backward', backward[c] - weight[c]))
      delay = (transfer_cost if source is not None and
               table.Device(source.chunk) != k else 0.0)
      busy = transfers_busy and not lockstep
      if lockstep:
        start = tick_start + tick_overhead
      else:
        start = max(free[k], end[source] + (0.0 if busy else delay)
                    if source else 0.0)
        if phase == schedule.BACKWARD:
          start = max(start, end[schedule.Action(schedule.FORWARD, c, m)])
          if table.loss_outside:
            start = max(start, loss_ready)
        elif phase == schedule.WEIGHT:
          start = max(start, end[schedule.Action(schedule.BACKWARD, c, m)])
      time = start + (delay if lockstep or busy else 0.0)
      for name, cost in durations:
        events[k].append(Event(k, c, m, name, time, time + cost))
        time += cost
      if busy and _SendsAcross(table, action):
        time += transfer_cost
      end[action] = free[k] = time
      tick_end = max(tick_end, time)
      if phase == schedule.FORWARD and c == last_chunk:
        loss_ready = max(loss_ready, time)
    if lockstep and tick_end > tick_start:
      tick_start = tick_end
  flat = [e for device_events in events for e in device_events]
  step_time = max(e.end for e in flat)
  forward_time = max(e.end for e in flat if e.phase == 'forward')
  busy = [sum(e.end - e.start for e in device_events)
          for device_events in events]
  peaks = _Peaks(table, recomputes, inputs, activations, gradients,
                 transient, stashes)
  return Simulation(
      table=table,
      step_time=step_time,
      forward_time=forward_time,
      bubble_fraction=1.0 - sum(busy) / (num_devices * step_time),
      utilization=[b / step_time for b in busy],
      peak_memory=[p.memory for p in peaks],
      peak_inputs=[p.inputs for p in peaks],
      peak_activations=[p.activations for p in peaks],
      events=flat,
      recomputes=recomputes,
      peak_gradients=[p.gradients for p in peaks],
      peak_input_memory=[p.input_memory for p in peaks],
      peak_backward_chunk=[p.backward_chunk for p in peaks],
      peak_weight_stash=[p.weight_stash for p in peaks],
      peak_weights_waiting=[p.weights_waiting for p in peaks])
