"""The loop engine: a schedule table run as while loops over its ticks.

The graph holds each chunk's body once, whatever M is. A table
(`schedule.Table`) says, per tick and device, which chunk runs which
micro-batch in which phase. At every tick each device runs the action the
table gives it under `tf.device(device_k)`: directly if it runs the same
action at every tick of a stretch of ticks, else through a `tf.cond` or
`tf.switch_case` that picks it (an idle device computes nothing). A GPipe
table, whose loss is computed after the pipeline, runs as a forward loop in
the forward pass and a backward loop in its gradient; a table with the loss
inside the pipeline (1F1B) runs forward and backward actions interleaved in
one loop in the forward pass, and its gradient scales what that loop
computed.

A step is a set of **edges** (`_Edge`): the input into chunk 0, chunk c into
c + 1, the last chunk into the output, and every skip connection. Each edge
has a **buffer indexed by slot** on its reader's device: written at the tick
its source produces a micro-batch and read whenever the table runs its
reader on it, so no assumption about the distance between producer and
consumer ticks is made, and a skipped tensor goes from its source's device
to its target's directly. A slot holds one micro-batch from its write to its
last read, and slots are reused once free (`_Slots`): a GPipe step needs M
slots, a 1F1B step only the micro-batches in flight. The same buffers are
the saved chunk inputs the backward recomputes from. The gradients of an
edge's tensors travel the same way back, in buffers on its source's device.
A tick's results are written to their buffers after the devices' calls, at
the slot the table gives, or at a spare slot when the source did not run:
one write per edge and tick, no branch. Each device reads its action and
slots from a table on its own device.

Re-materialization (`schedule.RecomputedCalls`): a call that recomputes runs
its forward built inline in the loop body (`stage.Stage.InlineForward`: no
function call per tick), keeps only its input and state and reruns its forward
in its backward (`stage.Stage.backward`, a call); a call that keeps its
activations runs the forward half of TensorFlow's own split of the call
(`stage.SplitCall`) and stashes the intermediates its backward half reads, in a
buffer on its device, from the tick of its forward to the tick of its backward.

Two ways to run the same ticks, picked per step (`_ChannelDevices`):

* **per-device loops** (`_DeviceStep`, in a TF1 graph such as Lingvo's
  trainer builds): one while loop per device over its own actions, idle
  ticks skipped, as Lingvo's `StackedRecurrent` runs its stages. Outputs
  and gradients go over Send/Recv channels (`channel.py`) instead of
  buffers, so a device waits only for the tensors it reads;
* **lockstep** (`_Step`; inside `tf.function`, under XLA, lowered or eager):
  one loop for all devices per stretch of ticks, as above; a tick ends when
  its slowest device is done.

Weight gradients are summed densely: an embedding's sparse (IndexedSlices)
gradient, from a recomputing or a kept call's backward alike, becomes a dense
tensor of the table's shape (`_Dense`) before it is added. The sums are loop
variables, whose shapes cannot change from tick to tick (a sparse sum would
grow by a micro-batch's looked-up rows at every backward, and XLA needs static
shapes), and a dense sum holds one table whatever M is. The unrolled engine
keeps the sum sparse (`recompute.py`), so an optimizer updates only the rows
looked up; after this engine it updates every row (the same values: the
others get zeros).

Two chunks y = theta x on two devices, two micro-batches, eagerly (the
loops run lockstep; `pipeline.Pipeline` is the usual way in):

    >>> def Chunk(theta, inputs, state, micro_batch_id):
    ...   return (inputs[0] * theta,), state
    >>> chunks = [stage_lib.Stage(Chunk, f'chunk {c}', f'/cpu:{c}',
    ...                           pin_forward=False) for c in range(2)]
    >>> thetas = [tf.constant(2.0), tf.constant(3.0)]
    >>> table = schedule.BuildTable('gpipe', num_devices=2, num_micro_batches=2)
    >>> with tf.GradientTape() as tape:
    ...   tape.watch(thetas)
    ...   (y,), states = Run(chunks, thetas, [tf.constant([[0.0], [1.0]])],
    ...                      [(), ()], table=table, batch_dim=0,
    ...                      remat='always', first_id=tf.constant(0, tf.int64),
    ...                      training=True, input_gradients=[False])
    ...   loss = tf.reduce_sum(y)
    >>> y.numpy().tolist(), states
    ([[0.0], [6.0]], [(), ()])
    >>> [float(g) for g in tape.gradient(loss, thetas)]
    [3.0, 2.0]
"""

import contextlib
import heapq
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from absl import logging
import tensorflow as tf

from lingvo_gpipe.engine import channel
from lingvo_gpipe.engine import microbatch
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.engine import xla
from lingvo_gpipe.planning import schedule

# Whether the loops' While, If and Case ops are lowered to Switch/Merge
# control flow when they run outside XLA. Unlowered (the default), each tick
# is one function call per loop, as in Lingvo's recurrent.py, instead of
# control kernels for every loop variable and every tensor a chunk reads,
# which make a step run many times the kernels, and slower (docs/engines.md).
# Lowered, the kernels inside the loops show in RunMetadata step stats, where
# tests and the timeline read which device ran them when; the ops and their
# devices are the same either way.
LOWER_CONTROL_FLOW = False
_LOWERING_ATTR = '_lower_using_switch_merge'
_BRANCH_OPS = ('If', 'StatelessIf', 'Case', 'StatelessCase')

F, B = schedule.FORWARD, schedule.BACKWARD


@contextlib.contextmanager
def ObservableLoops(lowered: bool = True):
  """Builds loops whose kernels show in RunMetadata step stats.

  The loops' While, If and Case ops normally run as function calls, whose
  kernels step stats do not report; lowered to Switch/Merge they run the same
  ops on the same devices, and step stats list them (`trace.py`).

  Args:
    lowered: Whether to lower the loops built inside the context.

  Yields:
    Nothing.
  """
  global LOWER_CONTROL_FLOW
  saved = LOWER_CONTROL_FLOW
  LOWER_CONTROL_FLOW = lowered
  try:
    yield
  finally:
    LOWER_CONTROL_FLOW = saved


def _Spec(t: tf.Tensor) -> tf.TensorSpec:
  return tf.TensorSpec(t.shape, t.dtype)


def _Placeholder(spec: tf.TensorSpec) -> tf.Tensor:
  """Zeros of `spec` (unknown dimensions get size 0): a loop's first value."""
  shape = [0 if d is None else d for d in spec.shape.as_list()]
  return tf.zeros(shape, spec.dtype)


def _Buffer(spec: tf.TensorSpec, num_slots: int) -> tf.TensorArray:
  """A buffer of `num_slots` slots and a spare one, for writes of idle ticks."""
  return tf.TensorArray(spec.dtype, size=num_slots + 1,
                        element_shape=spec.shape, clear_after_read=False)


def _Dense(t: Any, like: tf.Tensor) -> Optional[tf.Tensor]:
  """The gradient `t` of `like` as a dense tensor (None stays None).

  A sparse gradient (`tf.IndexedSlices`, an embedding lookup's) becomes a
  tensor of `like`'s shape, its rows added where its indices say, as
  `tf.convert_to_tensor` does; the number of rows is `like`'s static one
  where known, a constant, as XLA needs (the gradient's own dense shape is
  the output of a backward call, which XLA does not resolve to one).

  Args:
    t: A tensor, a `tf.IndexedSlices` or None.
    like: The tensor `t` is the gradient of.

  Returns:
    A tensor, or None.
  """
  if (isinstance(t, tf.IndexedSlices) and like.shape.rank and
      like.shape[0] is not None):
    return tf.math.unsorted_segment_sum(t.values, t.indices, like.shape[0])
  return None if t is None else tf.convert_to_tensor(t)


def _Flow(v: Any) -> tf.Tensor:
  return v.flow if isinstance(v, tf.TensorArray) else v


def _Scatter(values: Sequence[Any], mask: Sequence[bool]) -> List[Any]:
  """Puts `values` where `mask` is True, None elsewhere."""
  values = iter(values)
  return [next(values) if present else None for present in mask]


class _Boundary:
  """The tensors that cross one edge for one micro-batch.

  Attributes:
    mask: Per leaf of the edge's structure, whether it is a tensor (not None).
    specs: TensorSpecs of the tensors.
    differentiable: Per tensor, whether its gradient flows back across the
      edge (by default: whether it is floating point or complex).
  """

  def __init__(self, mask: Sequence[bool], specs: Sequence[tf.TensorSpec],
               differentiable: Optional[Sequence[bool]] = None):
    self.mask = tuple(mask)
    self.specs = list(specs)
    self.differentiable = (
        [stage_lib.IsDifferentiable(s) for s in self.specs]
        if differentiable is None else list(differentiable))

  def Structure(self) -> Tuple[Optional[tf.TensorSpec], ...]:
    """The leaves, specs in place of tensors (None where None)."""
    specs = iter(self.specs)
    return tuple(next(specs) if present else None for present in self.mask)

  def Differentiable(self) -> List[bool]:
    return list(self.differentiable)


class _Edge:
  """What travels from one chunk (or the input) to another (or the output).

  The step's edges: the input (source None) into chunk 0, chunk c into
  c + 1, the last chunk into the output (target None), then the skips.

  Attributes:
    source: The chunk that writes it, or None (the pipeline's input).
    target: The chunk that reads it, or None (the pipeline's output).
    skip: Whether it is a skip connection (the reader gets it as a tuple
      after its main inputs, the writer returns it after its main outputs).
    boundary: Its tensors (known once the source is traced).
  """

  def __init__(self, source: Optional[int], target: Optional[int],
               skip: bool):
    self.source = source
    self.target = target
    self.skip = skip
    self.boundary = None


def Edges(num_chunks: int, skips: Sequence[Tuple[int, Optional[int]]]
         ) -> List[_Edge]:
  """The input edge, the chunk-to-chunk and output edges, then the skips."""
  edges = [_Edge(None, 0, False)]
  edges += [_Edge(c, c + 1 if c + 1 < num_chunks else None, False)
            for c in range(num_chunks)]
  edges += [_Edge(a, b, True) for a, b in skips]
  return edges


class _Chunk:
  """One chunk as the loops see it, found by tracing its body once.

  Attributes:
    stage: The chunk's `stage.Stage` (body and device).
    theta: Its flat weights (read once per step).
    in_edges: The edges it reads, main first (their tensors, in order, are
      its flat inputs).
    out_edges: The edges it writes, main first (their tensors, in order, are
      its flat outputs).
    state: Its flat initial state.
    split: Its `stage.SplitCall`, if some call keeps its activations.
  """

  def __init__(self, index: int, stage: stage_lib.Stage, theta: Any,
               edges: List[_Edge], state: Any, check_weights: bool,
               split: bool):
    self.stage = stage
    self.in_edges = [e for e, edge in enumerate(edges) if edge.target == index]
    self.out_edges = [e for e, edge in enumerate(edges)
                      if edge.source == index]
    with tf.device(stage.device):
      self.theta = stage.FlattenTheta(theta)
    main, *skips = [edges[e].boundary.Structure() for e in self.in_edges]
    x_specs, self.state = stage.FlattenCall(main + tuple(skips), state)
    args = (self.theta, x_specs, self.state, tf.TensorSpec([], tf.int64))
    if check_weights:  # The recompute must see every weight in theta.
      stage.CheckNoCapturedWeights(*args)
    with tf.device(stage.device):
      concrete = stage.forward.get_concrete_function(*args)
    results = list(concrete.structured_outputs)
    specs = iter(_Spec(y) for y in results[:len(results) - stage.num_state])
    for e, mask in zip(self.out_edges,
                       stage.OutputGroups(len(self.out_edges) - 1)):
      edges[e].boundary = _Boundary(mask, [next(specs) for m in mask if m])
    self.split = stage_lib.SplitCall(concrete, stage.name) if split else None

  @property
  def device(self) -> str:
    return self.stage.device

  def Args(self, x: List[tf.Tensor], state: List[tf.Tensor],
           micro_batch_id: tf.Tensor) -> List[tf.Tensor]:
    """The flat arguments of a forward call."""
    return list(self.theta) + list(x) + list(state) + [micro_batch_id]


def _Slots(intervals: Dict[int, Tuple[int, int]]) -> Tuple[int, Dict[int,
                                                                     int]]:
  """Assigns buffer slots to micro-batches live over [first, last] ticks.

  A slot is free again at the tick its last reader runs (a write after the
  read at the same tick is safe: buffers are values). Greedy by first tick,
  which uses as few slots as the most micro-batches live at once.

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


class _Layout:
  """Where every micro-batch lives in the buffers, and what each tick does.

  Buffers: per edge 'data' (its tensors, on the reader's device; for an edge
  into the output, one slot per micro-batch on the writer's) and 'grad'
  (their gradients, on the writer's device; for the input edge, one slot per
  micro-batch: the gradient of the stacked input); per chunk 'state' (its
  state before each call) and 'stash' (what a call keeping its activations
  stashes).

  Attributes:
    table: The schedule.
    edges: The step's edges.
    training: Whether the step runs backward actions.
    recomputes: {(chunk, micro_batch): whether its backward recomputes}.
    sizes: {(buffer, index): number of slots}.
    slots: {(buffer, index): {micro_batch: slot}}.
  """

  # Per device, the fields of a tick's row: the action's branch index, its
  # micro-batch and the slots of its chunk's buffers.
  DEVICE_FIELDS = ('branch', 'micro_batch', 'state', 'stash')
  # Per edge: the slot its reader reads (data) and its writer reads (grad)
  # at the tick, and the slot written after the tick (data, grad; the spare
  # slot when nothing was written).
  EDGE_FIELDS = ('data_read', 'grad_read', 'data_write', 'grad_write')

  def __init__(self, table: schedule.Table, edges: Sequence[_Edge],
               recomputes: Dict[Tuple[int, int], bool], training: bool):
    self.table = table
    self.edges = list(edges)
    self.recomputes = recomputes
    self.training = training
    tick = table.tick_of
    num_micro = table.num_micro_batches

    def When(phase, c, m):
      return tick[schedule.Action(phase, c, m)]

    live = {}
    for c in range(table.num_chunks):
      for m in range(num_micro):
        if training:
          live.setdefault(('state', c), {})[m] = (When(F, c, m),
                                                  When(B, c, m))
          if not recomputes[c, m]:
            live.setdefault(('stash', c), {})[m] = (When(F, c, m),
                                                    When(B, c, m))
    for e, edge in enumerate(edges):
      if edge.source is None or edge.target is None:
        continue
      for m in range(num_micro):
        last_read = (When(B, edge.target, m) if training else
                     When(F, edge.target, m))
        live.setdefault(('data', e), {})[m] = (When(F, edge.source, m),
                                               last_read)
        if training:
          live.setdefault(('grad', e), {})[m] = (When(B, edge.target, m),
                                                 When(B, edge.source, m))
    self.sizes, self.slots = {}, {}
    for key, intervals in live.items():
      self.sizes[key], self.slots[key] = _Slots(intervals)
    for e, edge in enumerate(edges):
      key = ('data', e) if edge.target is None else (
          ('grad', e) if edge.source is None else None)
      if key:
        self.sizes[key] = num_micro
        self.slots[key] = {m: m for m in range(num_micro)}

  def Size(self, buffer: str, index: int) -> int:
    return self.sizes.get((buffer, index), 0)

  def Slot(self, buffer: str, index: int, micro_batch: int) -> int:
    return self.slots.get((buffer, index), {}).get(micro_batch, 0)

  def Key(self, action: schedule.Action) -> Tuple[str, int, bool]:
    """The branch an action runs: (phase, chunk, keeps its activations)."""
    return (action.phase, action.chunk,
            not self.recomputes[action.chunk, action.micro_batch])


class _Segment:
  """A stretch of ticks that one while loop runs.

  Attributes:
    choices: Per device, the branches (`_Layout.Key`) it runs in the
      segment, in order of first appearance; a device's action at a tick is
      an index into its choices, or len(choices) when it idles.
    idles: Per device, whether it idles at some tick of the segment.
    phases: The phases of the segment's actions.
    hosted: Per device, the fields of a tick it reads: its
      `_Layout.DEVICE_FIELDS`, then (field, edge) for the `EDGE_FIELDS` of
      the edges whose buffers it reads or writes at that field.
    rows: Per device, per tick, the values of its hosted fields: a table
      that lives on the device, so no tick sends indices between devices.
  """

  def __init__(self, ticks: Sequence[schedule.Tick], layout: _Layout):
    num_devices = len(ticks[0])
    self.choices = [[] for _ in range(num_devices)]
    self.idles = [False] * num_devices
    self.phases = set()
    for tick in ticks:
      for k, action in enumerate(tick):
        if action is None:
          self.idles[k] = True
          continue
        self.phases.add(action.phase)
        if layout.Key(action) not in self.choices[k]:
          self.choices[k].append(layout.Key(action))
    self.hosted = [list(_Layout.DEVICE_FIELDS) for _ in range(num_devices)]
    for e, edge in enumerate(layout.edges):
      for field in _Layout.EDGE_FIELDS:
        self.hosted[_FieldDevice(edge, field, layout.table)].append(
            (field, e))
    self.rows = [[] for _ in range(num_devices)]
    for tick in ticks:
      values = self._Values(tick, layout)
      for k, hosted in enumerate(self.hosted):
        self.rows[k].append([values[k, f] if isinstance(f, str) else values[f]
                             for f in hosted])

  def _Values(self, tick: schedule.Tick, layout: _Layout) -> Dict[Any, int]:
    """{(device, field) or (edge field, edge): value} of one tick."""
    values = {}
    for e in range(len(layout.edges)):
      values['data_read', e] = values['grad_read', e] = 0
      values['data_write', e] = layout.Size('data', e)  # The spare slot.
      values['grad_write', e] = layout.Size('grad', e)
    for k, action in enumerate(tick):
      if action is None:
        values.update({(k, 'branch'): len(self.choices[k]),
                       (k, 'micro_batch'): 0, (k, 'state'): 0,
                       (k, 'stash'): 0})
        continue
      phase, c, m = action
      values.update({(k, 'branch'): self.choices[k].index(layout.Key(action)),
                     (k, 'micro_batch'): m,
                     (k, 'state'): layout.Slot('state', c, m),
                     (k, 'stash'): layout.Slot('stash', c, m)})
      for e, edge in enumerate(layout.edges):
        if edge.target == c:  # c reads its data; its backward writes grad.
          values['data_read', e] = layout.Slot('data', e, m)
          if phase == B:
            values['grad_write', e] = layout.Slot('grad', e, m)
        if edge.source == c:  # c writes data; its backward reads grad.
          if phase == F:
            values['data_write', e] = layout.Slot('data', e, m)
          else:
            values['grad_read', e] = layout.Slot('grad', e, m)
    return values


def _FieldDevice(edge: _Edge, field: str, table: schedule.Table) -> int:
  """The device that uses an edge's field: its reader or its buffer's."""
  reader, writer = edge.target, edge.source
  chunk = {
      'data_read': reader,  # The target's calls read the data buffer.
      'grad_read': writer,  # The source's backward reads the gradients.
      'data_write': reader if reader is not None else writer,
      'grad_write': writer if writer is not None else reader,
  }[field]
  return table.Device(0 if chunk is None else chunk)


def _Segments(ticks: Sequence[schedule.Tick],
              layout: _Layout) -> List[_Segment]:
  """Cuts ticks into stretches in which every device works, or not.

  A GPipe table's phase has K - 1 filling ticks, the ticks in which every
  device works, and K - 1 draining ticks: three segments, whatever M is. In
  the middle one a device with one chunk (v = 1) calls it directly, with no
  branch.

  Args:
    ticks: The ticks, in order.
    layout: The buffers' slots.

  Returns:
    The segments, in order.
  """
  runs = []
  for tick in ticks:
    busy = None not in tick
    if runs and runs[-1][0] == busy:
      runs[-1][1].append(tick)
    else:
      runs.append((busy, [tick]))
  return [_Segment(run, layout) for _, run in runs]


def _KeepUnlowered(outputs: Any, op_types: Tuple[str, ...]) -> None:
  """Marks the While, If or Case op that made `outputs` to run as calls.

  Args:
    outputs: What tf.while_loop, tf.cond or tf.switch_case returned.
    op_types: The op types to look for, e.g. ('If', 'StatelessIf').
  """
  if LOWER_CONTROL_FLOW or tf.executing_eagerly():
    return
  for t in tf.nest.flatten(outputs):
    op = _Flow(t).op
    while op.type == 'Identity' and op.inputs:
      op = op.inputs[0].op
    if op.type in op_types:
      try:
        op._set_attr(  # pylint: disable=protected-access
            _LOWERING_ATTR, tf.compat.v1.AttrValue(b=False))
      except AttributeError:  # A TF without Operation._set_attr: lowered.
        logging.warning('Cannot keep %s unlowered; it runs lowered.', op.name)
      return


def _Dispatch(choices: Sequence[Any], idles: bool, branch: tf.Tensor,
              run: Callable[[Any], Any], idle: Callable[[], Any],
              name: str) -> Any:
  """Runs one device's action of a tick, picked by `branch`.

  Args:
    choices: The device's branches in the segment.
    idles: Whether the device idles at some tick of the segment.
    branch: int32 scalar, the index into choices (len(choices): idle).
    run: run(choice) builds a branch; returns the device's values.
    idle: Returns the device's values unchanged.
    name: The branch op's name.

  Returns:
    What `run` or `idle` returns.
  """
  fns = [lambda c=c: run(c) for c in choices]
  if idles:
    fns.append(idle)
  if len(fns) == 1:
    return fns[0]()
  if len(fns) == 2:
    results = tf.cond(branch < 1, fns[0], fns[1], name=name)
  else:
    results = tf.switch_case(branch, fns, name=name)
  _KeepUnlowered(results, _BRANCH_OPS)
  return results


class _Values(NamedTuple):
  """What a device's actions change, per chunk of the device (lists)."""
  state: List[List[tf.Tensor]]  # Forward state.
  saved_state: List[List[tf.TensorArray]]  # State before each call.
  stash: List[List[tf.TensorArray]]  # Intermediates of kept calls.
  sent_forward: List[List[tf.Tensor]]  # The latest outputs, all out edges.
  d_state: List[List[tf.Tensor]]  # State gradients (differentiable ones).
  d_theta: List[List[tf.Tensor]]  # Weight gradient sums.
  sent_backward: List[List[tf.Tensor]]  # The latest input gradients (all
  # in edges, differentiable ones).


# What forward and backward actions change (the rest they only read).
_CHANGED = {
    F: ('state', 'saved_state', 'stash', 'sent_forward', 'data'),
    B: ('d_state', 'd_theta', 'sent_backward', 'grad'),
}


class _Step:
  """The loops of one step over a table (see the module docstring).

  Attributes:
    chunks: The C `_Chunk`s.
    layout: Slots, edges and branches.
    num_devices: K.
    stacked_inputs: The input edge's tensors, micro-batches stacked.
    first_id: int64 id of micro-batch 0.
    loss_inside: Whether the last chunk's backward starts from the loss.
    d_outputs: Per edge into the output, the gradients of its tensors:
      [M, ...] (loss outside), or scalars (loss inside); None where not
      differentiable. Set before a backward tick is built.
  """

  def __init__(self, chunks: Sequence[_Chunk], layout: _Layout,
               stacked_inputs: List[tf.Tensor], first_id: tf.Tensor,
               loss_inside: bool):
    self.chunks = list(chunks)
    self.layout = layout
    self.edges = layout.edges
    self.num_devices = layout.table.num_devices
    self.stacked_inputs = stacked_inputs
    self.first_id = first_id
    self.loss_inside = loss_inside
    self.d_outputs = {}
    self._num_micro = layout.table.num_micro_batches
    self._diff = [e.boundary.Differentiable() for e in self.edges]
    self._diff_state = [[stage_lib.IsDifferentiable(t) for t in c.state]
                        for c in chunks]
    self._diff_theta = [[stage_lib.IsDifferentiable(t) for t in c.theta]
                        for c in chunks]

  def Differentiable(self, e: int) -> List[bool]:
    """Which tensors of edge e are differentiable."""
    return self._diff[e]

  def _EdgeDevice(self, e: int, buffer: str) -> str:
    """Where edge e's buffer lives: data with its reader, grad its writer."""
    edge = self.edges[e]
    chunk = edge.target if buffer == 'data' else edge.source
    if chunk is None:
      chunk = edge.source if buffer == 'data' else edge.target
    return self.chunks[chunk].device

  def Initial(self, states: List[List[tf.Tensor]],
              d_states: Optional[List[List[Optional[tf.Tensor]]]] = None
             ) -> Dict[str, Any]:
    """The loop variables before the first tick."""
    layout, chunks = self.layout, self.chunks
    v = {name: [] for name in ('data', 'grad') + _Values._fields}
    for e, edge in enumerate(self.edges):
      specs = edge.boundary.specs
      with tf.device(self._EdgeDevice(e, 'data')):
        v['data'].append([_Buffer(s, layout.Size('data', e)) for s in specs]
                         if layout.Size('data', e) and self._Needs('data', e)
                         else [])
      with tf.device(self._EdgeDevice(e, 'grad')):
        v['grad'].append([_Buffer(s, layout.Size('grad', e))
                          for s, d in zip(specs, self._diff[e]) if d]
                         if layout.Size('grad', e) and self._Needs('grad', e)
                         else [])
    for c, chunk in enumerate(chunks):
      with tf.device(chunk.device):
        v['state'].append(list(states[c]))
        v['saved_state'].append([_Buffer(_Spec(t), layout.Size('state', c))
                                 for t in chunk.state]
                                if layout.Size('state', c) else [])
        v['stash'].append([_Buffer(s, layout.Size('stash', c))
                           for s in chunk.split.stash_specs]
                          if layout.Size('stash', c) else [])
        v['sent_forward'].append([
            _Placeholder(s) for e in chunk.out_edges
            for s in self.edges[e].boundary.specs])
        given = [None] * len(chunk.state) if d_states is None else d_states[c]
        v['d_state'].append([
            tf.zeros_like(t) if g is None else g
            for t, g, d in zip(chunk.state, given, self._diff_state[c]) if d
        ])
        v['d_theta'].append([tf.zeros_like(t) for t, d in
                             zip(chunk.theta, self._diff_theta[c]) if d])
        v['sent_backward'].append([
            _Placeholder(s) for e in chunk.in_edges
            for s, d in zip(self.edges[e].boundary.specs, self._diff[e]) if d
        ])
    return v

  def _Needs(self, unused_buffer: str, unused_e: int) -> bool:
    """Whether edge e has a 'data' or 'grad' buffer (if it has slots)."""
    return True

  def _Invariants(self, v: Dict[str, Any]) -> Dict[str, Any]:
    """Shape invariants: buffers unknown, tensors their static shapes.

    The latest results sent between chunks start as placeholders whose
    unknown dimensions are 0: their invariants are their specs' shapes.

    Args:
      v: Loop variables.

    Returns:
      Their shape invariants.
    """
    invariants = tf.nest.map_structure(
        lambda t: tf.TensorShape(None) if isinstance(t, tf.TensorArray) else
        t.shape, v)
    if 'sent_forward' in v:
      invariants['sent_forward'] = [
          [s.shape for e in c.out_edges for s in self.edges[e].boundary.specs]
          for c in self.chunks]
    if 'sent_backward' in v:
      invariants['sent_backward'] = [
          [s.shape for e in c.in_edges
           for s, d in zip(self.edges[e].boundary.specs, self._diff[e]) if d]
          for c in self.chunks]
    return invariants

  def _Inputs(self, c: int, m: tf.Tensor, row: Dict[str, tf.Tensor],
              v: Dict[str, Any]) -> List[tf.Tensor]:
    """Chunk c's flat inputs of micro-batch m, edge after edge."""
    x = []
    for e in self.chunks[c].in_edges:
      if self.edges[e].source is None:
        x += [tf.gather(t, m) for t in self.stacked_inputs]
      else:
        x += [a.read(row['data_read', e]) for a in v['data'][e]]
    return x

  def _CallForward(self, c: int, keeps: bool, x: List[tf.Tensor],
                   m: tf.Tensor, row: Dict[Any, tf.Tensor], v: Dict[str, Any]
                  ) -> Tuple[List[tf.Tensor], List[tf.Tensor],
                             Optional[List[tf.TensorArray]],
                             List[tf.TensorArray]]:
    """Chunk c's forward call on inputs x of micro-batch m.

    Args:
      c: The chunk.
      keeps: Whether the call keeps its activations (stashes them).
      x: Its flat inputs.
      m: The micro-batch (int32 scalar).
      row: The tick's fields ('state' and 'stash': the chunk's slots).
      v: The loop variables.

    Returns:
      (outputs, state after the call, the stash buffers written or None,
      the saved-state buffers written).
    """
    chunk = self.chunks[c]
    state = v['state'][c]
    args = chunk.Args(x, state, self.first_id + tf.cast(m, tf.int64))
    stash = None
    if keeps:
      results, kept = chunk.split.Forward(args)
      stash = [a.write(row['stash'], t) for a, t in zip(v['stash'][c], kept)]
    else:
      results = chunk.stage.InlineForward(chunk.theta, x, state, args[-1])
    num_y = len(results) - len(state)
    saved_state = [a.write(row['state'], t)
                   for a, t in zip(v['saved_state'][c], state)]
    return (list(results[:num_y]), list(results[num_y:]), stash,
            saved_state)

  def _CallBackward(self, c: int, keeps: bool, x: List[tf.Tensor],
                    d_y: List[Optional[tf.Tensor]], m: tf.Tensor,
                    row: Dict[Any, tf.Tensor], v: Dict[str, Any]
                   ) -> Tuple[List[Optional[tf.Tensor]],
                              Optional[List[tf.Tensor]], List[tf.Tensor]]:
    """Chunk c's backward call on micro-batch m.

    Args:
      c: The chunk.
      keeps: Whether its forward stashed its activations.
      x: Its flat inputs.
      d_y: The gradients of its flat outputs, None where none can be.
      m: The micro-batch (int32 scalar).
      row: The tick's fields ('state' and 'stash': the chunk's slots).
      v: The loop variables.

    Returns:
      (input gradients, None where none; the new state gradients, or None
      when they do not flow back (loss inside); the new weight-gradient
      sums).
    """
    chunk = self.chunks[c]
    state = [a.read(row['state']) for a in v['saved_state'][c]]
    given = iter(v['d_state'][c])
    d_state = [next(given) if d else None for d in self._diff_state[c]]
    args = chunk.Args(x, state, self.first_id + tf.cast(m, tf.int64))
    if keeps:
      stash = [a.read(row['stash']) for a in v['stash'][c]]
      d_state = [tf.zeros_like(t) if g is None and d else g
                 for t, g, d in zip(state, d_state, self._diff_state[c])]
      grads = chunk.split.Backward(d_y + d_state, args, stash)
    else:
      grads = chunk.stage.backward(chunk.theta, x, state, args[-1],
                                   d_y + d_state)
    n_theta, n_x = len(chunk.theta), len(x)
    dense = [_Dense(g, a) for g, a in zip(grads, args)]
    d_theta = dense[:n_theta]
    d_x = dense[n_theta:n_theta + n_x]
    d_state = dense[n_theta + n_x:len(args) - 1]
    # With the loss outside, the state gradient flows m + 1 -> m.
    new_d_state = (None if self.loss_inside else
                   [g for g in d_state if g is not None])
    d_theta = [total + g for total, g in zip(
        v['d_theta'][c], [g for g in d_theta if g is not None])]
    return d_x, new_d_state, d_theta

  def _LossGradients(self, e: int, m: tf.Tensor) -> List[Optional[tf.Tensor]]:
    """The gradients of edge e's tensors (an edge into the output) for m."""
    return [None if d is None else
            (d if self.loss_inside else tf.gather(d, m))
            for d in self.d_outputs[e]]

  def _OutputGradients(self, c: int, m: tf.Tensor,
                       receive: Callable[[int], List[tf.Tensor]]
                      ) -> List[Optional[tf.Tensor]]:
    """Chunk c's flat output gradients for micro-batch m.

    Args:
      c: The chunk.
      m: The micro-batch (int32 scalar).
      receive: receive(e) returns the gradients an out-edge e to another
        chunk carries back, one per differentiable tensor.

    Returns:
      Edge after edge, the loss's gradients for edges into the output, the
      received ones for the others, None where none can be.
    """
    d_y = []
    for e in self.chunks[c].out_edges:
      if self.edges[e].target is None:
        d_y += self._LossGradients(e, m)
      else:
        given = iter(receive(e))
        d_y += [next(given) if d else None for d in self._diff[e]]
    return d_y

  def _Forward(self, c: int, keeps: bool, row: Dict[Any, tf.Tensor],
               v: Dict[str, Any], values: _Values, i: int) -> None:
    """Chunk c's forward on micro-batch row['micro_batch']; updates values."""
    m = row['micro_batch']
    y, state, stash, saved_state = self._CallForward(
        c, keeps, self._Inputs(c, m, row, v), m, row, v)
    if stash is not None:
      values.stash[i] = stash
    values.sent_forward[i] = y
    values.state[i] = state
    values.saved_state[i] = saved_state

  def _Backward(self, c: int, keeps: bool, row: Dict[Any, tf.Tensor],
                v: Dict[str, Any], values: _Values, i: int) -> None:
    """Chunk c's backward on micro-batch row['micro_batch']; updates values."""
    chunk = self.chunks[c]
    m = row['micro_batch']
    d_y = self._OutputGradients(
        c, m, lambda e: [a.read(row['grad_read', e]) for a in v['grad'][e]])
    d_x, d_state, d_theta = self._CallBackward(
        c, keeps, self._Inputs(c, m, row, v), d_y, m, row, v)
    wanted = [d for e in chunk.in_edges for d in self._diff[e]]
    values.sent_backward[i] = [g for g, d in zip(d_x, wanted) if d]
    if d_state is not None:
      values.d_state[i] = d_state
    values.d_theta[i] = d_theta

  def Run(self, ticks: Sequence[schedule.Tick], v: Dict[str, Any],
          name: str) -> Dict[str, Any]:
    """Runs the ticks as while loops (one per segment); returns the vars.

    Only what a loop's ticks change is carried through it; the rest (e.g.
    the forward's buffers in backward loops) is read from outside.

    Args:
      ticks: The ticks to run.
      v: All variables (`Initial`).
      name: The loops' name prefix.

    Returns:
      The variables after the last tick.
    """
    for i, segment in enumerate(_Segments(ticks, self.layout)):
      # What the segment leaves unchanged is not carried: XLA's compiler
      # fails on while loops that pass loop-invariant values through.
      carried = {key for phase in segment.phases for key in _CHANGED[phase]}
      if self.loss_inside:  # No state gradient flows back (`_Backward`).
        carried.discard('d_state')
      fixed = {key: value for key, value in v.items() if key not in carried}
      loop_vars = {key: value for key, value in v.items() if key in carried}
      # The loop starts when the previous one has ended, whatever variable
      # it reads first: its counters wait for all of them. Unlowered, a
      # While's outputs appear together anyway; lowered
      # (LOWER_CONTROL_FLOW), each loop variable leaves its loop on its own,
      # and a device could start its next call while its last one still runs.
      # Each device counts the ticks itself: none waits for another's index.
      counters = []
      with tf.control_dependencies(
          [_Flow(x) for x in tf.nest.flatten(loop_vars)] if i else []):
        for k in range(self.num_devices):
          with tf.device(self.chunks[k].device):
            counters.append(tf.constant(0, name=f'{name}_tick_{i}'))

      def Body(counters, loop_vars, segment=segment, fixed=fixed):
        rows = []
        for k, (t, table) in enumerate(zip(counters, segment.rows)):
          with tf.device(self.chunks[k].device):
            rows.append(tf.unstack(tf.constant(table, tf.int32)[t]))
        new = self._Tick(segment, rows, dict(fixed, **loop_vars))
        next_counters = []
        for k, t in enumerate(counters):
          with tf.device(self.chunks[k].device):
            next_counters.append(t + 1)
        return next_counters, {key: new[key] for key in loop_vars}

      num_ticks = len(segment.rows[0])
      results = tf.while_loop(
          lambda counters, _, n=num_ticks: counters[0] < n, Body,
          (counters, loop_vars),
          shape_invariants=([tf.TensorShape([])] * self.num_devices,
                            self._Invariants(loop_vars)),
          # A tick starts when the previous one has ended, as the unlowered
          # While runs it; lowered loops would otherwise overlap ticks.
          parallel_iterations=1,
          maximum_iterations=num_ticks,
          name=f'{name}_{i}')
      _KeepUnlowered(results[0], ('While', 'StatelessWhile'))
      v = dict(fixed, **results[1])
    return v

  @staticmethod
  def _Fields(segment: _Segment, rows: List[List[tf.Tensor]]
             ) -> List[Dict[Any, tf.Tensor]]:
    """Per device, every field of the tick: its own ones on its device.

    Args:
      segment: The segment.
      rows: Per device, its hosted fields' values at the tick.

    Returns:
      Per device, {field or (edge field, edge): value}: its device fields
      and every device's edge fields.
    """
    edge_fields = {f: value for hosted, row in zip(segment.hosted, rows)
                   for f, value in zip(hosted, row) if not isinstance(f, str)}
    return [dict(edge_fields, **{f: value for f, value in zip(hosted, row)
                                 if isinstance(f, str)})
            for hosted, row in zip(segment.hosted, rows)]

  def _Tick(self, segment: _Segment, rows: List[List[tf.Tensor]],
            v: Dict[str, Any]) -> Dict[str, Any]:
    """One tick: every device's action, then the writes to the buffers."""
    num_chunks = len(self.chunks)
    fields = self._Fields(segment, rows)
    v = {key: list(value) for key, value in v.items()}
    for k in range(self.num_devices):
      own = list(range(k, num_chunks, self.num_devices))

      def Current(own=own):
        return _Values(*[[v[field][c] for c in own]
                         for field in _Values._fields])

      def Run(choice, own=own, row=fields[k], current=Current):
        phase, c, keeps = choice
        values = current()
        with tf.name_scope(f'chunk{c}'):  # engine/trace.py reads it.
          (self._Forward if phase == F else self._Backward)(
              c, keeps, row, v, values, own.index(c))
        return values

      with tf.device(self.chunks[k].device), tf.name_scope(f'device{k}'):
        values = _Dispatch(segment.choices[k], segment.idles[k],
                           fields[k]['branch'], Run, Current,
                           f'device{k}_{"_".join(sorted(segment.phases))}')
      for field, per_chunk in zip(_Values._fields, values):
        for c, value in zip(own, per_chunk):
          v[field][c] = value
    # Each edge's tensors go to the buffer of the chunk that reads them.
    edge_fields = fields[0]
    for e, edge in enumerate(self.edges):
      if F in segment.phases and edge.source is not None:
        chunk = self.chunks[edge.source]
        sent = self._Slice(v['sent_forward'][edge.source], chunk.out_edges, e,
                           lambda f: self.edges[f].boundary.specs)
        with tf.device(self._EdgeDevice(e, 'data')):
          v['data'][e] = [a.write(edge_fields['data_write', e], t)
                          for a, t in zip(v['data'][e], sent)]
      if B in segment.phases and edge.target is not None and v['grad'][e]:
        chunk = self.chunks[edge.target]
        sent = self._Slice(
            v['sent_backward'][edge.target], chunk.in_edges, e,
            lambda f: [d for d in self._diff[f] if d])
        with tf.device(self._EdgeDevice(e, 'grad')):
          v['grad'][e] = [a.write(edge_fields['grad_write', e], g)
                          for a, g in zip(v['grad'][e], sent)]
    return v

  @staticmethod
  def _Slice(values: List[tf.Tensor], edges: Sequence[int], e: int,
             sizes: Callable[[int], Sequence[Any]]) -> List[tf.Tensor]:
    """The part of a chunk's flat values that belongs to edge e."""
    start = 0
    for f in edges:
      size = len(sizes(f))
      if f == e:
        return values[start:start + size]
      start += size
    raise ValueError(f'edge {e} is not among {list(edges)}.')

  def Results(self, v: Dict[str, Any]):
    """(outputs stacked [M, ...], final states, d_theta, d_inputs, d_states).

    Outputs are those of every edge into the output, main first; gradients
    are on their chunk's devices, None where not differentiable.
    """
    num_micro = self._num_micro
    outputs = []
    for e, edge in enumerate(self.edges):
      if edge.target is None:
        with tf.device(self._EdgeDevice(e, 'data')):
          outputs += [a.gather(tf.range(num_micro)) for a in v['data'][e]]
    with tf.device(self.chunks[0].device):
      d_inputs = _Scatter([a.gather(tf.range(num_micro))
                           for a in v['grad'][0]], self._diff[0])
    placed = {}
    for field in ('state', 'd_theta', 'd_state'):
      placed[field] = []
      for chunk, tensors in zip(self.chunks, v[field]):
        with tf.device(chunk.device):
          placed[field].append([tf.identity(t) for t in tensors])
    return (outputs, placed['state'],
            [_Scatter(g, d) for g, d in zip(placed['d_theta'],
                                            self._diff_theta)],
            d_inputs,
            [_Scatter(g, d) for g, d in zip(placed['d_state'],
                                            self._diff_state)])


class _DeviceStep(_Step):
  """The loops of one step as one while loop per device, joined by channels.

  Device k's loop runs its own actions in table order, skipping its idle
  ticks. A forward receives each input (`channel.Channel`) from the device
  that produced it and sends each output to the device that reads it; a
  backward receives its output gradients and sends its input gradients the
  same way. A Recv waits for its Send, so a device waits only for what it
  reads, not for every device's tick to end. A channel's k-th Recv gets its
  k-th Send: every edge's reader must take the micro-batches in the order its
  writer produces them (`ChannelOrderHolds`), as all built-in tables do.
  The input, the output, states, stashes and the saved inputs a backward
  reads stay in buffers on their device, at the slots `_Layout` gives.
  """

  def __init__(self, chunks: Sequence[_Chunk], layout: _Layout,
               stacked_inputs: List[tf.Tensor], first_id: tf.Tensor,
               loss_inside: bool, devices: Sequence[str]):
    super().__init__(chunks, layout, stacked_inputs, first_id, loss_inside)
    table = layout.table
    self._channels = {}
    for e, edge in enumerate(self.edges):
      if edge.source is None or edge.target is None:
        continue
      writer = devices[table.Device(edge.source)]
      reader = devices[table.Device(edge.target)]
      specs = edge.boundary.specs
      self._channels[e, 'data'] = [
          channel.Channel(s, writer, reader, f'edge{e}_data') for s in specs]
      self._channels[e, 'grad'] = [
          channel.Channel(s, reader, writer, f'edge{e}_grad')
          for s, d in zip(specs, self._diff[e]) if d]

  def _Needs(self, buffer: str, e: int) -> bool:
    """Whether edge e has a buffer: for the output, the input's gradients,
    and (in training) the saved inputs of the chunk that reads it."""
    edge = self.edges[e]
    if buffer == 'data':
      return edge.target is None or (edge.source is not None and
                                     self.layout.training)
    return edge.source is None

  def _ForwardOverChannels(self, c: int, keeps: bool,
                           row: Dict[Any, tf.Tensor], v: Dict[str, Any],
                           new: Dict[str, Any]) -> List[tf.Operation]:
    """Chunk c's forward; updates `new`, returns its Send ops."""
    chunk = self.chunks[c]
    m = row['micro_batch']
    x = []
    for e in chunk.in_edges:
      if self.edges[e].source is None:
        x += [tf.gather(t, m) for t in self.stacked_inputs]
        continue
      received = [ch.Recv() for ch in self._channels[e, 'data']]
      new['data'][e] = [a.write(row['data_read', e], t)
                        for a, t in zip(v['data'][e], received)]
      x += received
    y, new['state'][c], stash, new['saved_state'][c] = self._CallForward(
        c, keeps, x, m, row, v)
    if stash is not None:
      new['stash'][c] = stash
    sends = []
    for e in chunk.out_edges:
      part = self._Slice(y, chunk.out_edges, e,
                         lambda f: self.edges[f].boundary.specs)
      if self.edges[e].target is None:
        new['data'][e] = [a.write(m, t) for a, t in zip(v['data'][e], part)]
      else:
        sends += [ch.Send(t) for ch, t in zip(self._channels[e, 'data'],
                                               part)]
    return sends

  def _BackwardOverChannels(self, c: int, keeps: bool,
                            row: Dict[Any, tf.Tensor], v: Dict[str, Any],
                            new: Dict[str, Any]) -> List[tf.Operation]:
    """Chunk c's backward; updates `new`, returns its Send ops."""
    chunk = self.chunks[c]
    m = row['micro_batch']
    d_y = self._OutputGradients(
        c, m, lambda e: [ch.Recv() for ch in self._channels[e, 'grad']])
    d_x, d_state, new['d_theta'][c] = self._CallBackward(
        c, keeps, self._Inputs(c, m, row, v), d_y, m, row, v)
    if d_state is not None:
      new['d_state'][c] = d_state
    sends = []
    for e in chunk.in_edges:
      part = self._Slice(d_x, chunk.in_edges, e, lambda f: self._diff[f])
      grads = [g for g, d in zip(part, self._diff[e]) if d]
      if self.edges[e].source is None:
        new['grad'][e] = [a.write(m, g) for a, g in zip(v['grad'][e], grads)]
      else:
        sends += [ch.Send(g) for ch, g in zip(self._channels[e, 'grad'],
                                               grads)]
    return sends

  def _Carried(self, k: int, phases: Sequence[str]) -> List[Tuple[str, int]]:
    """The (field, index) loop variables device k's actions change."""
    table = self.layout.table
    own = range(k, len(self.chunks), self.num_devices)
    carried = []
    for field in ('state', 'saved_state', 'stash', 'd_state', 'd_theta'):
      if any(field in _CHANGED[p] for p in phases) and not (
          field == 'd_state' and self.loss_inside):
        carried += [(field, c) for c in own]
    for e, edge in enumerate(self.edges):
      if F in phases and self._Needs('data', e):
        reader = edge.target if edge.target is not None else edge.source
        if table.Device(reader) == k:
          carried.append(('data', e))
      if B in phases and self._Needs('grad', e) and table.Device(0) == k:
        carried.append(('grad', e))
    return carried

  def Run(self, ticks: Sequence[schedule.Tick], v: Dict[str, Any],
          name: str) -> Dict[str, Any]:
    """Runs the ticks as one while loop per device; returns the vars."""
    result = {key: list(value) for key, value in v.items()}
    finals, dones = [], []
    for k in range(self.num_devices):
      actions = [tick[k] for tick in ticks if tick[k] is not None]
      if not actions:
        continue
      phases = sorted({a.phase for a in actions})
      carried = self._Carried(k, phases)
      choices, hosted, rows = self._Rows(k, actions)

      def Body(t, values, choices=choices, hosted=hosted, rows=rows,
               carried=carried, k=k):
        current = {key: list(value) for key, value in v.items()}
        for (field, i), value in zip(carried, values):
          current[field][i] = value
        row = dict(zip(hosted, tf.unstack(
            tf.gather(tf.constant(rows, tf.int32), t))))

        def Action(choice):
          phase, c, keeps = choice
          new = {key: list(value) for key, value in current.items()}
          with tf.name_scope(f'chunk{c}'):  # engine/trace.py reads it.
            act = (self._ForwardOverChannels if phase == F else
                   self._BackwardOverChannels)
            sends = act(c, keeps, row, current, new)
          with tf.control_dependencies(sends):
            return [new[field][i] for field, i in carried], t + 1

        new_values, next_t = _Dispatch(choices, False, row['branch'], Action,
                                       None, f'device{k}_{"_".join(phases)}')
        return next_t, new_values

      with tf.device(self.chunks[k].device), tf.name_scope(f'device{k}'):
        initial = [v[field][i] for field, i in carried]
        results = tf.while_loop(
            lambda t, _, n=len(actions): t < n, Body,
            (tf.constant(0), initial),
            shape_invariants=(tf.TensorShape([]), tf.nest.map_structure(
                lambda x: tf.TensorShape(None) if isinstance(
                    x, tf.TensorArray) else x.shape, initial)),
            name=f'{name}_device{k}')
        _KeepUnlowered(results[0], ('While', 'StatelessWhile'))
      finals.append((k, carried, results[1]))
      dones.append(results[0])
    # A loop's results wait for every loop: nothing else joins the loops in
    # the graph, and a fetch that needs one loop must run those it receives
    # from, or its Recv would wait forever.
    with tf.control_dependencies(dones):
      for k, carried, values in finals:
        with tf.device(self.chunks[k].device):
          for (field, i), value in zip(carried, values):
            result[field][i] = [
                x.identity() if isinstance(x, tf.TensorArray) else
                tf.identity(x) for x in value]
    return result

  def _Rows(self, k: int, actions: Sequence[schedule.Action]
           ) -> Tuple[List[Any], List[Any], List[List[int]]]:
    """Device k's branches, the fields of its rows, and a row per action."""
    layout = self.layout
    choices = []
    for action in actions:
      if layout.Key(action) not in choices:
        choices.append(layout.Key(action))
    saved = [e for e, edge in enumerate(self.edges)
             if edge.source is not None and edge.target is not None and
             layout.table.Device(edge.target) == k]
    hosted = list(_Layout.DEVICE_FIELDS) + [('data_read', e) for e in saved]
    rows = []
    for action in actions:
      phase, c, m = action
      rows.append([choices.index(layout.Key(action)), m,
                   layout.Slot('state', c, m), layout.Slot('stash', c, m)] +
                  [layout.Slot('data', e, m) if self.edges[e].target == c
                   else 0 for e in saved])
    return choices, hosted, rows


def ChannelOrderHolds(table: schedule.Table,
                      edges: Sequence[_Edge]) -> bool:
  """Whether every edge's reader takes micro-batches in its writer's order.

  Per-device loops pass an edge's tensors (and gradients) over a channel,
  which delivers them in the order they were sent.

  Args:
    table: The schedule.
    edges: The step's edges.

  Returns:
    True if, for every edge between chunks, its target's forwards take the
    micro-batches in the order of its source's forwards, and its source's
    backwards in the order of its target's backwards.
  """
  order = {}
  for tick in table.ticks:
    for action in tick:
      if action is not None:
        order.setdefault((action.phase, action.chunk), []).append(
            action.micro_batch)
  return all(order.get((F, e.source)) == order.get((F, e.target)) and
             order.get((B, e.source)) == order.get((B, e.target))
             for e in edges if e.source is not None and e.target is not None)


def _ChannelDevices(chunks: Sequence[_Chunk],
                    layout: _Layout) -> Optional[List[str]]:
  """The devices' full names if the step runs as per-device loops, or None.

  Per-device loops (`_DeviceStep`) run where the K loops run at once and
  their Send and Recv ops can meet: in a TF1 graph (a session's executor
  runs each functional While as a callback chain on its thread pool), with
  control flow v2, loops not lowered (lowered, each loop's ops key their
  tensors by its own frame) and not compiled by XLA (`xla.CompiledByXla`:
  XLA compiles no Send or Recv);
  with K >= 2 distinct, fully named devices, and every edge's micro-batches
  in one order at both ends (`ChannelOrderHolds`). Not eagerly, where the
  loops run one after the other, nor inside a `tf.function`: TensorFlow's
  function runtime may run a function's While loops synchronously, one at
  a time on one thread, and a loop waiting for a Recv would wait forever.
  Elsewhere the ticks run in lockstep (`_Step`), with the same results.

  Args:
    chunks: The step's chunks.
    layout: Its layout.

  Returns:
    K full device names, or None.
  """
  table = layout.table
  devices = [chunks[k].device for k in range(table.num_devices)]
  if (table.num_devices < 2 or LOWER_CONTROL_FLOW or tf.executing_eagerly()
      or tf.compat.v1.get_default_graph().building_function or
      not tf.compat.v1.control_flow_v2_enabled() or
      xla.CompiledByXla(devices) or
      not ChannelOrderHolds(table, layout.edges)):
    return None
  names = [channel.FullDeviceName(device) for device in devices]
  if None in names or len(set(names)) < len(names):
    return None
  return names


def _PhaseTicks(table: schedule.Table) -> List[Tuple[str, Sequence[
    schedule.Tick]]]:
  """The table's ticks as the loops run them.

  Returns:
    [('forward', ticks), ('backward', ticks)] for a table with the loss
    outside, [('mixed', ticks)] for one with the loss inside.

  Raises:
    ValueError: if a table with the loss outside does not run all its
      forward ticks before its backward ticks, or a chunk's backward does not
      take the micro-batches in the reverse order of its forward (the
      chunk's state gradient flows back along that order).
  """
  if not table.loss_outside:
    return [('mixed', tuple(tick for tick in table.ticks if any(tick)))]
  runs = table.PhaseRuns()
  if [phase for phase, _ in runs] != [F, B]:
    raise ValueError(
        f"engine='loop' runs tables with the loss outside whose forward "
        f'ticks all come before their backward ticks; '
        f'schedule={table.schedule!r} interleaves them.')
  for c in range(table.num_chunks):
    order = [[a.micro_batch for tick in ticks for a in tick
              if a is not None and a.chunk == c] for _, ticks in runs]
    if order[1] != order[0][::-1]:
      raise ValueError(
          f"engine='loop': schedule={table.schedule!r} runs chunk {c}'s "
          f'backward on micro-batches {order[1]}, not in the reverse order '
          f'of its forward {order[0]}.')
  return runs


def _Join(parts: Sequence[Sequence[Any]]) -> List[Any]:
  """Concatenates lists."""
  return [t for part in parts for t in part]


def _Unjoin(values: Sequence[Any],
            sizes: Sequence[Sequence[int]]) -> List[List[List[Any]]]:
  """Cuts `values` into groups of lists of the given sizes (`_Join` inverse).

  Args:
    values: A flat sequence.
    sizes: Per group, the lengths of its lists, in order.

  Returns:
    Per group, its lists.
  """
  groups, start = [], 0
  for group in sizes:
    lists = []
    for size in group:
      lists.append(list(values[start:start + size]))
      start += size
    groups.append(lists)
  return groups


@tf.custom_gradient
def _NoGradient(t):
  """Identity whose gradient is an error: for outputs 1F1B cannot differentiate."""

  def Grad(unused_d):
    raise ValueError(
        "A gradient flows through an output of a pipeline with the loss "
        "inside (schedule='1f1b') other than its first (the loss): a metric "
        'or a final state. The schedule computes the gradient of the mean '
        'loss only; compute other terms outside the pipeline, or use '
        "schedule='gpipe'.")

  return tf.identity(t), Grad


def _Chunks(stages: Sequence[stage_lib.Stage], thetas: Sequence[Any],
            edges: List[_Edge], states: Sequence[Any], table: schedule.Table,
            remat: str, training: bool) -> Tuple[List[_Chunk], _Layout]:
  """The `_Chunk`s (tracing each once) and the `_Layout` of a step."""
  recomputes = schedule.RecomputedCalls(table,
                                        remat if training else 'always')
  chunks = []
  for c, (s, theta, state) in enumerate(zip(stages, thetas, states)):
    keeps = training and not all(recomputes[c, m]
                                 for m in range(table.num_micro_batches))
    chunks.append(_Chunk(c, s, theta, edges, state, training, keeps))
  return chunks, _Layout(table, edges, recomputes, training)


def _CheckLossOutputs(edges: Sequence[_Edge]) -> None:
  """Raises unless the output is scalars, the first a float loss."""
  outputs = [e.boundary for e in edges if e.target is None]
  specs = outputs[0].specs
  if (len(outputs) > 1 or not specs or not all(outputs[0].mask) or
      any(s.shape.rank != 0 for s in specs) or not specs[0].dtype.is_floating):
    raise ValueError(
        'A schedule with the loss inside the pipeline (e.g. '
        "schedule='1f1b') needs a last cell that returns scalars, the first "
        'a float loss (the mean over its micro-batch), and no skip into the '
        f'output; it returns {outputs[0].Structure()}'
        f'{" and skips" if len(outputs) > 1 else ""}.')


def Run(stages: Sequence[stage_lib.Stage], thetas: Sequence[Any],
        inputs: Sequence[Optional[tf.Tensor]], states: List[Any], *,
        table: schedule.Table, batch_dim: int, remat: str,
        first_id: tf.Tensor, training: bool,
        input_gradients: Sequence[bool],
        loss_inside: bool = False,
        skips: Sequence[Tuple[int, Optional[int]]] = ()
       ) -> Tuple[List[Optional[tf.Tensor]], List[Any]]:
  """Builds one pipelined pass as while loops (see the module docstring).

  Args:
    stages: C = K v chunks; chunk c runs on its device (that of c mod K).
    thetas: C nests of weights.
    inputs: The mini-batch inputs, tensors or None.
    states: C nests of initial chunk states.
    table: The schedule (a GPipe table when not training).
    batch_dim: The dimension inputs are split and outputs merged along.
    remat: One of `schedule.REMAT_MODES`.
    first_id: int64 id of micro-batch 0; micro-batch m gets first_id + m.
    training: If False, the forward ticks run alone, saving nothing.
    input_gradients: Per input, whether the backward computes its gradient
      (else None); False for None and for tensors that are not floating point.
    loss_inside: Whether the last chunk returns the loss (scalars): the
      outputs are then the means over micro-batches, and in training the
      table's backward runs in the same loop (its `loss_outside` is False).
    skips: (source chunk, target chunk or None for the output) pairs: the
      source returns one tuple per skip after its main outputs, the target
      receives it after its main inputs (see `pipeline.Pipeline`).

  Returns:
    (outputs, states): the last chunk's outputs merged along batch_dim, then
    the tensors of each skip into the output (with the loss inside: the mean
    over micro-batches of each scalar output), and each chunk's state after
    its last micro-batch.

  Raises:
    ValueError: if the table or the last cell's outputs do not suit.
  """
  schedule.CheckRemat(remat)
  runs = _PhaseTicks(table)
  num_micro = table.num_micro_batches
  specs = []
  for x in inputs:
    if x is not None:
      shape = x.shape.as_list()
      shape[batch_dim] = (None if shape[batch_dim] is None else
                          shape[batch_dim] // num_micro)
      specs.append(tf.TensorSpec(shape, x.dtype))
  edges = Edges(len(stages), skips)
  edges[0].boundary = _Boundary(
      [x is not None for x in inputs], specs,
      [d for x, d in zip(inputs, input_gradients) if x is not None])
  chunks, layout = _Chunks(stages, thetas, edges, states, table, remat,
                           training)
  if loss_inside:
    _CheckLossOutputs(edges)
  with tf.device(stages[0].device):
    stacked = [microbatch.Stack(x, num_micro, batch_dim)
               for x in inputs if x is not None]
  sizes = ([len(c.theta) for c in chunks], [len(stacked)],
           [len(c.state) for c in chunks])
  output_edges = [e for e, edge in enumerate(edges) if edge.target is None]

  devices = _ChannelDevices(chunks, layout)

  def NewStep(flat):
    """A `_Step` over the weights and stacked inputs in `flat`."""
    theta, (x,), _ = _Unjoin(flat, sizes)
    for chunk, chunk_theta in zip(chunks, theta):
      chunk.theta = chunk_theta
    if devices:
      return _DeviceStep(chunks, layout, x, first_id, loss_inside, devices)
    return _Step(chunks, layout, x, first_id, loss_inside)

  flat = _Join([c.theta for c in chunks]) + stacked + _Join(
      [c.state for c in chunks])
  if not training:
    step = NewStep(flat)
    v = step.Run(runs[0][1], step.Initial([c.state for c in chunks]),
                 'forward')
    outputs, final_states, _, _, _ = step.Results(v)
    if loss_inside:
      with tf.device(chunks[-1].device):
        outputs = [tf.reduce_mean(y, 0) for y in outputs]
    final_flat = _Join(final_states)
  elif loss_inside:
    outputs, final_flat = _LossInside(NewStep, flat, sizes, runs,
                                      output_edges)
  else:
    outputs, final_flat = _LossOutside(NewStep, flat, sizes, runs,
                                       output_edges)
  final_states = _Unjoin(final_flat, sizes[2:])[0]
  final_states = [tf.nest.pack_sequence_as(state, part)
                  for state, part in zip(states, final_states)]
  if loss_inside:
    return outputs, final_states
  merged = iter(outputs)
  results = []
  for e in output_edges:
    edge = edges[e]
    with tf.device(chunks[edge.source].device):
      results += [None if not present else
                  microbatch.Unstack(next(merged), batch_dim)
                  for present in edge.boundary.mask]
  return results, final_states


def _LossOutside(new_step, flat, sizes, runs, output_edges):
  """Forward loops, and backward loops as their gradient (GPipe).

  Args:
    new_step: Makes the `_Step` from flat weights + stacked inputs.
    flat: Weights, stacked inputs and initial states, flat.
    sizes: How `flat` is cut (`_Unjoin`).
    runs: The forward ticks and the backward ticks (`_PhaseTicks`).
    output_edges: The edges into the output.

  Returns:
    (outputs stacked [M, ...], final states flat).
  """

  @tf.custom_gradient
  def Pipelined(*flat):
    # Only Grad differentiates the loops: tapes must not watch them (a
    # recording tape, as Lingvo's eager trainer keeps one, would build the
    # loops' own gradients, for minutes).
    flat = [tf.stop_gradient(t) for t in flat]
    step = new_step(flat)
    v = step.Run(runs[0][1], step.Initial(_Unjoin(flat, sizes)[2]),
                 'forward')
    outputs, final_states, _, _, _ = step.Results(v)
    num_outputs = len(outputs)

    def Grad(*d_flat, variables=None):
      d_flat = [None if d is None else tf.stop_gradient(d) for d in d_flat]
      d_states = _Unjoin(d_flat[num_outputs:], sizes[2:])[0]
      # tf.gradients colocates gradient ops with the op they differentiate;
      # this one spans every chunk's device, and places its ops itself.
      with tf.compat.v1.colocate_with(None, ignore_existing=True):
        given = iter(zip(d_flat[:num_outputs], outputs))
        for e in output_edges:
          step.d_outputs[e] = []
          for d in step.Differentiable(e):
            g, y = next(given)
            step.d_outputs[e].append(
                None if not d else tf.zeros_like(y) if g is None else g)
        initial = step.Initial(final_states, d_states)
        for key in ('data', 'saved_state', 'stash'):
          initial[key] = v[key]
        backward = step.Run(runs[1][1], initial, 'backward')
        _, _, d_theta, d_x, d_init = step.Results(backward)
      return (_Join(d_theta) + d_x + _Join(d_init),
              [None] * len(variables or []))

    return outputs + _Join(final_states), Grad

  results = Pipelined(*flat)
  num_outputs = len(results) - sum(sizes[2])
  return results[:num_outputs], results[num_outputs:]


def _LossInside(new_step, flat, sizes, runs, output_edges):
  """One loop of forward and backward actions in the forward pass (1F1B).

  The backward starts from d(mean loss) / d(loss of micro-batch m) = 1 / M;
  the gradient of the pass scales the gradients the loop summed by the
  upstream gradient of the mean loss. Gradients through the other outputs
  (metrics) or the final states are errors (`_NoGradient`).

  Args:
    new_step: Makes the `_Step` from flat weights + stacked inputs.
    flat: Weights, stacked inputs and initial states, flat.
    sizes: How `flat` is cut (`_Unjoin`).
    runs: [('mixed', ticks)] (`_PhaseTicks`).
    output_edges: The edge into the output (one: the loss and metrics).

  Returns:
    (means of the outputs over micro-batches, final states flat).
  """
  (output,) = output_edges

  @tf.custom_gradient
  def Pipelined(*flat):
    flat = [tf.stop_gradient(t) for t in flat]
    step = new_step(flat)
    num_micro = step.layout.table.num_micro_batches
    device = step.chunks[-1].device
    with tf.device(device):
      step.d_outputs[output] = [
          None if not d else
          tf.constant(1.0 / num_micro if i == 0 else 0.0, s.dtype)
          for i, (d, s) in enumerate(zip(
              step.Differentiable(output),
              step.edges[output].boundary.specs))
      ]
    v = step.Run(runs[0][1], step.Initial(_Unjoin(flat, sizes)[2]), 'step')
    outputs, final_states, d_theta, d_x, _ = step.Results(v)
    with tf.device(device):
      means = [tf.reduce_mean(y, 0) for y in outputs]

    def Grad(*d_flat, variables=None):
      scale = d_flat[0]  # The upstream gradient of the mean loss.
      grads = [None if g is None else g * tf.cast(scale, g.dtype)
               for g in _Join(d_theta) + d_x]
      return (grads + [None] * len(_Join(final_states)),
              [None] * len(variables or []))

    return means + _Join(final_states), Grad

  results = Pipelined(*flat)
  num_outputs = len(results) - sum(sizes[2])
  outputs = [results[0]] + [_NoGradient(y) for y in results[1:num_outputs]]
  final_flat = [_NoGradient(t) if stage_lib.IsDifferentiable(t) else t
                for t in results[num_outputs:]]
  return outputs, final_flat
