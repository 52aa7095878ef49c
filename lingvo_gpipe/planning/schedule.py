"""Pipeline schedules as data: one table per schedule, and its validator.

Pure Python, no TensorFlow. A schedule is a `Table`: per clock tick, per
device, at most one `Action` (a phase of one chunk on one micro-batch). The
cells are cut into C = K * v chunks, and the table places each chunk on a
device (`Table.placement`). By default chunk c runs on device c mod K, so
with v > 1 virtual stages a micro-batch passes the devices v times (the
circular order of Praxis); any other placement is expressible, e.g. a
V-shaped one, chunks c and 2K - 1 - c on one device. Every reader of a step
takes its order from a table: both engines build their calls from it, the
simulator times it, the memory model walks it, the timeline draws it.
`Validate` checks every table before use.

    >>> table = BuildTable('gpipe', num_devices=2, num_micro_batches=2)
    >>> print(table)
    gpipe: K=2 v=1 M=2, 6 ticks
    device 0: F0.0 F0.1    -    - B0.1 B0.0
    device 1:    - F1.0 F1.1 B1.1 B1.0    -
    >>> table.ticks[2]  # Device 0 idle, device 1's forward of micro-batch 1.
    (None, Action(phase='forward', chunk=1, micro_batch=1))

(`F<chunk>.<micro-batch>` is a forward, `B...` a backward, `-` idle.) A
table may split each backward in two (`Table.split_backward`, zero bubble
schedules): `B...` is then the input gradient, `W...` the weight gradient.
The rule of which calls re-materialize, the engines' names and 'auto' live
here too, so that there is one definition of each.
"""

import collections
import dataclasses
import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from lingvo_gpipe.planning import checks

# Which stage calls recompute their forward pass in the backward pass.
REMAT_MODES = ('always', 'except_last', 'never')

# The phases an `Action` of a table can have.
FORWARD = 'forward'
# The whole backward of a call, recompute included; in a table that splits
# the backward (`Table.split_backward`), the gradients of the call's inputs
# and state only (recompute included), on the critical path.
BACKWARD = 'backward'
# The gradients of the call's weights, in a table that splits the backward:
# on the chunk's device, on a later tick than the call's BACKWARD, needed by
# nobody but the optimizer. It never recomputes the forward.
WEIGHT = 'weight'
ACTION_PHASES = (FORWARD, BACKWARD, WEIGHT)

# The phases of a stage call as they run and are timed (`simulate.Event`): a
# backward action that re-materializes runs 'recompute', then 'backward'; a
# weight action runs 'weight'.
PHASES = ('forward', 'recompute', 'backward', 'weight')

# The engines that build a step (see lingvo_gpipe.engine), and 'auto'.
ENGINES = ('unrolled', 'loop')
# 'auto' weighs the two engines' costs over a training run of this many steps
# (docs/engines.md#choosing-an-engine): the unrolled engine starts later by
# about UNROLLED_START_SECONDS x (v M)^2 (Grappler's passes over each
# device's chain of v M calls grow with its square; measured in graph mode
# on 2 vCPU, K in {2, 4, 8}, M in {16, ..., 128}), the loop engine steps
# slower by about LOOP_TICK_SECONDS per tick of the table.
AUTO_TRAINING_STEPS = 10_000
UNROLLED_START_SECONDS = 4e-3
LOOP_TICK_SECONDS = 5e-5


class Action(NamedTuple):
  """What one device does at one tick: a phase of a chunk on a micro-batch."""
  phase: str  # One of ACTION_PHASES.
  chunk: int
  micro_batch: int

  def __str__(self) -> str:
    return f'{self.phase[0].upper()}{self.chunk}.{self.micro_batch}'


Tick = Tuple[Optional[Action], ...]


class TableError(ValueError):
  """A table that breaks a rule of `Validate`."""


@dataclasses.dataclass(frozen=True)
class Table:
  """One training step as data: what every device does at every tick.

  Attributes:
    schedule: The name of the schedule that made it (a key of `SCHEDULES`).
    num_devices: K.
    num_micro_batches: M.
    virtual_stages: v; the step has K * v chunks (v per device on average).
    loss_outside: Whether the loss is computed after the pipeline from all
      micro-batches' outputs (GPipe), so that no backward action may run
      before every forward of the last chunk.
    ticks: ticks[t][k] is device k's action at tick t, or None (idle).
    placement: placement[c] is the device that runs chunk c: K * v ints in
      [0, K), every device running at least one chunk. Given as () (the
      default), it becomes the default placement, chunk c on device c mod K
      (`DefaultPlacement`).
  """
  schedule: str
  num_devices: int
  num_micro_batches: int
  virtual_stages: int
  loss_outside: bool
  ticks: Tuple[Tick, ...]
  placement: Tuple[int, ...] = ()

  def __post_init__(self):
    # Sizes that are not ints keep () for `Validate` to reject them.
    if not self.placement and isinstance(self.num_chunks, int):
      object.__setattr__(
          self, 'placement',
          DefaultPlacement(self.num_devices, self.virtual_stages))

  @property
  def num_chunks(self) -> int:
    """C = K * v."""
    return self.num_devices * self.virtual_stages

  def Device(self, chunk: int) -> int:
    """The device that runs `chunk`: placement[chunk]."""
    return self.placement[chunk]

  @functools.cached_property
  def device_chunks(self) -> Tuple[Tuple[int, ...], ...]:
    """Per device, the chunks it runs, in increasing order."""
    return tuple(
        tuple(c for c, d in enumerate(self.placement) if d == k)
        for k in range(self.num_devices))

  @functools.cached_property
  def split_backward(self) -> bool:
    """Whether the table splits each backward into BACKWARD and WEIGHT.

    It does iff it has a WEIGHT action; `Validate` then checks that every
    call has exactly one, on its chunk's device, after its BACKWARD. Its
    BACKWARD actions compute the gradients of the calls' inputs (and state)
    only, its WEIGHT actions those of their weights.
    """
    return any(a is not None and a.phase == WEIGHT
               for tick in self.ticks for a in tick)

  @functools.cached_property
  def tick_of(self) -> Dict[Action, int]:
    """The tick of every action."""
    return {a: t for t, tick in enumerate(self.ticks) for a in tick if a}

  @functools.cached_property
  def device_orders(self) -> Tuple[Tuple[Action, ...], ...]:
    """Per device, its actions in the order they run."""
    return tuple(
        tuple(tick[k] for tick in self.ticks if tick[k] is not None)
        for k in range(self.num_devices))

  def PhaseRuns(self) -> List[Tuple[str, Tuple[Tick, ...]]]:
    """The ticks cut into maximal runs of one phase.

    Returns:
      (phase, ticks) pairs in order; for GPipe tables exactly two, all
      forward ticks, then all backward ticks.

    Raises:
      TableError: if a tick mixes phases (an engine that runs each phase as
        its own pass cannot run such a table).
    """
    runs = []
    for t, tick in enumerate(self.ticks):
      phases = sorted({a.phase for a in tick if a is not None})
      if len(phases) > 1:
        raise TableError(
            f'{self.schedule} table, tick {t}: mixes phases {phases}; an '
            'engine that runs all forward ticks, then all backward ticks, '
            'cannot run it.')
      if not phases:
        continue
      if runs and runs[-1][0] == phases[0]:
        runs[-1][1].append(tick)
      else:
        runs.append((phases[0], [tick]))
    return [(phase, tuple(ticks)) for phase, ticks in runs]

  def __str__(self) -> str:
    width = max(len(str(a)) for tick in self.ticks for a in tick if a)
    header = (f'{self.schedule}: K={self.num_devices} '
              f'v={self.virtual_stages} M={self.num_micro_batches}')
    if self.placement != DefaultPlacement(self.num_devices,
                                          self.virtual_stages):
      header += f' placement={self.placement}'
    lines = [f'{header}, {len(self.ticks)} ticks']
    for k in range(self.num_devices):
      cells = [str(tick[k]) if tick[k] else '-' for tick in self.ticks]
      lines.append(f'device {k}: ' + ' '.join(c.rjust(width) for c in cells))
    return '\n'.join(lines)


def DefaultPlacement(num_devices: int,
                     virtual_stages: int) -> Tuple[int, ...]:
  """Chunk c on device c mod K: (0, 1, ..., K - 1) repeated v times."""
  return tuple(c % num_devices
               for c in range(num_devices * virtual_stages))


class _Index:
  """Numbers the actions of a step 0 .. P C M - 1, for flat lists.

  P = 2 phases (forward, backward), or 3 if the step splits the backward
  (weight too): ids phase by phase, chunk by chunk, micro-batch by
  micro-batch.
  """

  def __init__(self, num_chunks: int, num_micro_batches: int,
               split_backward: bool = False):
    self.num_chunks = num_chunks
    self.num_micro = num_micro_batches
    self.per_phase = num_chunks * num_micro_batches
    self.size = (3 if split_backward else 2) * self.per_phase

  def Id(self, action: Action) -> int:
    phase = ACTION_PHASES.index(action.phase)
    return (phase * self.num_chunks + action.chunk) * self.num_micro + (
        action.micro_batch)

  def IsBackward(self, i: int) -> bool:
    """Whether id i is a BACKWARD action."""
    return self.per_phase <= i < 2 * self.per_phase

  def Action(self, i: int) -> Action:
    rest, m = divmod(i, self.num_micro)
    phase, c = divmod(rest, self.num_chunks)
    return Action(ACTION_PHASES[phase], c, m)

  def Dependencies(self, i: int) -> List[int]:
    """The actions action `i` needs on an earlier tick (loss excluded)."""
    per_phase = self.per_phase
    if i < per_phase:  # Forward of (c, m): the previous chunk's forward.
      return [i - self.num_micro] if i >= self.num_micro else []
    deps = [i - per_phase]  # Its own forward (weight: its own backward).
    if i + self.num_micro < 2 * per_phase:  # A backward, not the last chunk.
      deps.append(i + self.num_micro)
    return deps

  def LastChunkForwards(self) -> range:
    first = (self.num_chunks - 1) * self.num_micro
    return range(first, first + self.num_micro)


def _CheckPlacement(placement: Tuple[int, ...], num_devices: int,
                    num_chunks: int) -> None:
  """Raises TableError unless `placement` is a valid one (see `Validate`)."""
  if not isinstance(placement, tuple) or len(placement) != num_chunks:
    raise TableError(f'placement={placement!r} must be a tuple of '
                     f'{num_chunks} devices, one per chunk (K * v).')
  for c, device in enumerate(placement):
    if (not isinstance(device, int) or isinstance(device, bool) or
        not 0 <= device < num_devices):
      raise TableError(f'placement={placement}: chunk {c} is on '
                       f'device {device!r}; a device is an int in '
                       f'[0, {num_devices}).')
  idle = sorted(set(range(num_devices)) - set(placement))
  if idle:
    raise TableError(f'placement={placement} gives device {idle[0]} no chunk; '
                     'every device (pipeline stage) runs at least one.')


def Validate(table: Table) -> Table:
  """Checks that a table is a correct training step; returns it.

  The rules: the placement has one device in [0, K) per chunk, and every
  device runs at least one chunk (a device without one would be a pipeline
  stage with nothing to do); every tick has one entry per device; an entry
  is None or an Action of a known phase on a chunk that the placement puts
  on that device and a micro-batch in [0, M); each (chunk, micro-batch) runs
  forward once and backward once; a chunk's forward of m comes on a later
  tick than the previous chunk's forward of m; its backward on a later tick
  than the next chunk's backward of m and than its own forward; with the
  loss outside the pipeline, no backward before every forward of the last
  chunk has run. A table that has a WEIGHT action splits the backward
  (`Table.split_backward`): then each (chunk, micro-batch) also runs its
  weight gradient once, on a later tick than its backward (on its chunk's
  device, as every action); a table of a named schedule (`SCHEDULES`) splits
  the backward iff the schedule does.

  Args:
    table: The table.

  Returns:
    The same table.

  Raises:
    TableError: naming the placement and its bad entry, or the tick, the
      device and the action that break a rule.
  """
  k_devices, num_micro = table.num_devices, table.num_micro_batches
  checks.CheckPositiveInt('num_devices', k_devices)
  checks.CheckPositiveInt('virtual_stages', table.virtual_stages)
  checks.CheckPositiveInt('num_micro_batches', num_micro)
  num_chunks = table.num_chunks
  _CheckPlacement(table.placement, k_devices, num_chunks)
  for t, tick in enumerate(table.ticks):
    if len(tick) != k_devices:
      raise TableError(f'tick {t} has {len(tick)} entries, expected one per '
                       f'device ({k_devices}).')
  split = any(isinstance(a, Action) and a.phase == WEIGHT
              for tick in table.ticks for a in tick)
  named = SCHEDULES.get(table.schedule)
  if named is not None and named.split_backward != split:
    if split:
      first = next(a for tick in table.ticks for a in tick
                   if isinstance(a, Action) and a.phase == WEIGHT)
      raise TableError(
          f'{table.schedule} table: {first!r} is a weight-gradient action, '
          f'but schedule {table.schedule!r} does not split the backward '
          '(its BACKWARD actions compute the weight gradients too).')
    raise TableError(
        f'{table.schedule} table has no weight-gradient action, but schedule '
        f'{table.schedule!r} splits the backward: every call runs W once.')
  index = _Index(num_chunks, num_micro, split)
  tick_of, device_of = [-1] * index.size, [-1] * index.size
  for t, tick in enumerate(table.ticks):
    for k, action in enumerate(tick):
      if action is None:
        continue
      if not isinstance(action, Action) or action.phase not in ACTION_PHASES:
        raise TableError(f'tick {t}, device {k}: {action!r} is not an Action '
                         f'with a phase in {list(ACTION_PHASES)}.')
      if not 0 <= action.chunk < num_chunks:
        raise TableError(f'tick {t}, device {k}: {action!r}: chunk '
                         f'{action.chunk} is outside [0, {num_chunks}).')
      if table.Device(action.chunk) != k:
        raise TableError(f'tick {t}, device {k}: {action!r}: chunk '
                         f'{action.chunk} does not run on device {k}: '
                         f'placement={table.placement} puts it on device '
                         f'{table.Device(action.chunk)}.')
      if not 0 <= action.micro_batch < num_micro:
        raise TableError(f'tick {t}, device {k}: {action!r}: micro-batch '
                         f'{action.micro_batch} is outside [0, {num_micro}).')
      i = index.Id(action)
      if tick_of[i] >= 0:
        raise TableError(f'tick {t}, device {k}: {action!r} runs again '
                         f'(first at tick {tick_of[i]}).')
      tick_of[i], device_of[i] = t, k
  if -1 in tick_of:
    raise TableError(
        f'{index.Action(tick_of.index(-1))!r} never runs; every chunk runs '
        'forward and backward once per micro-batch' +
        (', and, as the table splits the backward (it has a W action), its '
         'weight gradient once.' if split else '.'))
  last_forward = max(tick_of[i] for i in index.LastChunkForwards())
  for t, i in sorted((t, i) for i, t in enumerate(tick_of)):
    for dep in index.Dependencies(i):
      if tick_of[dep] >= t:
        raise TableError(
            f'tick {t}, device {device_of[i]}: {index.Action(i)!r} runs '
            f'before {index.Action(dep)!r} (tick {tick_of[dep]}), which it '
            'needs.')
    if table.loss_outside and index.IsBackward(i) and t <= last_forward:
      raise TableError(
          f'tick {t}, device {device_of[i]}: {index.Action(i)!r} runs before '
          f'the last forward of the last chunk (tick {last_forward}); with '
          'the loss outside the pipeline every backward comes after it.')
  return table


def TableFromOrders(schedule: str, num_devices: int, num_micro_batches: int,
                    virtual_stages: int, loss_outside: bool,
                    orders: Sequence[Sequence[Action]],
                    placement: Optional[Sequence[int]] = None) -> Table:
  """Places each device's actions, in its order, on the earliest tick.

  An action's tick is one more than the latest of: the device's previous
  action, the actions it needs (see `Validate`) and, with the loss outside,
  the last forward of the last chunk. With unit-time actions this is when
  they would run. A V-shaped step of K = 2, v = 2 (chunks 0 and 3 on device
  0), one micro-batch:

      >>> F, B = FORWARD, BACKWARD
      >>> print(TableFromOrders(
      ...     'v-shape', num_devices=2, num_micro_batches=1, virtual_stages=2,
      ...     loss_outside=True, placement=(0, 1, 1, 0),
      ...     orders=[[Action(F, 0, 0), Action(F, 3, 0), Action(B, 3, 0),
      ...              Action(B, 0, 0)],
      ...             [Action(F, 1, 0), Action(F, 2, 0), Action(B, 2, 0),
      ...              Action(B, 1, 0)]]))
      v-shape: K=2 v=2 M=1 placement=(0, 1, 1, 0), 8 ticks
      device 0: F0.0    -    - F3.0 B3.0    -    - B0.0
      device 1:    - F1.0 F2.0    -    - B2.0 B1.0    -

  Args:
    schedule: The schedule's name.
    num_devices: K.
    num_micro_batches: M.
    virtual_stages: v.
    loss_outside: See `Table`.
    orders: Per device, its actions in the order it runs them; together
      every action of the step once.
    placement: Per chunk, its device (see `Table`); None: chunk c on device
      c mod K.

  Returns:
    The validated table.

  Raises:
    TableError: if the orders deadlock (an action waits for one that its
      device runs later) or break a rule of `Validate`.
  """
  num_chunks = num_devices * virtual_stages
  split = any(a.phase == WEIGHT for order in orders for a in order)
  index = _Index(num_chunks, num_micro_batches, split)
  # Kahn's algorithm over action ids; id `loss` stands for the loss, which
  # needs every forward of the last chunk and which every backward needs.
  loss = index.size
  needs = [0] * (index.size + 1)
  followers = [[] for _ in range(index.size + 1)]
  ids = [[index.Id(a) for a in order] for order in orders]
  for order in ids:
    for position, i in enumerate(order):
      preds = index.Dependencies(i)
      if position:
        preds.append(order[position - 1])
      if loss_outside and index.IsBackward(i):
        preds.append(loss)
      needs[i] += len(preds)
      for pred in preds:
        followers[pred].append(i)
  if loss_outside:
    for i in index.LastChunkForwards():
      needs[loss] += 1
      followers[i].append(loss)
  earliest = [0] * (index.size + 1)
  ready = [i for order in ids for i in order[:1] if not needs[i]]
  if loss_outside and not needs[loss]:
    ready.append(loss)
  placed = 0
  while ready:
    node = ready.pop()
    placed += 1
    # The loss takes no tick: a backward may run right after the last forward.
    after = earliest[node] + (node != loss)
    for follower in followers[node]:
      if earliest[follower] < after:
        earliest[follower] = after
      needs[follower] -= 1
      if not needs[follower]:
        ready.append(follower)
  total = sum(len(order) for order in ids) + loss_outside
  if placed != total:
    waiting = [index.Action(i) for order in ids for i in order if needs[i]]
    raise TableError(f'{schedule} orders deadlock: {len(waiting)} actions '
                     f'wait for each other, e.g. {waiting[:3]}.')
  num_ticks = 1 + max((earliest[i] for order in ids for i in order),
                      default=-1)
  ticks = [[None] * num_devices for _ in range(num_ticks)]
  for k, order in enumerate(orders):
    for action, i in zip(order, ids[k]):
      ticks[earliest[i]][k] = action
  return Validate(
      Table(schedule=schedule, num_devices=num_devices,
            num_micro_batches=num_micro_batches,
            virtual_stages=virtual_stages, loss_outside=loss_outside,
            ticks=tuple(tuple(tick) for tick in ticks),
            placement=() if placement is None else tuple(placement)))


def _GPipeOrders(num_devices: int, num_micro_batches: int,
                 virtual_stages: int) -> List[List[Action]]:
  """Each device's actions in GPipe order, circular when v > 1.

  Forward: the micro-batches go in groups of K (the last group may be
  smaller); each group passes the devices v times, so device k runs chunk
  k, then chunk K + k, ... on the group's micro-batches before the next group
  starts. Backward: the same actions in reverse order.

  Args:
    num_devices: K.
    num_micro_batches: M.
    virtual_stages: v.

  Returns:
    Per device, its forward actions, then its backward actions.
  """
  orders = []
  for k in range(num_devices):
    forward = []
    for group in range(0, num_micro_batches, num_devices):
      members = range(group, min(group + num_devices, num_micro_batches))
      for r in range(virtual_stages):
        forward += [Action(FORWARD, r * num_devices + k, m) for m in members]
    orders.append(forward +
                  [Action(BACKWARD, a.chunk, a.micro_batch)
                   for a in reversed(forward)])
  return orders


def GPipeTable(num_devices: int, num_micro_batches: int,
               virtual_stages: int = 1) -> Table:
  """The GPipe step: all forwards, then the loss, then all backwards.

  With v = 1, device k runs micro-batch t - k at forward tick t (M + K - 1
  ticks), and the backward ticks mirror the forward ones. With v > 1 the
  order is circular (`_GPipeOrders`): M v + K - 1 forward ticks of chunks a
  v-th the size, so the bubble falls to (K - 1) / (M v + K - 1) when K
  divides M.

  Args:
    num_devices: K.
    num_micro_batches: M.
    virtual_stages: v.

  Returns:
    The validated table.

  Raises:
    ValueError: if K, M or v is not a positive int.
  """
  checks.CheckPositiveInt('num_devices', num_devices)
  checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
  checks.CheckPositiveInt('virtual_stages', virtual_stages)
  return TableFromOrders(
      'gpipe', num_devices=num_devices, num_micro_batches=num_micro_batches,
      virtual_stages=virtual_stages, loss_outside=True,
      orders=_GPipeOrders(num_devices, num_micro_batches, virtual_stages))


def _OneFOneBOrders(num_devices: int, num_micro_batches: int,
                    virtual_stages: int) -> List[List[Action]]:
  """Each device's actions in 1F1B order; Megatron's interleaving if v > 1.

  The forward of virtual micro-batch i (i < M v) on device k runs chunk
  r K + k, r = (i mod K v) // K, on micro-batch (i // K v) K + i mod K; its
  backward takes the chunks in the reverse order. A device first runs its
  warm-up forwards (K - k - 1 with v = 1; 2 (K - k - 1) + (v - 1) K with
  v > 1, all of them when M = K), then alternates one forward and one
  backward, then runs the remaining backwards: it holds at most the
  warm-up + 1 micro-batches in flight, whatever M.

  Args:
    num_devices: K.
    num_micro_batches: M (a multiple of K when v > 1).
    virtual_stages: v.

  Returns:
    Per device, its actions in order.
  """
  k_devices, v = num_devices, virtual_stages
  total = num_micro_batches * v

  def Chunk(i, k, forward):
    r = (i % (k_devices * v)) // k_devices
    return (r if forward else v - 1 - r) * k_devices + k

  def MicroBatch(i):
    return (i // (k_devices * v)) * k_devices + i % k_devices

  orders = []
  for k in range(k_devices):
    if v == 1:
      warmup = k_devices - k - 1
    elif num_micro_batches == k_devices:
      warmup = total
    else:
      warmup = 2 * (k_devices - k - 1) + (v - 1) * k_devices
    warmup = min(warmup, total)
    order = [Action(FORWARD, Chunk(i, k, True), MicroBatch(i))
             for i in range(warmup)]
    for i in range(total - warmup):
      order.append(Action(FORWARD, Chunk(warmup + i, k, True),
                          MicroBatch(warmup + i)))
      order.append(Action(BACKWARD, Chunk(i, k, False), MicroBatch(i)))
    order += [Action(BACKWARD, Chunk(i, k, False), MicroBatch(i))
              for i in range(total - warmup, total)]
    orders.append(order)
  return orders


def OneFOneBTable(num_devices: int, num_micro_batches: int,
                  virtual_stages: int = 1) -> Table:
  """1F1B (PipeDream-Flush), interleaved (Megatron) when v > 1.

  The loss is inside the pipeline (the last chunk computes it), so a
  micro-batch's backward starts as soon as its forward reaches the loss:
  device k holds at most K - k micro-batches in flight (v = 1), and the
  bubble is GPipe's, (K - 1) / (M v + K - 1) with equal chunks.

  Args:
    num_devices: K.
    num_micro_batches: M; with v > 1 a multiple of K.
    virtual_stages: v.

  Returns:
    The validated table.

  Raises:
    ValueError: if K, M or v is not a positive int, or v > 1 and K does not
      divide M.
  """
  _Check1F1BSizes(num_devices, num_micro_batches, virtual_stages)
  return TableFromOrders(
      '1f1b', num_devices=num_devices, num_micro_batches=num_micro_batches,
      virtual_stages=virtual_stages, loss_outside=False,
      orders=_OneFOneBOrders(num_devices, num_micro_batches, virtual_stages))


def _CheckSizes(num_devices: int, num_micro_batches: int,
                virtual_stages: int) -> None:
  """ValueError naming the first of K, M, v that is not a positive int."""
  checks.CheckPositiveInt('num_devices', num_devices)
  checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
  checks.CheckPositiveInt('virtual_stages', virtual_stages)


def _CheckGPipeSizes(num_devices: int, num_micro_batches: int,
                     virtual_stages: int) -> None:
  """GPipe runs any positive K, M and v."""
  _CheckSizes(num_devices, num_micro_batches, virtual_stages)


def _Check1F1BSizes(num_devices: int, num_micro_batches: int,
                    virtual_stages: int) -> None:
  """1F1B runs any positive K, M with v = 1; with v > 1, K must divide M."""
  _CheckSizes(num_devices, num_micro_batches, virtual_stages)
  if virtual_stages > 1 and num_micro_batches % num_devices:
    raise ValueError(
        f'num_micro_batches={num_micro_batches} with schedule=\'1f1b\' and '
        f'virtual_stages={virtual_stages} must be a multiple of num_stages='
        f'{num_devices} (interleaved 1F1B runs groups of K micro-batches).')


def _CheckZB1PSizes(num_devices: int, num_micro_batches: int,
                    virtual_stages: int) -> None:
  """ZB-H1 runs any positive K and M, with v = 1 (not interleaved)."""
  _CheckSizes(num_devices, num_micro_batches, virtual_stages)
  if virtual_stages != 1:
    raise ValueError(
        f"virtual_stages={virtual_stages} is not supported with schedule="
        "'zb1p' (ZB-H1 runs one chunk per device); use virtual_stages=1, or "
        "schedule='zbv' for two chunks per device.")


def _CheckZBVSizes(num_devices: int, num_micro_batches: int,
                   virtual_stages: int) -> None:
  """ZB-V runs any positive K and M, with exactly v = 2 (the V)."""
  _CheckSizes(num_devices, num_micro_batches, virtual_stages)
  if virtual_stages != 2:
    raise ValueError(
        f"virtual_stages={virtual_stages} is not supported with schedule="
        "'zbv', whose two chunks per device form a V (chunk c on device c "
        "and chunk 2K - 1 - c on device c); use virtual_stages=2.")


def VPlacement(num_devices: int) -> Tuple[int, ...]:
  """The V of 2K chunks: chunk c on device c for c < K, else 2K - 1 - c.

      >>> VPlacement(3)
      (0, 1, 2, 2, 1, 0)
  """
  return tuple(range(num_devices)) + tuple(reversed(range(num_devices)))


def _WeightDeferrer(order: List[Action], deferred: int):
  """A function that appends a backward, then the oldest waiting weight.

  The weight gradient of a backward waits until more than `deferred`
  backwards of the device are waiting for theirs; the order's end runs the
  rest (`Flush`).

  Args:
    order: The device's order, appended to.
    deferred: How many weight gradients may wait at most after a backward.

  Returns:
    (Backward(chunk, m), Flush()): functions that append to `order`.
  """
  waiting = collections.deque()

  def Backward(chunk: int, micro_batch: int) -> None:
    order.append(Action(BACKWARD, chunk, micro_batch))
    waiting.append((chunk, micro_batch))
    if len(waiting) > deferred:
      order.append(Action(WEIGHT, *waiting.popleft()))

  def Flush() -> None:
    while waiting:
      order.append(Action(WEIGHT, *waiting.popleft()))

  return Backward, Flush


def _ZB1POrders(num_devices: int,
                num_micro_batches: int) -> List[List[Action]]:
  """Each device's actions in ZB-H1 order (Qi et al. 2024, section 3.1).

  The forwards and backwards (input gradients) of 1F1B, in its order:
  device k runs min(K - k - 1, M) warm-up forwards, then alternates one
  forward and one backward, then runs the remaining backwards. Each backward
  is followed by the weight gradient of the device's oldest backward still
  waiting for it, once more than k wait: device k defers k weight gradients,
  which fill the bubbles of its drain, where 1F1B idles waiting for the
  backwards of the later devices; the last k run at the end. Device k holds
  the activations of at most K - k micro-batches (as with 1F1B) and the
  weight-gradient stashes of at most k + 1.

  Args:
    num_devices: K.
    num_micro_batches: M.

  Returns:
    Per device, its actions in order.
  """
  orders = []
  for k in range(num_devices):
    warmup = min(num_devices - k - 1, num_micro_batches)
    order = [Action(FORWARD, k, m) for m in range(warmup)]
    backward, flush = _WeightDeferrer(order, k)
    for m in range(num_micro_batches - warmup):
      order.append(Action(FORWARD, k, warmup + m))
      backward(k, m)
    for m in range(num_micro_batches - warmup, num_micro_batches):
      backward(k, m)
    flush()
    orders.append(order)
  return orders


def ZB1PTable(num_devices: int, num_micro_batches: int,
              virtual_stages: int = 1) -> Table:
  """ZB-H1: 1F1B with the backward split and the weight gradients deferred.

  The loss is inside the pipeline. Each backward computes the input
  gradients only (B); the weight gradients (W) run later on the same device
  (`_ZB1POrders`), in what 1F1B leaves idle. With F = B = W the bubble falls
  from 1F1B's (K - 1) / (M + K - 1) to about a third of it, at 1F1B's
  activation memory. Any K, M >= 1:

      >>> print(ZB1PTable(2, 3))
      zb1p: K=2 v=1 M=3, 10 ticks
      device 0: F0.0 F0.1    - B0.0 W0.0 F0.2 B0.1 W0.1 B0.2 W0.2
      device 1:    - F1.0 B1.0 F1.1 B1.1 W1.0 F1.2 B1.2 W1.1 W1.2

  Args:
    num_devices: K.
    num_micro_batches: M.
    virtual_stages: v; must be 1.

  Returns:
    The validated table.

  Raises:
    ValueError: if K, M or v is not a positive int, or v != 1.
  """
  _CheckZB1PSizes(num_devices, num_micro_batches, virtual_stages)
  return TableFromOrders(
      'zb1p', num_devices=num_devices, num_micro_batches=num_micro_batches,
      virtual_stages=1, loss_outside=False,
      orders=_ZB1POrders(num_devices, num_micro_batches))


def _ZBVOrders(num_devices: int,
               num_micro_batches: int) -> List[List[Action]]:
  """Each device's actions in ZB-V order (Qi et al. 2024, section 6).

  Device k runs chunk a = k (down the V) and chunk b = 2K - 1 - k (back up).
  The order is built for n = max(M, 2K - 1) micro-batches, so that the
  pipeline fills, and the actions of micro-batches M .. n - 1 are dropped
  (each depends only on actions of its own micro-batch, so what is left
  cannot deadlock either):

  * warm-up: 2 (K - k) - 1 forwards of a; k times a forward of b, then one
    of a; K - k times a forward of b, its backward and its weight gradient;
  * steady: while a has forwards left or b has fewer forwards than a: a
    forward of a (if left), a's next backward and weight gradient, then a
    forward of b, its backward and weight gradient;
  * drain: k times the next backwards of a and b; K - k times a backward of
    a and a's oldest waiting weight gradient; then b's and a's remaining
    weight gradients, which fill the drain's bubbles.

  Args:
    num_devices: K.
    num_micro_batches: M.

  Returns:
    Per device, its actions in order.
  """
  k_devices = num_devices
  n = max(num_micro_batches, 2 * k_devices - 1)
  orders = []
  for k in range(k_devices):
    a, b = k, 2 * k_devices - 1 - k
    order = []
    count = {(phase, c): 0 for phase in ACTION_PHASES for c in (a, b)}

    def Run(phase, chunk, order=order, count=count):
      order.append(Action(phase, chunk, count[phase, chunk]))
      count[phase, chunk] += 1

    for _ in range(2 * (k_devices - k) - 1):
      Run(FORWARD, a)
    for _ in range(k):
      Run(FORWARD, b)
      Run(FORWARD, a)
    for _ in range(k_devices - k):
      Run(FORWARD, b)
      Run(BACKWARD, b)
      Run(WEIGHT, b)
    while count[FORWARD, a] < n or count[FORWARD, b] < count[FORWARD, a]:
      if count[FORWARD, a] < n:
        Run(FORWARD, a)
      Run(BACKWARD, a)
      Run(WEIGHT, a)
      Run(FORWARD, b)
      Run(BACKWARD, b)
      Run(WEIGHT, b)
    for _ in range(k):
      Run(BACKWARD, a)
      Run(BACKWARD, b)
    for _ in range(k_devices - k):
      Run(BACKWARD, a)
      Run(WEIGHT, a)
    for chunk in (b, a):
      while count[WEIGHT, chunk] < count[BACKWARD, chunk]:
        Run(WEIGHT, chunk)
    assert all(count[phase, c] == n for phase in ACTION_PHASES
               for c in (a, b)), count
    orders.append([x for x in order if x.micro_batch < num_micro_batches])
  return orders


def ZBVTable(num_devices: int, num_micro_batches: int,
             virtual_stages: int = 2) -> Table:
  """ZB-V: two chunks per device in a V, the backward split.

  The cells are cut into 2K chunks, chunk c on device c for c < K and on
  device 2K - 1 - c otherwise (`VPlacement`): the first and the last chunk
  share device 0, where the loss's gradient turns around at once. The loss
  is inside the pipeline. Each backward computes the input gradients (B),
  the weight gradients (W) run later on the same device (`_ZBVOrders`).
  With F = B = W and M >= 2K - 1 the bubble is close to none, at 1F1B's
  activation memory (2K chunk calls of half a stage each on device 0). Any
  K, M >= 1:

      >>> print(ZBVTable(2, 2))
      zbv: K=2 v=2 M=2 placement=(0, 1, 1, 0), 14 ticks
      device 0: F0.0 F0.1    - F3.0 B3.0 W3.0 F3.1 B3.1 W3.1 B0.0 W0.0    - B0.1 W0.1
      device 1:    - F1.0 F2.0 F1.1 F2.1 B2.0 W2.0 B1.0 W1.0 B2.1 W2.1 B1.1 W1.1    -

  Args:
    num_devices: K.
    num_micro_batches: M.
    virtual_stages: v; must be 2.

  Returns:
    The validated table.

  Raises:
    ValueError: if K, M or v is not a positive int, or v != 2.
  """
  _CheckZBVSizes(num_devices, num_micro_batches, virtual_stages)
  return TableFromOrders(
      'zbv', num_devices=num_devices, num_micro_batches=num_micro_batches,
      virtual_stages=2, loss_outside=False,
      orders=_ZBVOrders(num_devices, num_micro_batches),
      placement=VPlacement(num_devices))


class Schedule(NamedTuple):
  """A schedule by name: how to build its table and what it needs."""
  build: Callable[[int, int, int], Table]  # (K, M, v) -> Table.
  loss_inside: bool  # Whether the last cell computes the loss.
  doc: str
  # Raises ValueError naming the parameter unless (K, M, v) can be built.
  check_sizes: Callable[[int, int, int], None] = _CheckGPipeSizes
  # Whether its tables split the backward (`Table.split_backward`).
  split_backward: bool = False
  # (K, v) -> the device of each chunk in its tables (`Table.placement`).
  placement: Callable[[int, int], Tuple[int, ...]] = DefaultPlacement


# The schedules by the name users give (`GPipeSequentialLayer.schedule`).
SCHEDULES: Dict[str, Schedule] = {
    'gpipe': Schedule(
        GPipeTable, False,
        'all forwards, the loss, all backwards; circular when v > 1'),
    '1f1b': Schedule(
        OneFOneBTable, True,
        'the loss in the last cell; each backward as soon as its forward '
        'ends; interleaved when v > 1', _Check1F1BSizes),
    'zb1p': Schedule(
        ZB1PTable, True,
        "ZB-H1: 1F1B's order with the backward split into input and weight "
        'gradients, the weight gradients deferred into the bubbles; v = 1',
        _CheckZB1PSizes, split_backward=True),
    'zbv': Schedule(
        ZBVTable, True,
        'ZB-V: two chunks per device in a V, the backward split, the weight '
        'gradients in the bubbles; v = 2', _CheckZBVSizes,
        split_backward=True,
        placement=lambda num_devices, unused_v: VPlacement(num_devices)),
}


def CheckSchedule(schedule: str) -> Schedule:
  """The `Schedule` named `schedule`; ValueError naming it if unknown."""
  if schedule not in SCHEDULES:
    raise ValueError(f'schedule={schedule!r} is not supported; use one of '
                     f'{list(SCHEDULES)}.')
  return SCHEDULES[schedule]


def CheckScheduleSizes(schedule: str, num_stages: int,
                       num_micro_batches: int,
                       virtual_stages: int = 1) -> Schedule:
  """Checks that a schedule can run K stages, M micro-batches, v chunks.

  For the front ends, before any graph is built: 'zb1p' runs v = 1 only,
  'zbv' v = 2 only, interleaved '1f1b' (v > 1) needs K to divide M; every
  schedule runs any positive K and M otherwise.

      >>> CheckScheduleSizes('zbv', num_stages=2, num_micro_batches=3)
      Traceback (most recent call last):
      ...
      ValueError: virtual_stages=1 is not supported with schedule='zbv', ...

  Args:
    schedule: A key of `SCHEDULES`.
    num_stages: K, devices.
    num_micro_batches: M.
    virtual_stages: v.

  Returns:
    The `Schedule`.

  Raises:
    ValueError: naming the parameter (schedule, num_devices,
      num_micro_batches or virtual_stages) that it cannot run.
  """
  named = CheckSchedule(schedule)
  named.check_sizes(num_stages, num_micro_batches, virtual_stages)
  return named


def BuildTable(schedule: str, num_devices: int, num_micro_batches: int,
               virtual_stages: int = 1) -> Table:
  """The validated table of a schedule by name.

  Args:
    schedule: A key of `SCHEDULES`.
    num_devices: K.
    num_micro_batches: M.
    virtual_stages: v.

  Returns:
    The table.

  Raises:
    ValueError: on an unknown schedule, or sizes it cannot run.
  """
  return CheckSchedule(schedule).build(num_devices, num_micro_batches,
                                       virtual_stages)


def BubbleFraction(num_stages: int, num_micro_batches: int,
                   virtual_stages: int = 1) -> float:
  """Idle fraction of a GPipe step of equal chunks: (K-1) / (M v + K - 1).

  Exact when v = 1 or K divides M (circular groups are then full).

  Args:
    num_stages: K, the number of devices.
    num_micro_batches: M.
    virtual_stages: v.

  Returns:
    The fraction of device time in which a device has no work.

  Raises:
    ValueError: if K, M or v is not a positive int.
  """
  checks.CheckPositiveInt('num_stages', num_stages)
  checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
  checks.CheckPositiveInt('virtual_stages', virtual_stages)
  return (num_stages - 1) / (num_micro_batches * virtual_stages + num_stages -
                             1)


def CheckRemat(remat: str) -> None:
  """Raises ValueError unless `remat` is one of `REMAT_MODES`."""
  if remat not in REMAT_MODES:
    raise ValueError(f'remat={remat!r} is not supported; use one of '
                     f'{list(REMAT_MODES)}.')


def RecomputedCalls(table: Table, remat: str) -> Dict[Tuple[int, int], bool]:
  """Which training calls re-materialize, by (chunk, micro-batch).

  'always': every call; 'never': none; 'except_last': every call except
  those whose backward is the next action of their device after their
  forward (keeping their activations costs no extra peak memory: nothing
  else runs between). In a GPipe table those are the last micro-batch of the
  last chunk on each device.

  Args:
    table: The step.
    remat: One of `REMAT_MODES`.

  Returns:
    {(chunk, micro_batch): recomputes}.

  Raises:
    ValueError: if `remat` is unknown.
  """
  CheckRemat(remat)
  keeps = set()
  if remat == 'except_last':
    for order in table.device_orders:
      for a, b in zip(order, order[1:]):
        if (a.phase == FORWARD and b.phase == BACKWARD and
            (a.chunk, a.micro_batch) == (b.chunk, b.micro_batch)):
          keeps.add((a.chunk, a.micro_batch))
  return {(c, m): remat != 'never' and (c, m) not in keeps
          for c in range(table.num_chunks)
          for m in range(table.num_micro_batches)}


def CheckEngine(engine: str, remat: str, schedule: str = 'gpipe') -> None:
  """Raises ValueError unless `engine` ('auto' too) can run the schedule.

  Args:
    engine: 'auto' or one of `ENGINES`.
    remat: One of `REMAT_MODES`.
    schedule: A key of `SCHEDULES`.

  Raises:
    ValueError: naming the parameter that is unknown, or the engine that
      cannot run a schedule with the loss inside (the unrolled one).
  """
  if engine != 'auto' and engine not in ENGINES:
    raise ValueError(f'engine={engine!r} is not supported; use one of '
                     f'{["auto"] + list(ENGINES)}.')
  CheckRemat(remat)
  loss_inside = CheckSchedule(schedule).loss_inside
  if engine == 'unrolled' and loss_inside:
    raise ValueError(
        f"schedule={schedule!r} is not supported with engine='unrolled', "
        "whose backward pass is TensorFlow's gradient of its calls, after "
        "all forwards; use engine='loop' or 'auto'.")


def EngineCosts(num_stages: int, num_micro_batches: int,
                virtual_stages: int = 1) -> Tuple[float, float]:
  """What each engine costs beyond the other over a training run, in seconds.

  Args:
    num_stages: K.
    num_micro_batches: M.
    virtual_stages: v.

  Returns:
    (unrolled, loop): the unrolled engine's longer start-up and the loop
    engine's longer steps over AUTO_TRAINING_STEPS steps, by the model above
    (a forward and a backward tick per chunk call and per bubble tick).
  """
  calls_per_device = virtual_stages * num_micro_batches
  ticks = 2 * (calls_per_device + num_stages - 1)
  return (UNROLLED_START_SECONDS * calls_per_device**2,
          AUTO_TRAINING_STEPS * LOOP_TICK_SECONDS * ticks)


def ChooseEngine(engine: str,
                 num_stages: int,
                 num_micro_batches: int,
                 remat: str,
                 compiled_by_xla: bool = False,
                 schedule: str = 'gpipe',
                 virtual_stages: int = 1) -> str:
  """The engine that builds a step: `engine` itself unless it is 'auto'.

  'auto' is 'loop' for a schedule with the loss inside (only the loop
  engine runs it) and when the step is compiled by XLA (there the unrolled
  engine's recompute is merged back into the forward pass and saves no
  memory, the loop engine's is not; docs/engines.md). Otherwise it is the
  engine that costs less over AUTO_TRAINING_STEPS steps (`EngineCosts`):
  'unrolled' unless v M is large.

  Args:
    engine: 'auto', 'unrolled' or 'loop'.
    num_stages: K.
    num_micro_batches: M.
    remat: One of `REMAT_MODES`.
    compiled_by_xla: Whether XLA compiles the step (e.g. on TPU).
    schedule: A key of `SCHEDULES`.
    virtual_stages: v.

  Returns:
    'unrolled' or 'loop'.

  Raises:
    ValueError: on an unknown engine, remat mode or schedule, an engine that
      cannot run the schedule, or K, M or v that is not a positive int.
  """
  CheckEngine(engine, remat, schedule)
  checks.CheckPositiveInt('num_stages', num_stages)
  checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
  checks.CheckPositiveInt('virtual_stages', virtual_stages)
  if engine != 'auto':
    return engine
  if SCHEDULES[schedule].loss_inside or compiled_by_xla:
    return 'loop'
  unrolled, loop = EngineCosts(num_stages, num_micro_batches, virtual_stages)
  return 'loop' if unrolled > loop else 'unrolled'
