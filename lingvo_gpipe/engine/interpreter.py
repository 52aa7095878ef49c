"""The loop engine's interpreter: what one device does for one instruction.

A lowered step (`planning.lowering.Step`) gives each device a program of
instructions; an executor (`lockstep.py`, `per_device.py`) runs them in
while loops and hands each device's instruction, as a row of ints
(`planning.rows`), to `Interpreter.Run`, which builds it: a chunk's forward
or backward call on one micro-batch. The code of each kind of instruction
exists here once, whichever executor runs it; how values move between
devices is the executor's transport (`transport.py`).

The loop variables `v` are a dict of lists:

* 'state': per chunk, its state (the forward's, carried micro-batch to
  micro-batch);
* 'saved_state', 'stash': per chunk, buffers (TensorArrays) of its state
  before each call and of what a call keeping its activations stashes;
* 'weight_stash': per chunk, in a table that splits the backward, buffers
  of what each backward stashes for its weight gradient;
* 'd_state', 'd_theta': per chunk, the gradient of its state (with the loss
  outside, carried from micro-batch m + 1 to m) and its weight-gradient sums;
* 'data', 'grad': per edge, buffers of its tensors on its reader's device
  and of their gradients on its writer's (the saved inputs a backward
  recomputes from are the 'data' buffers);
* and the fields of the transport.

Re-materialization (`schedule.RecomputedCalls`): a call that recomputes runs
its forward built inline (`stage.Stage.InlineForward`: no function call per
tick), keeps only its input and state and reruns its forward in its backward
(`stage.Stage.backward`); a call that keeps its activations runs the forward
half of TensorFlow's own split of the call (`stage.SplitCall`) and stashes
what its backward half reads.

In a table that splits the backward (zero-bubble schedules), a backward
instruction computes the gradients of its chunk's inputs and state alone
and stashes what the weight gradients need; a weight instruction computes
those from the stash and adds them to the sums (`split_backward.py`, which
then also gives the forward of a call that keeps its activations).

Weight gradients are summed densely: an embedding's sparse (IndexedSlices)
gradient becomes a dense tensor of the table's shape (`chunks.Dense`) before
it is added. The sums are loop variables, whose shapes cannot change from
tick to tick (XLA needs static shapes), and a dense sum holds one table
whatever M is. The unrolled engine keeps the sum sparse (`recompute.py`), so
an optimizer updates only the rows looked up; after this engine it updates
every row (the same values: the others get zeros).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from lingvo_gpipe.engine import chunks as chunks_lib
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.planning import lowering

F, B, W = lowering.F, lowering.B, lowering.W

Row = Dict[Any, tf.Tensor]
Variables = Dict[str, List[Any]]


def Buffer(spec: tf.TensorSpec, num_slots: int,
           shrinks: bool = False) -> tf.TensorArray:
  """A buffer of `num_slots` slots and a spare one, for writes of idle ticks.

  Args:
    spec: What a slot holds.
    num_slots: Its slots, the spare one excluded.
    shrinks: Whether a slot may hold an empty tensor instead (`Take`): the
      buffer's element shape is then unknown.

  Returns:
    The TensorArray.
  """
  if shrinks:
    return tf.TensorArray(spec.dtype, size=num_slots + 1, infer_shape=False,
                          clear_after_read=False)
  return tf.TensorArray(spec.dtype, size=num_slots + 1,
                        element_shape=spec.shape, clear_after_read=False)


def Take(buffers: Sequence[tf.TensorArray], specs: Sequence[tf.TensorSpec],
         slot: tf.Tensor, shrinks: bool
        ) -> Tuple[List[tf.Tensor], List[tf.TensorArray]]:
  """Reads a slot that is read once; empties it if the buffers shrink.

  A slot keeps its tensor until it is written again: emptied, a stash's
  memory goes as soon as its one reader has run, not when a later call
  reuses the slot.

  Returns:
    (the slot's tensors, the buffers after the read).
  """
  values = [a.read(slot) for a in buffers]
  if not shrinks:
    return values, list(buffers)
  values = [tf.ensure_shape(t, s.shape) for t, s in zip(values, specs)]
  with tf.control_dependencies(values):
    emptied = [a.write(slot, tf.zeros([0] * s.shape.rank, s.dtype))
               for a, s in zip(buffers, specs)]
  return values, emptied


def Scatter(values: Sequence[Any], mask: Sequence[bool]) -> List[Any]:
  """Puts `values` where `mask` is True, None elsewhere."""
  values = iter(values)
  return [next(values) if present else None for present in mask]


def Slice(values: Sequence[Any], sizes: Sequence[int], i: int) -> List[Any]:
  """The i-th part of `values` cut into parts of `sizes`."""
  start = sum(sizes[:i])
  return list(values[start:start + sizes[i]])


class Interpreter:
  """Builds the instructions of one step (see the module docstring).

  Attributes:
    chunks: The C `chunks.Chunk`s.
    step: The lowered step.
    boundaries: Per edge, its `chunks.Boundary`.
    stacked_inputs: The input edge's tensors, micro-batches stacked.
    first_id: int64 id of micro-batch 0.
    loss_inside: Whether the last chunk's backward starts from the loss.
    shrinks: Whether a stash slot is emptied once read (`Take`). Only for a
      table that splits the backward (a weight stash outlives the call's
      backward; emptied, zb1p's peak at K = 2, M = 8 is 1.07x 1F1B's instead
      of 1.18x) and not under XLA, whose buffers have static shapes and
      which assigns memory itself. Emptying 1F1B's stash slots gains little
      peak (its slots are the calls in flight) and cost about 8% of its step
      (docs/benchmarks.md).
    d_outputs: Per edge into the output, the gradients of its tensors:
      [M, ...] (loss outside), or scalars (loss inside); None where not
      differentiable. Set before a backward instruction is built.
  """

  def __init__(self, chunks: Sequence[chunks_lib.Chunk],
               step: lowering.Step,
               boundaries: Sequence[chunks_lib.Boundary],
               stacked_inputs: List[tf.Tensor], first_id: tf.Tensor,
               loss_inside: bool, shrinks: bool = False):
    self.chunks = list(chunks)
    self.shrinks = shrinks
    self.step = step
    self.edges = step.edges
    self.boundaries = list(boundaries)
    self.stacked_inputs = stacked_inputs
    self.first_id = first_id
    self.loss_inside = loss_inside
    self.d_outputs = {}
    self.diff_state = [[stage_lib.IsDifferentiable(t) for t in c.state]
                       for c in chunks]
    self.diff_theta = [[stage_lib.IsDifferentiable(t) for t in c.theta]
                       for c in chunks]

  def Differentiable(self, e: int) -> List[bool]:
    """Which tensors of edge e are differentiable."""
    return self.boundaries[e].differentiable

  def Own(self, k: int) -> List[int]:
    """The chunks device k runs."""
    return list(self.step.table.device_chunks[k])

  def DeviceName(self, k: int) -> str:
    """The device string of device k (that of its first chunk)."""
    return self.chunks[self.Own(k)[0]].device

  def BufferDevice(self, kind: str, index: int) -> str:
    """Where a buffer lives (`lowering.Step.Device`)."""
    return self.DeviceName(self.step.Device(kind, index))

  def ChunkFields(self, phase: str) -> Tuple[str, ...]:
    """The per-chunk variables an instruction of `phase` changes.

    A forward: the state, the saved states and the stash; a backward: the
    state gradient (with the loss outside) and the weight-gradient sums, or,
    in a table that splits the backward, the weight stash instead; a weight
    gradient: the sums. A backward and a weight gradient also empty the
    stash they read when the stashes shrink (`Take`).
    """
    if phase == F:
      return ('state', 'saved_state', 'stash')
    if phase == W:
      return ('d_theta',) + (('weight_stash',) if self.shrinks else ())
    fields = () if self.loss_inside else ('d_state',)  # Flows m + 1 -> m.
    fields += (('weight_stash',) if self.step.table.split_backward else
               ('d_theta',))
    return fields + (('stash',) if self.shrinks else ())

  def Initial(self, states: List[List[tf.Tensor]], has_buffer,
              d_states: Optional[List[List[Optional[tf.Tensor]]]] = None
             ) -> Variables:
    """The loop variables before the first tick.

    Args:
      states: Per chunk, its flat state.
      has_buffer: has_buffer(kind, e): whether edge e gets its 'data' or
        'grad' buffer (if it has slots); the transport says.
      d_states: Per chunk, the gradients of its final state (backward).

    Returns:
      The variables (without the transport's own).
    """
    step = self.step
    v = {name: [] for name in ('data', 'grad', 'state', 'saved_state',
                               'stash', 'weight_stash', 'd_state',
                               'd_theta')}
    for e in range(len(self.edges)):
      boundary = self.boundaries[e]
      for kind, specs in (('data', boundary.specs),
                          ('grad', boundary.DifferentiableSpecs())):
        with tf.device(self.BufferDevice(kind, e)):
          v[kind].append([Buffer(s, step.Size(kind, e)) for s in specs]
                         if step.Size(kind, e) and has_buffer(kind, e)
                         else [])
    for c, chunk in enumerate(self.chunks):
      with tf.device(chunk.device):
        v['state'].append(list(states[c]))
        v['saved_state'].append([Buffer(chunks_lib.Spec(t),
                                        step.Size('state', c))
                                 for t in chunk.state]
                                if step.Size('state', c) else [])
        v['stash'].append([Buffer(s, step.Size('stash', c), self.shrinks)
                           for s in chunk.split.stash_specs]
                          if step.Size('stash', c) else [])
        v['weight_stash'].append(
            [Buffer(s, step.Size('weight', c), self.shrinks)
             for s in chunk.split.weight_stash_specs]
            if step.Size('weight', c) else [])
        given = [None] * len(chunk.state) if d_states is None else d_states[c]
        v['d_state'].append([
            tf.zeros_like(t) if g is None else g
            for t, g, d in zip(chunk.state, given, self.diff_state[c]) if d
        ])
        v['d_theta'].append([tf.zeros_like(t) for t, d in
                             zip(chunk.theta, self.diff_theta[c]) if d])
    return v

  def Run(self, key: Tuple[str, int, bool], row: Row, v: Variables,
          new: Variables, transport: Any) -> List[tf.Operation]:
    """Builds one instruction; its changes go to `new`.

    Args:
      key: The instruction's (phase, chunk, keeps).
      row: Its row (`planning.rows`).
      v: The variables before it.
      new: A copy of v it updates.
      transport: Moves edges' tensors (`transport.py`).

    Returns:
      The ops that send its results to other devices.
    """
    phase, c, keeps = key
    with tf.name_scope(f'chunk{c}'):  # engine/trace.py reads it.
      if phase == F:
        return self._Forward(c, keeps, row, v, new, transport)
      if phase == W:
        self._Weight(c, row, v, new)
        return []
      return self._Backward(c, keeps, row, v, new, transport)

  def _SavedInputs(self, c: int, m: tf.Tensor, row: Row,
                   v: Variables) -> List[tf.Tensor]:
    """Chunk c's flat inputs of micro-batch m, from the buffers."""
    x = []
    for e in self.chunks[c].in_edges:
      if self.edges[e].source is None:
        x += [tf.gather(t, m) for t in self.stacked_inputs]
      else:
        x += [a.read(row['data_read', e]) for a in v['data'][e]]
    return x

  def _Forward(self, c: int, keeps: bool, row: Row, v: Variables,
               new: Variables, transport: Any) -> List[tf.Operation]:
    chunk = self.chunks[c]
    m = row['micro_batch']
    x = []
    for e in chunk.in_edges:
      if self.edges[e].source is None:
        x += [tf.gather(t, m) for t in self.stacked_inputs]
      else:
        x += transport.ForwardInput(self, e, row, v, new)
    state = v['state'][c]
    args = chunk.Args(x, state, self.first_id + tf.cast(m, tf.int64))
    if keeps:
      results, kept = chunk.split.Forward(args)
      new['stash'][c] = [a.write(row['stash_slot'], t)
                         for a, t in zip(v['stash'][c], kept)]
    else:
      results = chunk.stage.InlineForward(chunk.theta, x, state, args[-1])
    num_y = len(results) - len(state)
    new['saved_state'][c] = [a.write(row['state_slot'], t)
                             for a, t in zip(v['saved_state'][c], state)]
    new['state'][c] = list(results[num_y:])
    sizes = [len(self.boundaries[e].specs) for e in chunk.out_edges]
    sends = []
    for i, e in enumerate(chunk.out_edges):
      sends += transport.ForwardOutput(self, e, Slice(results, sizes, i), m,
                                       row, v, new)
    return sends

  def _OutputGradients(self, c: int, m: tf.Tensor, row: Row, v: Variables,
                       transport: Any) -> List[Optional[tf.Tensor]]:
    """Chunk c's flat output gradients: the loss's or received ones."""
    d_y = []
    for e in self.chunks[c].out_edges:
      if self.edges[e].target is None:
        d_y += [None if d is None else
                (d if self.loss_inside else tf.gather(d, m))
                for d in self.d_outputs[e]]
      else:
        d_y += Scatter(transport.OutputGradient(self, e, row, v),
                       self.Differentiable(e))
    return d_y

  def _Backward(self, c: int, keeps: bool, row: Row, v: Variables,
                new: Variables, transport: Any) -> List[tf.Operation]:
    chunk = self.chunks[c]
    m = row['micro_batch']
    d_y = self._OutputGradients(c, m, row, v, transport)
    x = self._SavedInputs(c, m, row, v)
    state = [a.read(row['state_slot']) for a in v['saved_state'][c]]
    d_state = Scatter(v['d_state'][c], self.diff_state[c])
    args = chunk.Args(x, state, self.first_id + tf.cast(m, tf.int64))
    stash = None
    if keeps:
      stash, new['stash'][c] = Take(v['stash'][c], chunk.split.stash_specs,
                                    row['stash_slot'], self.shrinks)
    if self.step.table.split_backward:
      d_inputs, weight_stash = chunk.split.Input(d_y + d_state, args, stash)
      new['weight_stash'][c] = [
          a.write(row['weight_slot'], t)
          for a, t in zip(v['weight_stash'][c], weight_stash)]
      grads = [None] * len(chunk.theta) + d_inputs + [None]
    elif keeps:
      d_state = [tf.zeros_like(t) if g is None and d else g
                 for t, g, d in zip(state, d_state, self.diff_state[c])]
      grads = chunk.split.Backward(d_y + d_state, args, stash)
    else:
      grads = chunk.stage.backward(chunk.theta, x, state, args[-1],
                                   d_y + d_state)
    dense = [chunks_lib.Dense(g, a) for g, a in zip(grads, args)]
    n_theta, n_x = len(chunk.theta), len(x)
    if not self.loss_inside:  # The state gradient flows m + 1 -> m.
      new['d_state'][c] = [g for g in dense[n_theta + n_x:len(args) - 1]
                           if g is not None]
    if not self.step.table.split_backward:
      self._AddWeightGradients(c, dense[:n_theta], v, new)
    d_x = dense[n_theta:n_theta + n_x]
    sizes = [len(self.boundaries[e].specs) for e in chunk.in_edges]
    sends = []
    for i, e in enumerate(chunk.in_edges):
      grads = [g for g, d in zip(Slice(d_x, sizes, i), self.Differentiable(e))
               if d]
      sends += transport.InputGradient(self, e, grads, m, row, v, new)
    return sends

  def _Weight(self, c: int, row: Row, v: Variables, new: Variables) -> None:
    """Chunk c's weight gradients of a micro-batch, from its weight stash."""
    chunk = self.chunks[c]
    stash, new['weight_stash'][c] = Take(
        v['weight_stash'][c], chunk.split.weight_stash_specs,
        row['weight_slot'], self.shrinks)
    grads = chunk.split.Weight(chunk.theta, stash)
    self._AddWeightGradients(
        c, [chunks_lib.Dense(g, t) for g, t in zip(grads, chunk.theta)], v,
        new)

  def _AddWeightGradients(self, c: int, grads: Sequence[Optional[tf.Tensor]],
                          v: Variables, new: Variables) -> None:
    """Adds one call's dense weight gradients to chunk c's sums."""
    new['d_theta'][c] = [total + g for total, g in zip(
        v['d_theta'][c], [g for g in grads if g is not None])]

  def Results(self, v: Variables):
    """(outputs stacked [M, ...], final states, d_theta, d_inputs, d_states).

    Outputs are those of every edge into the output, main first; gradients
    are on their chunk's devices, None where not differentiable.
    """
    num_micro = self.step.table.num_micro_batches

    def Stacked(a):
      # The spare slot may hold a placeholder whose unknown dimensions are
      # 0, which a gather of a list of unknown element shape would merge
      # with the micro-batches' shapes: it gets micro-batch 0's copy.
      return a.write(num_micro, a.read(0)).gather(tf.range(num_micro))

    outputs = []
    for e, edge in enumerate(self.edges):
      if edge.target is None:
        with tf.device(self.BufferDevice('data', e)):
          outputs += [Stacked(a) for a in v['data'][e]]
    with tf.device(self.chunks[0].device):  # None in an evaluation step.
      d_inputs = Scatter([Stacked(a) for a in v['grad'][0]],
                         self.Differentiable(0)
                         if v['grad'][0] else [False] * len(
                             self.Differentiable(0)))
    placed = {}
    for field in ('state', 'd_theta', 'd_state'):
      placed[field] = []
      for chunk, tensors in zip(self.chunks, v[field]):
        with tf.device(chunk.device):
          placed[field].append([tf.identity(t) for t in tensors])
    return (outputs, placed['state'],
            [Scatter(g, d) for g, d in zip(placed['d_theta'],
                                           self.diff_theta)],
            d_inputs,
            [Scatter(g, d) for g, d in zip(placed['d_state'],
                                           self.diff_state)])
