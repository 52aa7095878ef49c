"""The loop engine: a schedule table run as while loops over its ticks.

The graph holds each chunk's body once, whatever M is. A table
(`schedule.Table`) says, per tick and device, which chunk runs which
micro-batch in which phase; this engine runs its forward ticks as one
`tf.while_loop` and its backward ticks as another. At every tick each device
runs the action the table gives it under `tf.device(device_k)`: directly if
it runs the same chunk at every tick of a stretch of ticks, else through a
`tf.cond` or `tf.switch_case` that picks the chunk (an idle device computes
nothing).

Between chunks, activations and gradients travel through **per-boundary
buffers indexed by micro-batch**: the input of chunk c is a TensorArray of M
entries on chunk c's device, written at the tick chunk c - 1 produces it and
read whenever the table runs chunk c on that micro-batch, so no assumption
about the distance between producer and consumer ticks is made. The same
buffers are the saved chunk inputs the backward pass recomputes from: with
re-materialization, across ticks only the chunk inputs, the chunk states per
micro-batch, the weight-gradient sums and the current calls' activations
live. The gradients of chunk c's output travel the same way, in buffers on
chunk c's device. A tick's results are written to their buffers after the
devices' calls, at the micro-batch the table names, or at a spare entry M
when the chunk did not run: one write per chunk and tick, no branch.

This engine always re-materializes (remat='always'). 'except_last' and
'never' would keep a call's activations beyond the loop iteration that made
them; letting TensorFlow differentiate the forward loop would do that, but
its while-loop gradient of a `tf.cond` does not compile with XLA, so they are
rejected with a pointer to the unrolled engine.

Weight gradients are summed densely: an embedding's sparse (IndexedSlices)
gradient becomes a dense tensor of the table's shape.

    outputs, states = Run(chunks, thetas, inputs, states, table=table,
                          batch_dim=0, remat='always', first_id=id0,
                          training=True)
"""

import contextlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

from absl import logging
import tensorflow as tf

from lingvo_gpipe.engine import microbatch
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.planning import schedule

# Whether the loops' While, If and Case ops are lowered to Switch/Merge
# control flow when they run outside XLA. Unlowered (the default), each tick
# is one function call per loop, as in Lingvo's recurrent.py, instead of
# control ops for every loop variable and every tensor a chunk reads: 182
# kernels per step instead of 12,507 at K=4, M=8 (16 FC cells), and the
# steady step is about 1.6x faster on CPU. Lowered, the kernels inside the
# loops show in RunMetadata step stats, where tests and the timeline read
# which device ran them when; the ops and their devices are the same either
# way.
LOWER_CONTROL_FLOW = False
_LOWERING_ATTR = '_lower_using_switch_merge'
_BRANCH_OPS = ('If', 'StatelessIf', 'Case', 'StatelessCase')


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


def _Buffer(spec: tf.TensorSpec, num_micro: int) -> tf.TensorArray:
  """A per-micro-batch buffer: entries 0 .. M - 1, and M for idle writes."""
  return tf.TensorArray(spec.dtype, size=num_micro + 1,
                        element_shape=spec.shape, clear_after_read=False)


def _Dense(t: Any) -> Optional[tf.Tensor]:
  return None if t is None else tf.convert_to_tensor(t)


def _Flow(v: Any) -> tf.Tensor:
  return v.flow if isinstance(v, tf.TensorArray) else v


class _Boundary:
  """The tensors one chunk passes to the next for one micro-batch.

  Attributes:
    mask: Per output of the chunk body, whether it is a tensor (not None).
    specs: TensorSpecs of the tensors.
  """

  def __init__(self, mask: Sequence[bool], specs: Sequence[tf.TensorSpec]):
    self.mask = tuple(mask)
    self.specs = list(specs)

  def Structure(self) -> Tuple[Optional[tf.TensorSpec], ...]:
    """The body's argument tuple, specs in place of tensors."""
    specs = iter(self.specs)
    return tuple(next(specs) if present else None for present in self.mask)

  def Differentiable(self) -> List[bool]:
    return [stage_lib.IsDifferentiable(s) for s in self.specs]


class _Plan:
  """What the loops need to know of every chunk, found by tracing each once.

  Attributes:
    chunks: The C chunks (stages), each with its device.
    theta: Per chunk, its flat weights (read once per step).
    inputs: Per chunk, the boundary it reads (chunk 0: the micro-batch).
    outputs: The last chunk's output boundary.
    states: Per chunk, its flat initial state.
  """

  def __init__(self, chunks: Sequence[stage_lib.Stage], thetas: Sequence[Any],
               first_inputs: _Boundary, states: Sequence[Any],
               check_weights: bool):
    self.chunks = list(chunks)
    self.theta, self.inputs, self.states = [], [], []
    boundary = first_inputs
    id_spec = tf.TensorSpec([], tf.int64)
    for s, theta, state in zip(chunks, thetas, states):
      with tf.device(s.device):
        theta_flat = s.FlattenTheta(theta)
      x_specs, state_flat = s.FlattenCall(boundary.Structure(), state)
      args = (theta_flat, x_specs, state_flat, id_spec)
      if check_weights:  # The recompute must see every weight in theta.
        s.CheckNoCapturedWeights(*args)
      with tf.device(s.device):
        results = s.forward.get_concrete_function(*args).structured_outputs
      self.theta.append(theta_flat)
      self.inputs.append(boundary)
      self.states.append(state_flat)
      num_y = len(results) - s.num_state
      boundary = _Boundary(s.output_mask, [_Spec(y) for y in results[:num_y]])
    self.outputs = boundary

  @property
  def num_chunks(self) -> int:
    return len(self.chunks)

  def Output(self, c: int) -> _Boundary:
    return self.inputs[c + 1] if c + 1 < self.num_chunks else self.outputs

  def Device(self, c: int) -> str:
    return self.chunks[c].device


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


def _OnChunkDevices(plan: _Plan,
                    per_chunk: List[List[tf.Tensor]]) -> List[List[tf.Tensor]]:
  """Identities of each chunk's loop results on the chunk's device.

  A while loop's outputs have no device of their own; gradients and states
  that leave the loops are placed where their chunk runs (distribution
  strategies reduce gradients from the devices they are on).

  Args:
    plan: The chunks.
    per_chunk: Per chunk, tensors that came out of a loop.

  Returns:
    The same structure, each tensor an identity on its chunk's device.
  """
  placed = []
  for c, tensors in enumerate(per_chunk):
    with tf.device(plan.Device(c)):
      placed.append([tf.identity(t) for t in tensors])
  return placed


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


class _Segment:
  """A stretch of ticks of one phase that one while loop runs.

  Attributes:
    choices: Per device, the chunks it runs in the segment, in order of
      first appearance; a device's action at a tick is a branch index into
      its choices, or len(choices) when it idles.
    idles: Per device, whether it idles at some tick of the segment.
    rows: Per tick, K branch indices, then K micro-batches (0 when idle),
      then per chunk the buffer entry it writes (its micro-batch, or M).
  """

  def __init__(self, ticks: Sequence[schedule.Tick], num_chunks: int,
               num_micro: int):
    num_devices = len(ticks[0])
    self.choices = [[] for _ in range(num_devices)]
    self.idles = [False] * num_devices
    for tick in ticks:
      for k, action in enumerate(tick):
        if action is None:
          self.idles[k] = True
        elif action.chunk not in self.choices[k]:
          self.choices[k].append(action.chunk)
    self.rows = []
    for tick in ticks:
      branches, micro_batches = [], []
      writes = [num_micro] * num_chunks
      for k, action in enumerate(tick):
        if action is None:
          branches.append(len(self.choices[k]))
          micro_batches.append(0)
        else:
          branches.append(self.choices[k].index(action.chunk))
          micro_batches.append(action.micro_batch)
          writes[action.chunk] = action.micro_batch
      self.rows.append(branches + micro_batches + writes)


def _Segments(ticks: Sequence[schedule.Tick], num_chunks: int,
              num_micro: int) -> List[_Segment]:
  """Cuts one phase's ticks into stretches in which every device works or not.

  A GPipe table has K - 1 filling ticks, the ticks in which every device
  works, and K - 1 draining ticks: three segments, whatever M is. In the
  middle one a device with one chunk (v = 1) calls it directly, with no
  branch.

  Args:
    ticks: The ticks of one phase, in order.
    num_chunks: C.
    num_micro: M.

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
  return [_Segment(run, num_chunks, num_micro) for _, run in runs]


def _Dispatch(segment: _Segment, k: int, branch: tf.Tensor,
              run: Callable[[int], Any], idle: Callable[[], Any],
              name: str) -> Any:
  """Runs device k's action of the tick: chunk `choices[branch]`, or idle.

  Args:
    segment: The segment being built.
    k: The device.
    branch: int32 scalar, the device's branch index at this tick.
    run: run(chunk) builds the chunk's call; returns the device's values.
    idle: Returns the device's values unchanged.
    name: The branch op's name.

  Returns:
    What `run` or `idle` returns.
  """
  choices = segment.choices[k]
  fns = [lambda c=c: run(c) for c in choices]
  if segment.idles[k]:
    fns.append(idle)
  if len(fns) == 1:
    return fns[0]()
  if len(fns) == 2 and segment.idles[k]:
    results = tf.cond(branch < len(choices), fns[0], fns[1], name=name)
  else:
    results = tf.switch_case(branch, fns, name=name)
  _KeepUnlowered(results, _BRANCH_OPS)
  return results


def _Loop(segments: Sequence[_Segment], body, loop_vars, shape_invariants,
          name: str):
  """Runs `body(segment, row, loop_vars)` for every tick of the segments.

  One while loop per segment, each starting when the previous has ended.

  Args:
    segments: The phase's segments.
    body: Builds one tick from the segment, its row (an int32 vector, see
      `_Segment.rows`) and the loop variables; returns new loop variables.
    loop_vars: The loop variables (nests of tensors and TensorArrays).
    shape_invariants: Their shapes, as tf.while_loop takes them.
    name: The loops' name prefix.

  Returns:
    The loop variables after the last tick.
  """
  for i, segment in enumerate(segments):
    rows = tf.constant(segment.rows, tf.int32, name=f'{name}_ticks_{i}')

    def Body(t, *state, rows=rows, segment=segment):
      return [t + 1] + list(body(segment, rows[t], list(state)))

    # The loop starts when the previous one has ended, whatever variable it
    # reads first: its counter waits for all of them. Unlowered, a While's
    # outputs appear together anyway; lowered (LOWER_CONTROL_FLOW), each
    # loop variable leaves its loop on its own, and a device could start its
    # next call while its last one still runs.
    with tf.control_dependencies(
        [_Flow(v) for v in tf.nest.flatten(loop_vars)] if i else []):
      start = tf.identity(tf.constant(0))
    num_ticks = len(segment.rows)
    results = tf.while_loop(
        lambda t, *_, n=num_ticks: t < n,
        Body, [start] + list(loop_vars),
        shape_invariants=[tf.TensorShape([])] + list(shape_invariants),
        # A tick starts when the previous one has ended, as the unlowered
        # While runs it; lowered loops would otherwise overlap ticks.
        parallel_iterations=1,
        maximum_iterations=num_ticks,
        name=f'{name}_{i}')
    _KeepUnlowered(results[0], ('While', 'StatelessWhile'))
    loop_vars = list(results[1:])
  return loop_vars


def _Unknown(n: int) -> List[tf.TensorShape]:
  return [tf.TensorShape(None)] * n


class _Step:
  """The loops of one step over a table: forward, and its gradient.

  Attributes:
    plan: The chunks.
    theta: Per chunk, its flat weights.
    stacked_inputs: The first chunk's input tensors, micro-batches stacked.
    first_id: int64 id of micro-batch 0.
    num_micro: M.
    num_devices: K.
  """

  def __init__(self, plan: _Plan, theta: List[List[tf.Tensor]],
               stacked_inputs: List[tf.Tensor], first_id: tf.Tensor,
               num_micro: int, num_devices: int):
    self.plan = plan
    self.theta = theta
    self.stacked_inputs = stacked_inputs
    self.first_id = first_id
    self.num_micro = num_micro
    self.num_devices = num_devices

  def _Chunks(self, k: int) -> List[int]:
    return list(range(k, self.plan.num_chunks, self.num_devices))

  def _Id(self, m: tf.Tensor) -> tf.Tensor:
    return self.first_id + tf.cast(m, tf.int64)

  def _ChunkInput(self, c: int, m: tf.Tensor,
                  buffers: List[List[tf.TensorArray]]) -> List[tf.Tensor]:
    """Chunk c's input of micro-batch m: the stacked input or its buffer."""
    if c == 0:
      return [tf.gather(x, m) for x in self.stacked_inputs]
    return [a.read(m) for a in buffers[c]]

  def Forward(self, ticks: Sequence[schedule.Tick],
              initial_states: List[List[tf.Tensor]], save: bool):
    """The forward loops.

    Args:
      ticks: The table's forward ticks.
      initial_states: Per chunk, its flat state before micro-batch 0.
      save: Whether to save every chunk's state per micro-batch for the
        backward loops (the inputs are in the buffers anyway).

    Returns:
      (outputs, states, buffers, saved_states): the last chunk's outputs
      stacked [M, ...], each chunk's final flat state, per chunk its input
      buffers (empty for chunk 0), and per chunk the TensorArrays of its
      states (empty lists unless `save`).
    """
    plan, num_micro = self.plan, self.num_micro
    num_chunks = plan.num_chunks
    sent, buffers, saved_states = [], [], []
    for c in range(num_chunks):
      with tf.device(plan.Device(c)):
        sent.append([_Placeholder(spec) for spec in plan.Output(c).specs])
        buffers.append([_Buffer(spec, num_micro)
                        for spec in plan.inputs[c].specs] if c else [])
        saved_states.append([_Buffer(_Spec(t), num_micro)
                             for t in initial_states[c]] if save else [])
    with tf.device(plan.Device(num_chunks - 1)):
      outputs = [_Buffer(spec, num_micro) for spec in plan.outputs.specs]
    invariants = ([[spec.shape for spec in plan.Output(c).specs]
                   for c in range(num_chunks)],
                  [[t.shape for t in s] for s in initial_states],
                  [_Unknown(len(a)) for a in buffers],
                  [_Unknown(len(a)) for a in saved_states],
                  _Unknown(len(outputs)))

    def Body(segment, row, loop_vars):
      sent, states, buffers, saved_states, outputs = loop_vars
      sent, states, saved_states = list(sent), list(states), list(
          saved_states)
      for k in range(self.num_devices):
        chunks = self._Chunks(k)
        m = row[self.num_devices + k]

        def Device(chunks):
          return ([sent[c] for c in chunks], [states[c] for c in chunks],
                  [saved_states[c] for c in chunks])

        def Run(c, m=m, chunks=chunks):
          x = self._ChunkInput(c, m, buffers)
          with tf.name_scope(f'chunk{c}'):  # engine/trace.py reads it.
            results = plan.chunks[c].forward(self.theta[c], x, states[c],
                                             self._Id(m))
          num_y = len(results) - len(states[c])
          values = Device(chunks)
          i = chunks.index(c)
          values[0][i] = list(results[:num_y])
          values[1][i] = list(results[num_y:])
          values[2][i] = [a.write(m, v)
                          for a, v in zip(saved_states[c], states[c])]
          return values

        with tf.device(plan.Device(k)), tf.name_scope(f'device{k}'):
          values = _Dispatch(segment, k, row[k], Run,
                             lambda chunks=chunks: Device(chunks),
                             f'device{k}_forward')
        for i, c in enumerate(chunks):
          sent[c], states[c], saved_states[c] = (values[0][i], values[1][i],
                                                 values[2][i])
      # Each chunk's output goes to the next chunk's buffer, on its device.
      buffers, written = list(buffers), 2 * self.num_devices
      for c in range(num_chunks):
        target = buffers[c + 1] if c + 1 < num_chunks else outputs
        with tf.device(plan.Device(min(c + 1, num_chunks - 1))):
          target = [a.write(row[written + c], v)
                    for a, v in zip(target, sent[c])]
        if c + 1 < num_chunks:
          buffers[c + 1] = target
        else:
          outputs = target
      return sent, states, buffers, saved_states, outputs

    _, states, buffers, saved_states, outputs = _Loop(
        _Segments(ticks, num_chunks, num_micro), Body,
        [sent, list(initial_states), buffers, saved_states, outputs],
        list(invariants), 'forward')
    with tf.device(plan.Device(num_chunks - 1)):
      stacked = [a.gather(tf.range(num_micro)) for a in outputs]
    return stacked, _OnChunkDevices(plan, states), buffers, saved_states

  def Backward(self, ticks: Sequence[schedule.Tick],
               buffers: List[List[tf.TensorArray]],
               saved_states: List[List[tf.TensorArray]],
               d_outputs: List[Optional[tf.Tensor]],
               d_states: List[List[Optional[tf.Tensor]]]):
    """The gradient loops: recompute and differentiate every call.

    Args:
      ticks: The table's backward ticks.
      buffers: Per chunk c > 0, the buffers of its inputs.
      saved_states: Per chunk, TensorArrays of its state before each
        micro-batch.
      d_outputs: Gradients of the last chunk's stacked outputs (None where
        there is none).
      d_states: Per chunk, gradients of its final state tensors (or None).

    Returns:
      (d_theta, d_stacked_inputs, d_states): per chunk the gradients of its
      flat weights, the gradients of the stacked inputs, and per chunk the
      gradients of its initial state; None where not differentiable.
    """
    plan, num_micro = self.plan, self.num_micro
    num_chunks = plan.num_chunks
    diff_x = [plan.inputs[c].Differentiable() for c in range(num_chunks)]
    diff_y = [plan.Output(c).Differentiable() for c in range(num_chunks)]
    diff_state = [[stage_lib.IsDifferentiable(t) for t in plan.states[c]]
                  for c in range(num_chunks)]
    diff_theta = [[stage_lib.IsDifferentiable(t) for t in self.theta[c]]
                  for c in range(num_chunks)]
    with tf.device(plan.Device(num_chunks - 1)):
      d_outputs = [
          None if not d else
          (tf.zeros([num_micro] + spec.shape.as_list(), spec.dtype)
           if g is None else g)
          for d, g, spec in zip(diff_y[-1], d_outputs, plan.outputs.specs)
      ]
    sent, d_state_vars, d_theta_vars, grads = [], [], [], []
    for c in range(num_chunks):
      with tf.device(plan.Device(c)):
        # sent[c]: the gradients of chunk c's differentiable inputs from its
        # latest call; grads[c]: buffers of the gradients of its outputs,
        # written by chunk c + 1 (chunk 0's input gradients go to grads[-1]).
        sent.append([_Placeholder(spec)
                     for spec, d in zip(plan.inputs[c].specs, diff_x[c]) if d])
        grads.append([
            _Buffer(spec, num_micro)
            for spec, d in zip(plan.Output(c).specs, diff_y[c]) if d
        ] if c + 1 < num_chunks else [])
        d_state_vars.append([
            tf.zeros_like(t) if g is None else g
            for t, g, d in zip(plan.states[c], d_states[c], diff_state[c]) if d
        ])
        d_theta_vars.append([
            tf.zeros_like(t) for t, d in zip(self.theta[c], diff_theta[c]) if d
        ])
    with tf.device(plan.Device(0)):
      d_x0 = [_Buffer(spec, num_micro)
              for spec, d in zip(plan.inputs[0].specs, diff_x[0]) if d]
    invariants = ([[spec.shape for spec, d in zip(plan.inputs[c].specs,
                                                  diff_x[c]) if d]
                   for c in range(num_chunks)],
                  [[t.shape for t in v] for v in d_state_vars],
                  [[t.shape for t in v] for v in d_theta_vars],
                  [_Unknown(len(a)) for a in grads],
                  _Unknown(len(d_x0)))

    def Body(segment, row, loop_vars):
      sent, d_state_vars, d_theta_vars, grads, d_x0 = loop_vars
      sent, d_state_vars, d_theta_vars = (list(sent), list(d_state_vars),
                                          list(d_theta_vars))
      for k in range(self.num_devices):
        chunks = self._Chunks(k)
        m = row[self.num_devices + k]

        def Device(chunks):
          return ([sent[c] for c in chunks], [d_state_vars[c] for c in chunks],
                  [d_theta_vars[c] for c in chunks])

        def Run(c, m=m, chunks=chunks):
          x = self._ChunkInput(c, m, buffers)
          state = [a.read(m) for a in saved_states[c]]
          if c == num_chunks - 1:
            d_y = [None if d is None else tf.gather(d, m) for d in d_outputs]
          else:
            given = iter([a.read(m) for a in grads[c]])
            d_y = [next(given) if d else None for d in diff_y[c]]
          given = iter(d_state_vars[c])
          d_state = [next(given) if d else None for d in diff_state[c]]
          with tf.name_scope(f'chunk{c}'):
            results = plan.chunks[c].backward(self.theta[c], x, state,
                                              self._Id(m), d_y + d_state)
          n_theta, n_x = len(self.theta[c]), len(x)
          d_theta = [_Dense(g) for g in results[:n_theta]]
          d_x = [_Dense(g) for g in results[n_theta:n_theta + n_x]]
          d_state = [_Dense(g) for g in results[n_theta + n_x:]]
          values = Device(chunks)
          i = chunks.index(c)
          values[0][i] = [g for g in d_x if g is not None]
          values[1][i] = [g for g in d_state if g is not None]
          values[2][i] = [total + g for total, g in zip(
              d_theta_vars[c], [g for g in d_theta if g is not None])]
          return values

        with tf.device(plan.Device(k)), tf.name_scope(f'device{k}'):
          values = _Dispatch(segment, k, row[k], Run,
                             lambda chunks=chunks: Device(chunks),
                             f'device{k}_backward')
        for i, c in enumerate(chunks):
          sent[c], d_state_vars[c], d_theta_vars[c] = (
              values[0][i], values[1][i], values[2][i])
      # Each chunk's input gradients go to the previous chunk's buffer.
      grads, written = list(grads), 2 * self.num_devices
      for c in range(num_chunks):
        target = grads[c - 1] if c else d_x0
        with tf.device(plan.Device(max(c - 1, 0))):
          target = [a.write(row[written + c], g)
                    for a, g in zip(target, sent[c])]
        if c:
          grads[c - 1] = target
        else:
          d_x0 = target
      return sent, d_state_vars, d_theta_vars, grads, d_x0

    _, d_state_vars, d_theta_vars, _, d_x0 = _Loop(
        _Segments(ticks, num_chunks, num_micro), Body,
        [sent, d_state_vars, d_theta_vars, grads, d_x0], list(invariants),
        'backward')

    def Scatter(values, mask):
      values = iter(values)
      return [next(values) if present else None for present in mask]

    with tf.device(plan.Device(0)):
      d_inputs = Scatter([a.gather(tf.range(num_micro)) for a in d_x0],
                         diff_x[0])
    d_theta_vars = _OnChunkDevices(plan, d_theta_vars)
    d_state_vars = _OnChunkDevices(plan, d_state_vars)
    return ([Scatter(v, d) for v, d in zip(d_theta_vars, diff_theta)],
            d_inputs,
            [Scatter(v, d) for v, d in zip(d_state_vars, diff_state)])


def _PhaseTicks(table: schedule.Table) -> Tuple[Sequence[schedule.Tick],
                                               Sequence[schedule.Tick]]:
  """The table's forward ticks and backward ticks.

  Raises:
    ValueError: if the table does not run all its forward ticks before all
      its backward ticks, or a chunk's backward does not take the
      micro-batches in the reverse order of its forward (the chunk's state
      gradient flows back along that order).
  """
  runs = table.PhaseRuns()
  if [phase for phase, _ in runs] != [schedule.FORWARD, schedule.BACKWARD]:
    raise ValueError(
        f"engine='loop' runs tables whose forward ticks all come before "
        f'their backward ticks; schedule={table.schedule!r} interleaves '
        'them.')
  for c in range(table.num_chunks):
    order = [[a.micro_batch for tick in ticks for a in tick
              if a is not None and a.chunk == c] for _, ticks in runs]
    if order[1] != order[0][::-1]:
      raise ValueError(
          f"engine='loop': schedule={table.schedule!r} runs chunk {c}'s "
          f'backward on micro-batches {order[1]}, not in the reverse order '
          f'of its forward {order[0]}.')
  return runs[0][1], runs[1][1]


def Run(chunks: Sequence[stage_lib.Stage], thetas: Sequence[Any],
        inputs: Sequence[Optional[tf.Tensor]], states: List[Any], *,
        table: schedule.Table, batch_dim: int, remat: str,
        first_id: tf.Tensor,
        training: bool) -> Tuple[List[Optional[tf.Tensor]], List[Any]]:
  """Builds one pipelined pass as while loops (see the module docstring).

  Args:
    chunks: C = K v chunks; chunk c runs on its device (that of c mod K).
    thetas: C nests of weights.
    inputs: The mini-batch inputs, tensors or None.
    states: C nests of initial chunk states.
    table: The schedule.
    batch_dim: The dimension inputs are split and outputs merged along.
    remat: 'always' (see `schedule.CheckEngine`).
    first_id: int64 id of micro-batch 0; micro-batch m gets first_id + m.
    training: If False, the forward loops save nothing and have no gradient.

  Returns:
    (outputs, states): the last chunk's outputs merged along batch_dim and
    each chunk's state after the last micro-batch.

  Raises:
    ValueError: if remat or the table is not supported by this engine.
  """
  schedule.CheckEngine('loop', remat)
  forward_ticks, backward_ticks = _PhaseTicks(table)
  num_micro = table.num_micro_batches
  input_mask = [x is not None for x in inputs]
  with tf.device(chunks[0].device):
    stacked = [microbatch.Stack(x, num_micro, batch_dim)
               for x in inputs if x is not None]
  plan = _Plan(chunks, thetas,
               _Boundary(input_mask, [tf.TensorSpec(x.shape[1:], x.dtype)
                                      for x in stacked]), states, training)
  sizes = ([len(theta) for theta in plan.theta], [len(stacked)],
           [len(state) for state in plan.states])
  flat = _Join(plan.theta) + stacked + _Join(plan.states)
  num_outputs = len(plan.outputs.specs)

  if training:

    @tf.custom_gradient
    def Pipelined(*flat):
      # Only Grad differentiates the loops: tapes must not watch them (a
      # recording tape, as Lingvo's eager trainer keeps one, would build the
      # loops' own gradients, for minutes).
      theta, (x,), init = _Unjoin([tf.stop_gradient(t) for t in flat], sizes)
      step = _Step(plan, theta, x, first_id, num_micro, table.num_devices)
      outputs, final_states, buffers, saved_states = step.Forward(
          forward_ticks, init, save=True)

      def Grad(*d_flat, variables=None):
        d_flat = [None if d is None else tf.stop_gradient(d) for d in d_flat]
        d_states = _Unjoin(d_flat[num_outputs:], sizes[2:])[0]
        # tf.gradients colocates gradient ops with the op they differentiate;
        # this one spans every chunk's device, and places its ops itself.
        with tf.compat.v1.colocate_with(None, ignore_existing=True):
          d_theta, d_x, d_init = step.Backward(backward_ticks, buffers,
                                               saved_states,
                                               d_flat[:num_outputs], d_states)
        return (_Join(d_theta) + d_x + _Join(d_init),
                [None] * len(variables or []))

      return outputs + _Join(final_states), Grad

    results = Pipelined(*flat)
    outputs, final_flat = results[:num_outputs], results[num_outputs:]
  else:
    step = _Step(plan, plan.theta, stacked, first_id, num_micro,
                 table.num_devices)
    outputs, final_states, _, _ = step.Forward(forward_ticks, plan.states,
                                               save=False)
    final_flat = _Join(final_states)
  with tf.device(chunks[-1].device):
    merged = iter([microbatch.Unstack(y, batch_dim) for y in outputs])
  outputs = [next(merged) if present else None for present in plan.outputs.mask]
  final_states = _Unjoin(final_flat, sizes[2:])[0]
  return outputs, [tf.nest.pack_sequence_as(state, part)
                   for state, part in zip(states, final_states)]
