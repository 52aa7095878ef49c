"""Lowering: a schedule table becomes the programs the loop engine runs.

Pure Python, no TensorFlow. A validated `schedule.Table` says which device
runs which compute action when; lowering adds what the loop engine needs to
run it:

* the step's **edges** (`Edge`): the input into chunk 0, chunk c into c + 1,
  the last chunk into the output, and every skip connection;
* the **transfers** (`Transfer`): which edge's tensors (or gradients) of
  which micro-batch go from which device to which, at which tick, into
  which buffer slot of the receiving device;
* the **buffers** (`Buffer`): per edge, its tensors on the reader's device
  and their gradients on the writer's; per chunk, its state before each call
  and the activations a call that keeps them stashes for its backward. A
  slot holds one micro-batch from its write to its last read, and is reused
  once free (`AllocateSlots`);
* per device, its **program** (`Instruction`s in tick order): the action,
  whether its call recomputes, and every slot it reads or writes.

The engine's two executors read these: the lockstep executor runs all
devices' instructions tick by tick in one loop (`LockstepSegments` cuts the
ticks into stretches and encodes each device's instruction at each tick as
a row of ints), the per-device executor runs each device's program in its
own loop and moves the transfers over channels, which deliver in send order
(`ChannelOrderHolds`).

    >>> from lingvo_gpipe.planning import schedule
    >>> table = schedule.BuildTable('gpipe', num_devices=2,
    ...                             num_micro_batches=2)
    >>> step = Lower(table, Edges(2, skips=()), remat='always',
    ...              training=True)
    >>> [name for name, _ in step.phases]
    ['forward', 'backward']
    >>> for t in step.transfers: print(t)
    data of edge 1, micro-batch 0: device 0 -> 1 at tick 0, slot 0
    data of edge 1, micro-batch 1: device 0 -> 1 at tick 1, slot 1
    grad of edge 1, micro-batch 1: device 1 -> 0 at tick 3, slot 0
    grad of edge 1, micro-batch 0: device 1 -> 0 at tick 4, slot 0
    >>> print(step.programs[1][0])  # Device 1's first instruction.
    tick 1: F1.0 recomputes, state slot 0, reads edge 1 slot 0, writes ...
"""

import dataclasses
import heapq
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from lingvo_gpipe.planning import schedule

F, B, W = schedule.FORWARD, schedule.BACKWARD, schedule.WEIGHT

# The kinds of buffers: an edge's tensors ('data') and their gradients
# ('grad'); a chunk's state before each call ('state'), what a call that
# keeps its activations stashes for its backward ('stash'), and, in a table
# that splits the backward, what each backward stashes for its weight
# gradient ('weight').
BUFFER_KINDS = ('data', 'grad', 'state', 'stash', 'weight')


class Edge(NamedTuple):
  """What travels from one chunk (or the input) to another (or the output).

  Attributes:
    source: The chunk that writes it, or None (the pipeline's input).
    target: The chunk that reads it, or None (the pipeline's output).
    skip: Whether it is a skip connection (the reader gets it as a tuple
      after its main inputs, the writer returns it after its main outputs).
  """
  source: Optional[int]
  target: Optional[int]
  skip: bool


def Edges(num_chunks: int,
          skips: Sequence[Tuple[int, Optional[int]]]) -> List[Edge]:
  """The input edge, the chunk-to-chunk and output edges, then the skips."""
  edges = [Edge(None, 0, False)]
  edges += [Edge(c, c + 1 if c + 1 < num_chunks else None, False)
            for c in range(num_chunks)]
  edges += [Edge(a, b, True) for a, b in skips]
  return edges


def AllocateSlots(intervals: Dict[int, Tuple[int, int]]
                 ) -> Tuple[int, Dict[int, int]]:
  """Assigns buffer slots to micro-batches live over [first, last] ticks.

  A slot is free again at the tick its last reader runs (a write after the
  read at the same tick is safe: buffers are values). Greedy by first tick,
  which uses as few slots as the most micro-batches live at once.

    >>> AllocateSlots({0: (0, 3), 1: (1, 2), 2: (2, 4)})
    (2, {0: 0, 1: 1, 2: 1})

  Args:
    intervals: {micro_batch: (tick of the write, tick of the last read)}.

  Returns:
    (number of slots, {micro_batch: slot}).
  """
  busy, free, slots, count = [], [], {}, 0
  for m, (first, last) in sorted(intervals.items(),
                                 key=lambda item: (item[1][0], item[0])):
    while busy and busy[0][0] <= first:
      heapq.heappush(free, heapq.heappop(busy)[1])
    if free:
      slot = heapq.heappop(free)
    else:
      slot, count = count, count + 1
    slots[m] = slot
    heapq.heappush(busy, (last, slot))
  return count, slots


@dataclasses.dataclass(frozen=True)
class Buffer:
  """Slots on one device, one micro-batch at a time in each.

  Attributes:
    kind: One of BUFFER_KINDS.
    index: The edge ('data', 'grad') or chunk (the other kinds) it serves.
    device: The device it lives on.
    size: Its number of slots (a spare one is added by the engine, for the
      writes of ticks that write nothing).
    slots: {micro_batch: slot}.
  """
  kind: str
  index: int
  device: int
  size: int
  slots: Dict[int, int]


class Transfer(NamedTuple):
  """An edge's tensors, or their gradients, of one micro-batch on the move.

  Attributes:
    kind: 'data' (forward, from the edge's source to its target) or 'grad'
      (backward, from its target to its source).
    edge: The edge.
    micro_batch: The micro-batch.
    source_device: The device that produces it.
    target_device: The device whose buffer receives it.
    tick: The tick of the action that produces it.
    slot: Its slot in the receiving buffer.
  """
  kind: str
  edge: int
  micro_batch: int
  source_device: int
  target_device: int
  tick: int
  slot: int

  def __str__(self) -> str:
    return (f'{self.kind} of edge {self.edge}, micro-batch '
            f'{self.micro_batch}: device {self.source_device} -> '
            f'{self.target_device} at tick {self.tick}, slot {self.slot}')


class Instruction(NamedTuple):
  """One action of a device's program, with the slots it uses.

  Attributes:
    tick: When it runs.
    action: The table's action.
    keeps: Whether the call keeps its activations (stashes them for its
      backward) instead of recomputing them there.
    state_slot: The slot of its chunk's state before the call.
    stash_slot: The slot of what a keeping call stashes (0 if none).
    weight_slot: In a table that splits the backward, the slot of what a
      backward stashes for its weight gradient, which reads it; else None.
    reads: (edge, slot) of each in-edge between chunks: where its inputs are.
    grad_reads: For a backward, (edge, slot) of each out-edge between
      chunks: where the gradients of its outputs are.
    writes: (edge, slot) of each out-edge whose buffer it fills: 'data' for
      a forward, 'grad' (of the in-edges) for a backward; none for a weight
      gradient.
  """
  tick: int
  action: schedule.Action
  keeps: bool
  state_slot: int
  stash_slot: int
  weight_slot: Optional[int]
  reads: Tuple[Tuple[int, int], ...]
  grad_reads: Tuple[Tuple[int, int], ...]
  writes: Tuple[Tuple[int, int], ...]

  @property
  def key(self) -> Tuple[str, int, bool]:
    """The code an instruction runs: (phase, chunk, keeps)."""
    return (self.action.phase, self.action.chunk, self.keeps)

  def __str__(self) -> str:
    parts = [f'tick {self.tick}: {self.action}']
    if self.action.phase != W:
      parts += ['keeps' if self.keeps else 'recomputes',
                f'state slot {self.state_slot}']
    if self.keeps:
      parts.append(f'stash slot {self.stash_slot}')
    if self.action.phase != F and self.weight_slot is not None:
      parts.append(f'weight slot {self.weight_slot}')
    parts += [f'reads edge {e} slot {s}' for e, s in self.reads]
    parts += [f'reads the gradient of edge {e} slot {s}'
              for e, s in self.grad_reads]
    parts += [f'writes edge {e} slot {s}' for e, s in self.writes]
    return parts[0] + ' ' + ', '.join(parts[1:])


def ForwardTicks(table: schedule.Table) -> Tuple[schedule.Tick, ...]:
  """The forward actions of a table alone, each on its earliest tick.

  What an evaluation step runs: each device takes its forwards in the
  table's order, and an action runs on the tick after the latest of its
  device's previous action and the previous chunk's forward of its
  micro-batch.

    >>> t = schedule.BuildTable('1f1b', num_devices=2, num_micro_batches=3)
    >>> [' '.join(str(a) if a else '-' for a in tick)
    ...  for tick in ForwardTicks(t)]
    ['F0.0 -', 'F0.1 F1.0', 'F0.2 F1.1', '- F1.2']

  Args:
    table: A validated table.

  Returns:
    The ticks, one entry per device each.
  """
  orders = [[a for a in order if a.phase == F]
            for order in table.device_orders]
  done, ticks, positions = {}, [], [0] * table.num_devices
  while any(p < len(o) for p, o in zip(positions, orders)):
    t = len(ticks)
    tick = [None] * table.num_devices
    for k, order in enumerate(orders):
      if positions[k] == len(order):
        continue
      action = order[positions[k]]
      previous = (action.chunk - 1, action.micro_batch)
      if action.chunk == 0 or done.get(previous, t) < t:
        tick[k] = action
    for k, action in enumerate(tick):
      if action is not None:
        done[action.chunk, action.micro_batch] = t
        positions[k] += 1
    ticks.append(tuple(tick))
  return tuple(ticks)


def BackwardReversesForward(table: schedule.Table, chunk: int) -> bool:
  """Whether `chunk`'s backwards take its micro-batches in reverse order.

  A chunk's state flows from micro-batch m to m + 1 in the forward pass, so
  the gradient of a differentiable state flows from m + 1 to m: with the loss
  outside, the backward of such a chunk must run in reverse order.
  """
  order = [a for o in table.device_orders for a in o if a.chunk == chunk]
  forward = [a.micro_batch for a in order if a.phase == F]
  return [a.micro_batch for a in order if a.phase == B] == forward[::-1]


class Step:
  """A table lowered for the loop engine (see the module docstring).

  Attributes:
    table: The schedule.
    edges: The step's edges.
    training: Whether it runs backward actions.
    recomputes: {(chunk, micro_batch): whether its backward recomputes}.
    ticks: The ticks it runs (an evaluation step: the forward actions
      alone, `ForwardTicks`); the step's own tick numbers index them.
    tick_of: {action: its tick}.
    phases: The passes the engine builds, (name, range of ticks):
      ('forward', ...) alone when not training; ('forward', ...),
      ('backward', ...) with the loss outside (the backward pass is the
      forward's gradient); ('step', ...) with the loss inside (forward and
      backward actions in one pass).
    buffers: {(kind, index): Buffer}, only those with slots.
    programs: Per device, its instructions in tick order.
    transfers: Every transfer between devices' buffers, in tick order.
  """

  def __init__(self, table: schedule.Table, edges: Sequence[Edge],
               recomputes: Dict[Tuple[int, int], bool], training: bool):
    self.table = table
    self.edges = list(edges)
    self.training = training
    self.recomputes = recomputes
    if not training:
      passes = [('forward', ForwardTicks(table))]
    elif table.loss_outside:  # Every forward precedes every other action.
      passes = [(phase, tuple(t for t in table.ticks if any(t) and forward ==
                              any(a.phase == F for a in t if a)))
                for phase, forward in (('forward', True), ('backward', False))]
    else:
      passes = [('step', tuple(t for t in table.ticks if any(t)))]
    self.ticks = tuple(tick for _, ticks in passes for tick in ticks)
    self.phases, start = [], 0
    for name, ticks in passes:
      self.phases.append((name, range(start, start + len(ticks))))
      start += len(ticks)
    self.tick_of = {a: t for t, tick in enumerate(self.ticks)
                    for a in tick if a}
    self.buffers = self._Buffers()
    self.programs = [[self._Instruction(self.tick_of[a], a)
                      for a in self._DeviceActions(k)]
                     for k in range(table.num_devices)]
    self.transfers = sorted(self._Transfers(), key=lambda t: t.tick)

  def _DeviceActions(self, k: int) -> List[schedule.Action]:
    return [tick[k] for tick in self.ticks if tick[k] is not None]

  def Device(self, kind: str, e_or_c: int) -> int:
    """The device of a buffer: data with its reader, grad with its writer.

    For an edge into the output, 'data' is on its writer's device; for the
    input edge, 'grad' on its reader's.
    """
    if kind in ('state', 'stash', 'weight'):
      return self.table.Device(e_or_c)
    edge = self.edges[e_or_c]
    chunk = edge.target if kind == 'data' else edge.source
    if chunk is None:
      chunk = edge.source if kind == 'data' else edge.target
    return self.table.Device(chunk)

  def Size(self, kind: str, index: int) -> int:
    buffer = self.buffers.get((kind, index))
    return buffer.size if buffer else 0

  def Slot(self, kind: str, index: int, micro_batch: int) -> int:
    buffer = self.buffers.get((kind, index))
    return buffer.slots.get(micro_batch, 0) if buffer else 0

  def _Buffers(self) -> Dict[Tuple[str, int], Buffer]:
    """Every buffer with its slots (see the class docstring).

    The output's tensors and the input's gradients get one slot per
    micro-batch (they are stacked after the step); every other buffer a slot
    per micro-batch live at once.
    """
    when = self.tick_of
    num_micro = self.table.num_micro_batches
    everyone = {m: m for m in range(num_micro)}
    live, fixed = {}, {}
    for c in range(self.table.num_chunks):
      for m in range(num_micro if self.training else 0):
        span = when[schedule.Action(F, c, m)], when[schedule.Action(B, c, m)]
        live.setdefault(('state', c), {})[m] = span
        if not self.recomputes[c, m]:
          live.setdefault(('stash', c), {})[m] = span
        if self.table.split_backward:
          live.setdefault(('weight', c), {})[m] = (
              span[1], when[schedule.Action(W, c, m)])
    for e, edge in enumerate(self.edges):
      if edge.target is None:
        fixed['data', e] = everyone
      elif edge.source is None:
        if self.training:
          fixed['grad', e] = everyone
      else:
        for m in range(num_micro):
          reader = schedule.Action(B if self.training else F, edge.target, m)
          live.setdefault(('data', e), {})[m] = (
              when[schedule.Action(F, edge.source, m)], when[reader])
          if self.training:
            live.setdefault(('grad', e), {})[m] = (
                when[schedule.Action(B, edge.target, m)],
                when[schedule.Action(B, edge.source, m)])
    sized = {key: (num_micro, slots) for key, slots in fixed.items()}
    sized.update({key: AllocateSlots(intervals)
                  for key, intervals in live.items()})
    return {(kind, index): Buffer(kind, index, self.Device(kind, index),
                                  size, slots)
            for (kind, index), (size, slots) in sized.items()}

  def _Instruction(self, tick: int, action: schedule.Action) -> Instruction:
    phase, c, m = action
    weight_slot = (self.Slot('weight', c, m) if self.table.split_backward and
                   self.training else None)
    if phase == W:  # It reads its weight stash alone.
      return Instruction(tick, action, False, 0, 0, weight_slot, (), (), ())
    keeps = self.training and not self.recomputes[c, m]
    reads = tuple((e, self.Slot('data', e, m))
                  for e, edge in enumerate(self.edges)
                  if edge.target == c and edge.source is not None)
    grad_reads = ()
    if phase == F:
      writes = tuple((e, self.Slot('data', e, m))
                     for e, edge in enumerate(self.edges) if edge.source == c)
    else:
      grad_reads = tuple((e, self.Slot('grad', e, m))
                         for e, edge in enumerate(self.edges)
                         if edge.source == c and edge.target is not None)
      writes = tuple((e, self.Slot('grad', e, m))
                     for e, edge in enumerate(self.edges)
                     if edge.target == c and ('grad', e) in self.buffers)
    return Instruction(tick, action, keeps, self.Slot('state', c, m),
                       self.Slot('stash', c, m) if keeps else 0, weight_slot,
                       reads, grad_reads, writes)

  def _Transfers(self) -> List[Transfer]:
    transfers = []
    for program in self.programs:
      for instruction in program:
        phase, c, m = instruction.action
        for e, slot in instruction.writes:
          edge = self.edges[e]
          kind = 'data' if phase == F else 'grad'
          receiver = edge.target if phase == F else edge.source
          if receiver is None:
            continue
          transfers.append(Transfer(
              kind, e, m, self.table.Device(c), self.table.Device(receiver),
              instruction.tick, slot))
    return transfers

  def ChannelOrderHolds(self) -> bool:
    """Whether each edge's transfers are read in the order they are sent.

    A channel delivers in send order: the per-device executor can move an
    edge's transfers over one only if its reader's actions take them in
    that order (all built-in tables do).

    Returns:
      True if, per edge and kind, the readers' ticks are in send order.
    """
    for kind, phase in (('data', F), ('grad', B)):
      for e, edge in enumerate(self.edges):
        sent = [t.micro_batch for t in self.transfers
                if t.kind == kind and t.edge == e]
        reader = edge.target if kind == 'data' else edge.source
        read = sorted(sent, key=lambda m, r=reader: self.tick_of[
            schedule.Action(phase, r, m)])
        if sent != read:
          return False
    return True


def Lower(table: schedule.Table, edges: Sequence[Edge], remat: str,
          training: bool) -> Step:
  """Lowers a validated table for the loop engine.

  Args:
    table: The schedule.
    edges: The step's edges (`Edges`).
    remat: One of `schedule.REMAT_MODES`; an evaluation step keeps nothing.
    training: Whether the step runs the table's backward actions.

  Returns:
    The lowered `Step`.

  Raises:
    ValueError: on an unknown remat mode.
  """
  recomputes = schedule.RecomputedCalls(table, remat if training else 'always')
  return Step(table, edges, recomputes, training)
