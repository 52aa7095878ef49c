"""The loop engine: a GPipe step as while loops over clock ticks.

The graph holds each stage body once, whatever M is. The forward pass is one
`tf.while_loop` over the ticks of `schedule.PhaseTable(ticks, 'forward')`: at
tick t every stage k whose table entry m is not `schedule.IDLE` runs its body
on micro-batch m under `tf.device(device_k)` (a `tf.cond`, so idle stages
compute nothing). Stage k reads the output stage k - 1 produced at tick t - 1
from a loop variable (one micro-batch's activations cross devices per tick)
and, when training with re-materialization, saves its input and state in
TensorArrays on its own device.

The gradient of the whole pass is a second loop over the backward table (the
forward ticks in reverse): stage k reads its saved input, recomputes its body
and differentiates it (`stage.Stage.backward`) with the gradient stage k + 1
produced at the previous tick, and adds its weight gradients to loop
variables. Across ticks only the saved stage inputs, the gradient sums and
the current calls' activations live.

This engine always re-materializes (remat='always'). 'except_last' and
'never' would keep a call's activations beyond the loop iteration that made
them; letting TensorFlow differentiate the forward loop would do that, but
its while-loop gradient of a `tf.cond` does not compile with XLA, so they are
rejected with a pointer to the unrolled engine.

Weight gradients are summed densely: an embedding's sparse (IndexedSlices)
gradient becomes a dense tensor of the table's shape.

    outputs, states = Run(stages, thetas, inputs, states, num_micro_batches=32,
                          batch_dim=0, remat='always', first_id=id0,
                          training=True)
"""

from typing import Any, List, Optional, Sequence, Tuple

from absl import logging
import tensorflow as tf

from lingvo_gpipe.engine import microbatch
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.planning import schedule

# Whether the loops' While and If ops are lowered to Switch/Merge control
# flow when they run outside XLA. Unlowered (the default), each tick is one
# function call per loop, as in Lingvo's recurrent.py, instead of control ops
# for every loop variable and every tensor a stage reads: 182 kernels per
# step instead of 12,507 at K=4, M=8 (16 FC cells), and the steady step is
# about 1.6x faster on CPU. Lowered, the kernels inside the loops show in
# RunMetadata step stats, where tests check which device ran them; the ops
# and their devices are the same either way.
LOWER_CONTROL_FLOW = False
_LOWERING_ATTR = '_lower_using_switch_merge'
_IF_OPS = ('If', 'StatelessIf')


def _Spec(t: tf.Tensor) -> tf.TensorSpec:
  return tf.TensorSpec(t.shape, t.dtype)


def _Placeholder(spec: tf.TensorSpec) -> tf.Tensor:
  """Zeros of `spec` (unknown dimensions get size 0): a loop's first value."""
  shape = [0 if d is None else d for d in spec.shape.as_list()]
  return tf.zeros(shape, spec.dtype)


def _Array(spec: tf.TensorSpec, size: int) -> tf.TensorArray:
  return tf.TensorArray(spec.dtype, size=size, element_shape=spec.shape,
                        clear_after_read=False)


def _Dense(t: Any) -> Optional[tf.Tensor]:
  return None if t is None else tf.convert_to_tensor(t)


class _Boundary:
  """The tensors one stage passes to the next for one micro-batch.

  Attributes:
    mask: Per output of the stage body, whether it is a tensor (not None).
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
  """What the loops need to know of every stage, found by tracing each once.

  Attributes:
    stages: The K stages.
    theta: Per stage, its flat weights (read once per step).
    inputs: Per stage, the boundary it reads (stage 0: the micro-batch).
    outputs: The last stage's output boundary.
    states: Per stage, its flat initial state.
  """

  def __init__(self, stages: Sequence[stage_lib.Stage], thetas: Sequence[Any],
               first_inputs: _Boundary, states: Sequence[Any],
               check_weights: bool):
    self.stages = list(stages)
    self.theta, self.inputs, self.states = [], [], []
    boundary = first_inputs
    id_spec = tf.TensorSpec([], tf.int64)
    for s, theta, state in zip(stages, thetas, states):
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
  def num_stages(self) -> int:
    return len(self.stages)

  def Output(self, k: int) -> _Boundary:
    return self.inputs[k + 1] if k + 1 < self.num_stages else self.outputs


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


def _OnStageDevices(plan: _Plan,
                    per_stage: List[List[tf.Tensor]]) -> List[List[tf.Tensor]]:
  """Identities of each stage's loop results on the stage's device.

  A while loop's outputs have no device of their own; gradients and states
  that leave the loop are placed where their stage runs (distribution
  strategies reduce gradients from the devices they are on).

  Args:
    plan: The stages.
    per_stage: Per stage, tensors that came out of a loop.

  Returns:
    The same structure, each tensor an identity on its stage's device.
  """
  placed = []
  for s, tensors in zip(plan.stages, per_stage):
    with tf.device(s.device):
      placed.append([tf.identity(t) for t in tensors])
  return placed


def _KeepUnlowered(outputs: Any, op_types: Tuple[str, ...]) -> None:
  """Marks the While or If op that made `outputs` to run as function calls.

  Args:
    outputs: What tf.while_loop or tf.cond returned (TensorArrays too).
    op_types: The op types to look for, e.g. ('If', 'StatelessIf').
  """
  if LOWER_CONTROL_FLOW or tf.executing_eagerly():
    return
  for t in tf.nest.flatten(outputs):
    t = t.flow if isinstance(t, tf.TensorArray) else t
    op = t.op
    while op.type == 'Identity' and op.inputs:
      op = op.inputs[0].op
    if op.type in op_types:
      try:
        op._set_attr(  # pylint: disable=protected-access
            _LOWERING_ATTR, tf.compat.v1.AttrValue(b=False))
      except AttributeError:  # A TF without Operation._set_attr: lowered.
        logging.warning('Cannot keep %s unlowered; it runs lowered.', op.name)
      return


def _Segments(table: List[List[int]]) -> List[Tuple[List[List[int]], bool]]:
  """Cuts a phase table into runs of ticks: every stage busy, or not.

  GPipe's table has K - 1 filling ticks, M - K + 1 ticks in which every stage
  works, and K - 1 draining ticks.

  Args:
    table: Rows of micro-batches per stage (`schedule.PhaseTable`).

  Returns:
    (rows, busy) pairs in order; `busy` if no row has an idle stage.
  """
  segments = []
  for row in table:
    busy = schedule.IDLE not in row
    if segments and segments[-1][1] == busy:
      segments[-1][0].append(row)
    else:
      segments.append(([row], busy))
  return segments


def _Call(micro_batch: tf.Tensor, run, skip, busy: bool, name: str):
  """`run()` if every stage is busy, else a tf.cond on `micro_batch`."""
  if busy:
    return run()
  results = tf.cond(micro_batch >= 0, run, skip, name=name)
  _KeepUnlowered(results, _IF_OPS)
  return results


def _Loop(table: List[List[int]], body, loop_vars, shape_invariants,
          name: str):
  """Runs `body(m_per_stage, loop_vars, busy)` for every row of `table`.

  One while loop per segment (`_Segments`): the stages of a busy segment's
  ticks call their bodies directly, the others through a tf.cond that skips
  idle stages. At most three loops, whatever M is.

  Args:
    table: Rows of micro-batches per stage.
    body: Builds one tick; returns the new loop variables.
    loop_vars: The loop variables (nests of tensors and TensorArrays).
    shape_invariants: Their shapes, as tf.while_loop takes them.
    name: The loops' name prefix.

  Returns:
    The loop variables after the last tick.
  """
  for i, (rows, busy) in enumerate(_Segments(table)):
    ticks = tf.constant(rows, tf.int32, name=f'{name}_ticks_{i}')

    def Body(t, *state, ticks=ticks, busy=busy):
      return [t + 1] + list(body(ticks[t], list(state), busy))

    # The loop starts when the previous one has ended, whatever variable it
    # reads first: its counter waits for all of them. Unlowered, a While's
    # outputs appear together anyway; lowered (LOWER_CONTROL_FLOW), each
    # loop variable leaves its loop on its own, and a stage could start its
    # next call while its last one still runs.
    with tf.control_dependencies([
        v.flow if isinstance(v, tf.TensorArray) else v
        for v in tf.nest.flatten(loop_vars)
    ] if i else []):
      start = tf.identity(tf.constant(0))
    results = tf.while_loop(
        lambda t, *_, n=len(rows): t < n,
        Body, [start] + list(loop_vars),
        shape_invariants=[tf.TensorShape([])] + list(shape_invariants),
        # A tick starts when the previous one has ended, as the unlowered
        # While runs it; lowered loops would otherwise overlap ticks.
        parallel_iterations=1,
        maximum_iterations=len(rows),
        name=f'{name}_{i}')
    _KeepUnlowered(results[0], ('While', 'StatelessWhile'))
    loop_vars = list(results[1:])
  return loop_vars


def _Forward(plan: _Plan, theta: List[List[tf.Tensor]],
             stacked_inputs: List[tf.Tensor],
             initial_states: List[List[tf.Tensor]], first_id: tf.Tensor,
             num_micro: int, save: bool):
  """The forward loop.

  Args:
    plan: The stages.
    theta: Per stage, its flat weights.
    stacked_inputs: The first stage's input tensors, micro-batches stacked.
    initial_states: Per stage, its flat state before micro-batch 0.
    first_id: int64 id of micro-batch 0.
    num_micro: M.
    save: Whether to save every stage's inputs and states for the backward
      loop.

  Returns:
    (outputs, states, saved_inputs, saved_states): the last stage's outputs
    stacked [M, ...], each stage's final flat state, and per stage the
    TensorArrays of its inputs (empty for stage 0) and states (empty lists
    unless `save`).
  """
  num_stages = plan.num_stages
  carries, saved_x, saved_states = [], [], []
  for k, s in enumerate(plan.stages):
    with tf.device(s.device):
      carries.append([] if k == 0 else
                     [_Placeholder(spec) for spec in plan.inputs[k].specs])
      saved_x.append([_Array(spec, num_micro) for spec in plan.inputs[k].specs]
                     if save and k > 0 else [])
      saved_states.append([_Array(_Spec(t), num_micro)
                           for t in initial_states[k]] if save else [])
  with tf.device(plan.stages[-1].device):
    outputs = [_Array(spec, num_micro) for spec in plan.outputs.specs]
  invariants = ([[spec.shape for spec in plan.inputs[k].specs] if k else []
                 for k in range(num_stages)],
                [[t.shape for t in s] for s in initial_states],
                [[tf.TensorShape(None)] * len(a) for a in saved_x],
                [[tf.TensorShape(None)] * len(a) for a in saved_states],
                [tf.TensorShape(None)] * len(outputs))

  def Body(micro_batches, loop_vars, busy):
    carries, states, saved_x, saved_states, outputs = loop_vars
    new_carries = list(carries)
    new_states, new_saved_x = list(states), list(saved_x)
    new_saved_states, new_outputs = list(saved_states), outputs
    for k, s in enumerate(plan.stages):
      last = k == num_stages - 1
      with tf.device(s.device), tf.name_scope(f'stage{k}'):
        m = micro_batches[k]

        def Run(k=k, s=s, m=m, last=last):
          x = ([tf.gather(x, m) for x in stacked_inputs] if k == 0 else
               carries[k])
          results = s.forward(theta[k], x, states[k],
                              first_id + tf.cast(m, tf.int64))
          num_y = len(results) - len(states[k])
          y, state = list(results[:num_y]), list(results[num_y:])
          sent = ([a.write(m, v) for a, v in zip(outputs, y)] if last else y)
          return (sent, state, [a.write(m, v) for a, v in zip(saved_x[k], x)],
                  [a.write(m, v) for a, v in zip(saved_states[k], states[k])])

        def Skip(k=k, last=last):
          return (outputs if last else carries[k + 1], states[k], saved_x[k],
                  saved_states[k])

        sent, new_states[k], new_saved_x[k], new_saved_states[k] = _Call(
            m, Run, Skip, busy, 'forward')
        if last:
          new_outputs = sent
        else:
          new_carries[k + 1] = sent
    return (new_carries, new_states, new_saved_x, new_saved_states,
            new_outputs)

  carries, states, saved_x, saved_states, outputs = _Loop(
      schedule.PhaseTable(schedule.GPipeTicks(num_stages, num_micro),
                          'forward'),
      lambda m, v, busy: list(Body(m, v, busy)),
      [carries, list(initial_states), saved_x, saved_states, outputs],
      list(invariants), 'forward')
  with tf.device(plan.stages[-1].device):
    stacked = [a.stack() for a in outputs]
  return stacked, _OnStageDevices(plan, states), saved_x, saved_states


def _Backward(plan: _Plan, theta: List[List[tf.Tensor]],
              stacked_inputs: List[tf.Tensor],
              saved_x: List[List[tf.TensorArray]],
              saved_states: List[List[tf.TensorArray]],
              d_outputs: List[Optional[tf.Tensor]],
              d_states: List[List[Optional[tf.Tensor]]],
              first_id: tf.Tensor, num_micro: int):
  """The gradient loop: recompute and differentiate every call, in reverse.

  Args:
    plan: The stages.
    theta: Per stage, its flat weights.
    stacked_inputs: The first stage's input tensors, micro-batches stacked.
    saved_x: Per stage k > 0, TensorArrays of its inputs per micro-batch.
    saved_states: Per stage, TensorArrays of its state before each
      micro-batch.
    d_outputs: Gradients of the last stage's stacked outputs (None where
      there is none).
    d_states: Per stage, gradients of its final state tensors (or None).
    first_id: int64 id of micro-batch 0.
    num_micro: M.

  Returns:
    (d_theta, d_stacked_inputs, d_states): per stage the gradients of its
    flat weights, the gradients of `stacked_inputs`, and per stage the
    gradients of its initial state; None where not differentiable.
  """
  num_stages = plan.num_stages
  diff_y = [plan.Output(k).Differentiable() for k in range(num_stages)]
  diff_state = [[stage_lib.IsDifferentiable(t) for t in plan.states[k]]
                for k in range(num_stages)]
  diff_theta = [[stage_lib.IsDifferentiable(t) for t in theta[k]]
                for k in range(num_stages)]
  with tf.device(plan.stages[-1].device):
    d_outputs = [
        None if not d else
        (tf.zeros([num_micro] + spec.shape.as_list(), spec.dtype)
         if g is None else g)
        for d, g, spec in zip(diff_y[-1], d_outputs, plan.outputs.specs)
    ]
  d_carries, d_state_vars, d_theta_vars = [], [], []
  for k, s in enumerate(plan.stages):
    with tf.device(s.device):
      # d_carries[k]: the gradient of stage k's output (differentiable ones)
      # for the micro-batch it works on next, sent by stage k + 1.
      d_carries.append([] if k == num_stages - 1 else [
          _Placeholder(spec)
          for spec, d in zip(plan.Output(k).specs, diff_y[k]) if d
      ])
      d_state_vars.append([
          tf.zeros_like(t) if g is None else g
          for t, g, d in zip(plan.states[k], d_states[k], diff_state[k]) if d
      ])
      d_theta_vars.append([
          tf.zeros_like(t) for t, d in zip(theta[k], diff_theta[k]) if d
      ])
  diff_x0 = plan.inputs[0].Differentiable()
  with tf.device(plan.stages[0].device):
    d_x0 = [_Array(spec, num_micro)
            for spec, d in zip(plan.inputs[0].specs, diff_x0) if d]
  invariants = (
      [[spec.shape for spec, d in zip(plan.Output(k).specs, diff_y[k]) if d]
       if k < num_stages - 1 else [] for k in range(num_stages)],
      [[t.shape for t in v] for v in d_state_vars],
      [[t.shape for t in v] for v in d_theta_vars],
      [tf.TensorShape(None)] * len(d_x0))

  def Body(micro_batches, loop_vars, busy):
    d_carries, d_state_vars, d_theta_vars, d_x0 = loop_vars
    new_carries, new_states = list(d_carries), list(d_state_vars)
    new_thetas, new_d_x0 = list(d_theta_vars), d_x0
    for k, s in enumerate(plan.stages):
      last = k == num_stages - 1
      with tf.device(s.device), tf.name_scope(f'stage{k}'):
        m = micro_batches[k]

        def Run(k=k, s=s, m=m, last=last):
          x = ([tf.gather(x, m) for x in stacked_inputs] if k == 0 else
               [a.read(m) for a in saved_x[k]])
          state = [a.read(m) for a in saved_states[k]]
          if last:
            d_y = [None if d is None else tf.gather(d, m) for d in d_outputs]
          else:
            given = iter(d_carries[k])
            d_y = [next(given) if d else None for d in diff_y[k]]
          given = iter(d_state_vars[k])
          d_state = [next(given) if d else None for d in diff_state[k]]
          grads = s.backward(theta[k], x, state,
                             first_id + tf.cast(m, tf.int64), d_y + d_state)
          n_theta, n_x = len(theta[k]), len(x)
          d_theta = [_Dense(g) for g in grads[:n_theta]]
          d_x = [_Dense(g) for g in grads[n_theta:n_theta + n_x]]
          d_state = [_Dense(g) for g in grads[n_theta + n_x:]]
          sums = [total + g for total, g in zip(
              d_theta_vars[k], [g for g in d_theta if g is not None])]
          d_x = [g for g in d_x if g is not None]
          sent = ([a.write(m, g) for a, g in zip(d_x0, d_x)] if k == 0 else
                  d_x)
          return sent, [g for g in d_state if g is not None], sums

        def Skip(k=k):
          return (d_x0 if k == 0 else d_carries[k - 1], d_state_vars[k],
                  d_theta_vars[k])

        sent, new_states[k], new_thetas[k] = _Call(m, Run, Skip, busy,
                                                   'backward')
        if k == 0:
          new_d_x0 = sent
        else:
          new_carries[k - 1] = sent
    return new_carries, new_states, new_thetas, new_d_x0

  _, d_state_vars, d_theta_vars, d_x0 = _Loop(
      schedule.PhaseTable(schedule.GPipeTicks(num_stages, num_micro),
                          'backward'),
      lambda m, v, busy: list(Body(m, v, busy)),
      [d_carries, d_state_vars, d_theta_vars, d_x0], list(invariants),
      'backward')

  def Scatter(values, mask):
    values = iter(values)
    return [next(values) if present else None for present in mask]

  with tf.device(plan.stages[0].device):
    d_inputs = Scatter([a.stack() for a in d_x0], diff_x0)
  d_theta_vars = _OnStageDevices(plan, d_theta_vars)
  d_state_vars = _OnStageDevices(plan, d_state_vars)
  return ([Scatter(v, d) for v, d in zip(d_theta_vars, diff_theta)], d_inputs,
          [Scatter(v, d) for v, d in zip(d_state_vars, diff_state)])


def Run(stages: Sequence[stage_lib.Stage], thetas: Sequence[Any],
        inputs: Sequence[Optional[tf.Tensor]], states: List[Any], *,
        num_micro_batches: int, batch_dim: int, remat: str,
        first_id: tf.Tensor,
        training: bool) -> Tuple[List[Optional[tf.Tensor]], List[Any]]:
  """Builds one pipelined pass as while loops (see the module docstring).

  Args:
    stages: K stages, each with its device.
    thetas: K nests of weights.
    inputs: The mini-batch inputs, tensors or None.
    states: K nests of initial stage states.
    num_micro_batches: M.
    batch_dim: The dimension inputs are split and outputs merged along.
    remat: 'always' (see `schedule.CheckEngine`).
    first_id: int64 id of micro-batch 0; micro-batch m gets first_id + m.
    training: If False, the forward loop saves nothing and has no gradient.

  Returns:
    (outputs, states): the last stage's outputs merged along batch_dim and
    each stage's state after the last micro-batch.

  Raises:
    ValueError: if remat is not supported by this engine.
  """
  schedule.CheckEngine('loop', remat)
  num_micro = num_micro_batches
  input_mask = [x is not None for x in inputs]
  with tf.device(stages[0].device):
    stacked = [microbatch.Stack(x, num_micro, batch_dim)
               for x in inputs if x is not None]
  plan = _Plan(stages, thetas,
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
      outputs, final_states, saved_x, saved_states = _Forward(
          plan, theta, x, init, first_id, num_micro, save=True)

      def Grad(*d_flat, variables=None):
        d_flat = [None if d is None else tf.stop_gradient(d) for d in d_flat]
        d_states = _Unjoin(d_flat[num_outputs:], sizes[2:])[0]
        # tf.gradients colocates gradient ops with the op they differentiate;
        # this one spans every stage's device, and places its ops itself.
        with tf.compat.v1.colocate_with(None, ignore_existing=True):
          d_theta, d_x, d_init = _Backward(plan, theta, x, saved_x,
                                           saved_states, d_flat[:num_outputs],
                                           d_states, first_id, num_micro)
        return (_Join(d_theta) + d_x + _Join(d_init),
                [None] * len(variables or []))

      return outputs + _Join(final_states), Grad

    results = Pipelined(*flat)
    outputs, final_flat = results[:num_outputs], results[num_outputs:]
  else:
    outputs, final_states, _, _ = _Forward(plan, plan.theta, stacked,
                                           plan.states, first_id, num_micro,
                                           save=False)
    final_flat = _Join(final_states)
  with tf.device(stages[-1].device):
    merged = iter([microbatch.Unstack(y, batch_dim) for y in outputs])
  outputs = [next(merged) if present else None for present in plan.outputs.mask]
  final_states = _Unjoin(final_flat, sizes[2:])[0]
  return outputs, [tf.nest.pack_sequence_as(state, part)
                   for state, part in zip(states, final_states)]
