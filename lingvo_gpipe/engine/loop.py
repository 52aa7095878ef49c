"""The loop engine: a schedule table lowered to programs, run in while loops.

The graph holds each chunk's body once, whatever M is. A step is built in
three layers:

* **lowering** (`planning.lowering`, pure Python): the table becomes one
  program per device, its instructions with the buffer slots they use, and
  the transfers between devices;
* the **interpreter** (`interpreter.py`): the code of each kind of
  instruction (a chunk's forward or backward on a micro-batch), once;
* an **executor** that runs the programs in while loops and moves values
  with its transport (`transport.py`): 'lockstep' (`lockstep.py`: all
  devices tick by tick in one loop per stretch of ticks; buffers indexed by
  slot; anywhere, XLA included) or 'per_device' (`per_device.py`: one loop
  per device over its own program, Send/Recv links; TF1 graphs, as Lingvo's
  trainer builds). `ChooseExecutor` resolves 'auto'.

A table with the loss outside the pipeline runs its forward pass as forward
loops and its backward pass as backward loops in their gradient; a table
with the loss inside runs forward and backward instructions in one pass, and
its gradient scales what that pass computed (`passes.py`).

Two chunks y = theta x on two devices, two micro-batches, eagerly (the
lockstep executor; `pipeline.Pipeline` is the usual way in):

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

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from lingvo_gpipe.engine import channel
from lingvo_gpipe.engine import chunks as chunks_lib
from lingvo_gpipe.engine import control_flow
from lingvo_gpipe.engine import interpreter as interpreter_lib
from lingvo_gpipe.engine import lockstep
from lingvo_gpipe.engine import microbatch
from lingvo_gpipe.engine import passes
from lingvo_gpipe.engine import per_device
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.engine import transport as transport_lib
from lingvo_gpipe.engine import xla
from lingvo_gpipe.planning import lowering
from lingvo_gpipe.planning import schedule

# How the loops run: 'auto' (`ChooseExecutor`) or one of the two executors.
EXECUTORS = ('auto', 'lockstep', 'per_device')


def _Channels(lowered: bool) -> bool:
  """Whether per-device loops pass tensors over channels (else queues).

  Functional loops take channels; lowered ones (or control flow v1) key
  Send/Recv by their own loop frame, and take queues.

  Args:
    lowered: Whether the loops are lowered (`control_flow.Lowered`).
  """
  return not lowered and tf.compat.v1.control_flow_v2_enabled()


def _PerDeviceBlocker(step: lowering.Step,
                      devices: Sequence[str]) -> Optional[str]:
  """Why the per-device executor cannot run a step here, or None."""
  table = step.table
  if table.num_devices < 2:
    return 'it needs K >= 2 devices'
  if tf.executing_eagerly() or (
      tf.compat.v1.get_default_graph().building_function):
    return ('it runs in TF1 graphs only (eagerly or in a tf.function the '
            'loops would run one at a time)')
  if xla.CompiledByXla(devices):
    return 'XLA compiles no Send or Recv'
  names = [channel.FullDeviceName(d) for d in devices]
  if None in names or len(set(names)) < len(names):
    return f'its devices {list(devices)} are not K distinct named devices'
  known = channel.Incarnations()
  unknown = [n for n in names if n not in known]
  if (_Channels(control_flow.Lowered()) and unknown and
      len({channel.Task(n) for n in names}) > 1):
    return (f'its devices are in several processes, and the incarnations of '
            f'{unknown} are unknown (build the step inside '
            '`channel.DeviceIncarnations(session.list_devices())`)')
  if not step.ChannelOrderHolds():
    return ("the table's readers take some edge's micro-batches in another "
            'order than its writer sends them')
  return None


class Executor:
  """An executor with its transport, bound to one step's interpreter."""

  def __init__(self, name: str, interp: interpreter_lib.Interpreter,
               devices: Sequence[str], lowered: bool):
    self.name = name
    self.lowered = lowered
    if name == 'lockstep':
      self.transport = transport_lib.Buffers
    else:
      self.transport = transport_lib.Links(
          interp, [channel.FullDeviceName(d) for d in devices],
          queues=not _Channels(lowered))
    self.interp = interp

  def Initial(self, states, d_states=None):
    v = self.interp.Initial(states, self.transport.HasBuffer, d_states)
    v.update(self.transport.Initial(self.interp))
    return v

  def Run(self, ticks: range, v, name: str):
    if self.name == 'lockstep':
      return lockstep.Run(self.interp, ticks, v, name, self.lowered)
    return per_device.Run(self.interp, self.transport, ticks, v, name,
                          self.lowered)


def ChooseExecutor(executor: str, step: lowering.Step,
                   devices: Sequence[str]) -> str:
  """The executor that runs a step: `executor` itself unless it is 'auto'.

  'auto' is 'per_device' where it can run (`per_device.py`: a TF1 graph,
  not under XLA, K >= 2 distinct named devices, every edge read in send
  order; devices in several processes need their incarnations,
  `channel.DeviceIncarnations`, unless the loops are lowered), else
  'lockstep'.

  Args:
    executor: One of EXECUTORS.
    step: The lowered step.
    devices: The K devices.

  Returns:
    'lockstep' or 'per_device'.

  Raises:
    ValueError: on an unknown executor, or 'per_device' where it cannot run.
  """
  if executor not in EXECUTORS:
    raise ValueError(f'executor={executor!r} is not supported; use one of '
                     f'{list(EXECUTORS)}.')
  if executor == 'lockstep':
    return executor
  blocker = _PerDeviceBlocker(step, devices)
  if executor == 'per_device' and blocker:
    raise ValueError(f"executor='per_device' cannot run this step: "
                     f"{blocker}; use executor='lockstep' or 'auto'.")
  return 'lockstep' if blocker else 'per_device'


def _Chunks(stages: Sequence[stage_lib.Stage], thetas: Sequence[Any],
            boundaries: List[Optional[chunks_lib.Boundary]],
            states: Sequence[Any], step: lowering.Step
           ) -> List[chunks_lib.Chunk]:
  """The `chunks.Chunk`s, tracing each once, in order (sets boundaries)."""
  num_micro = step.table.num_micro_batches

  def Split(c):
    if not step.training:
      return None
    if step.table.split_backward:
      return 'backward'
    return None if all(step.recomputes[c, m]
                       for m in range(num_micro)) else 'call'

  return [
      chunks_lib.Chunk(c, s, theta, step.edges, boundaries, state,
                       check_weights=step.training, split=Split(c))
      for c, (s, theta, state) in enumerate(zip(stages, thetas, states))
  ]


def _CheckLossOutputs(edges: Sequence[lowering.Edge],
                      boundaries: Sequence[chunks_lib.Boundary]) -> None:
  """Raises unless the output is scalars, the first a float loss."""
  outputs = [b for e, b in zip(edges, boundaries) if e.target is None]
  specs = outputs[0].specs
  if (len(outputs) > 1 or not specs or not all(outputs[0].mask) or
      any(s.shape.rank != 0 for s in specs) or not specs[0].dtype.is_floating):
    raise ValueError(
        'A schedule with the loss inside the pipeline needs a last cell that '
        'returns scalars, the first a float loss (the mean over its '
        'micro-batch), and no skip into the output; it returns '
        f'{outputs[0].Structure()}{" and skips" if len(outputs) > 1 else ""}.')


def _CheckStateGradients(step: lowering.Step,
                         chunks: Sequence[chunks_lib.Chunk],
                         loss_inside: bool) -> None:
  """Raises if a state gradient would flow against the table's order."""
  if not step.training or loss_inside:
    return
  for c, chunk in enumerate(chunks):
    if (any(stage_lib.IsDifferentiable(t) for t in chunk.state) and
        not lowering.BackwardReversesForward(step.table, c)):
      raise ValueError(
          f'Chunk {c} carries a differentiable state from micro-batch to '
          f'micro-batch, whose gradient flows from micro-batch m + 1 back to '
          f'm, but the table ({step.table.schedule!r}) runs its backwards in '
          'another order than its forwards reversed. Use a table whose '
          "backward reverses each chunk's forward order, or a state that is "
          'not floating point (no gradient).')


def Run(stages: Sequence[stage_lib.Stage], thetas: Sequence[Any],
        inputs: Sequence[Optional[tf.Tensor]], states: List[Any], *,
        table: schedule.Table, batch_dim: int, remat: str,
        first_id: tf.Tensor, training: bool,
        input_gradients: Sequence[bool],
        loss_inside: bool = False,
        skips: Sequence[Tuple[int, Optional[int]]] = (),
        executor: str = 'auto'
       ) -> Tuple[List[Optional[tf.Tensor]], List[Any]]:
  """Builds one pipelined pass as while loops (see the module docstring).

  Args:
    stages: C = K v chunks; chunk c runs on its device (table.Device(c)).
    thetas: C nests of weights.
    inputs: The mini-batch inputs, tensors or None.
    states: C nests of initial chunk states.
    table: The training step's table; an evaluation step runs its forward
      actions alone (`lowering.ForwardTicks`).
    batch_dim: The dimension inputs are split and outputs merged along.
    remat: One of `schedule.REMAT_MODES`.
    first_id: int64 id of micro-batch 0; micro-batch m gets first_id + m.
    training: If False, the forward actions run alone, saving nothing.
    input_gradients: Per input, whether the backward computes its gradient
      (else None); False for None and for tensors that are not floating point.
    loss_inside: Whether the last chunk returns the loss (scalars): the
      outputs are then the means over micro-batches, and in training the
      table's backward runs in the same pass (its `loss_outside` is False).
    skips: (source chunk, target chunk or None for the output) pairs: the
      source returns one tuple per skip after its main outputs, the target
      receives it after its main inputs (see `pipeline.Pipeline`).
    executor: One of EXECUTORS (`ChooseExecutor`).

  Returns:
    (outputs, states): the last chunk's outputs merged along batch_dim, then
    the tensors of each skip into the output (with the loss inside: the mean
    over micro-batches of each scalar output), and each chunk's state after
    its last micro-batch.

  Raises:
    ValueError: if the table, the executor or the last cell's outputs do not
      suit.
  """
  step = lowering.Lower(table, lowering.Edges(len(stages), skips), remat,
                        training)
  devices = [stages[table.device_chunks[k][0]].device
             for k in range(table.num_devices)]
  executor = ChooseExecutor(executor, step, devices)
  num_micro = table.num_micro_batches
  specs = []
  for x in inputs:
    if x is not None:
      shape = x.shape.as_list()
      shape[batch_dim] = (None if shape[batch_dim] is None else
                          shape[batch_dim] // num_micro)
      specs.append(tf.TensorSpec(shape, x.dtype))
  boundaries = [None] * len(step.edges)
  boundaries[0] = chunks_lib.Boundary(
      [x is not None for x in inputs], specs,
      [d for x, d in zip(inputs, input_gradients) if x is not None])
  chunks = _Chunks(stages, thetas, boundaries, states, step)
  if loss_inside:
    _CheckLossOutputs(step.edges, boundaries)
  with tf.device(stages[0].device):
    stacked = [microbatch.Stack(x, num_micro, batch_dim)
               for x in inputs if x is not None]
  sizes = ([len(c.theta) for c in chunks], [len(stacked)],
           [len(c.state) for c in chunks])
  output_edges = [e for e, edge in enumerate(step.edges) if edge.target is None]
  _CheckStateGradients(step, chunks, loss_inside)

  def NewExecutor(flat):
    """An executor over the weights and stacked inputs in `flat`."""
    theta, (x,), _ = passes.Unjoin(flat, sizes)
    for chunk, chunk_theta in zip(chunks, theta):
      chunk.theta = chunk_theta
    interp = interpreter_lib.Interpreter(
        chunks, step, boundaries, x, first_id, loss_inside,
        shrinks=table.split_backward and not xla.CompiledByXla(devices))
    return Executor(executor, interp, devices, control_flow.Lowered())

  flat = passes.Join([c.theta for c in chunks]) + stacked + passes.Join(
      [c.state for c in chunks])
  if not training:
    run = NewExecutor(flat)
    v = run.Run(step.phases[0][1], run.Initial([c.state for c in chunks]),
                'forward')
    outputs, final_states, _, _, _ = run.interp.Results(v)
    if loss_inside:
      with tf.device(chunks[-1].device):
        outputs = [tf.reduce_mean(y, 0) for y in outputs]
    final_flat = passes.Join(final_states)
  elif loss_inside:
    outputs, final_flat = passes.LossInside(NewExecutor, flat, sizes, step,
                                      output_edges)
  else:
    outputs, final_flat = passes.LossOutside(NewExecutor, flat, sizes, step,
                                       output_edges)
  final_states = passes.Unjoin(final_flat, sizes[2:])[0]
  final_states = [tf.nest.pack_sequence_as(state, part)
                  for state, part in zip(states, final_states)]
  if loss_inside:
    return outputs, final_states
  merged = iter(outputs)
  results = []
  for e in output_edges:
    with tf.device(chunks[step.edges[e].source].device):
      results += [None if not present else
                  microbatch.Unstack(next(merged), batch_dim)
                  for present in boundaries[e].mask]
  return results, final_states
