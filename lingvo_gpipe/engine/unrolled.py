"""The unrolled engine: every (chunk, micro-batch) call is its own graph node.

C x M calls of the C chunk bodies (each body traced once per chunk), built in
the order of the schedule table's forward actions, ordered on each device by
`stage.py`'s chains and re-materialized by `recompute.py`. TensorFlow's
gradient of the chained calls runs each device's backward calls in the
reverse order of its forward calls, so this engine runs tables whose
backward is their forward reversed on every device (GPipe's, circular too).
The steady step is the fastest on few micro-batches, but the graph, its
trace and its XLA compile grow with C x M; the loop engine (`loop.py`) does
not. Two chunks y = theta x on two devices, two micro-batches, eagerly
(`pipeline.Pipeline` is the usual way in):

    >>> def Chunk(theta, inputs, state, micro_batch_id):
    ...   return (inputs[0] * theta,), state
    >>> chunks = [stage_lib.Stage(Chunk, f'chunk {c}', f'/cpu:{c}')
    ...           for c in range(2)]
    >>> x, thetas = tf.constant([[1.0], [2.0]]), [tf.constant(2.0)] * 2
    >>> table = schedule.BuildTable('gpipe', num_devices=2, num_micro_batches=2)
    >>> with tf.GradientTape() as tape:
    ...   tape.watch(x)
    ...   (y,), _ = Run(chunks, thetas, [x], [(), ()], table=table,
    ...                 batch_dim=0, remat='never',
    ...                 first_id=tf.constant(0, tf.int64), training=True,
    ...                 input_gradients=[True])
    >>> y.numpy().tolist(), tape.gradient(y, x).numpy().tolist()
    ([[4.0], [8.0]], [[4.0], [4.0]])
"""

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from lingvo_gpipe.engine import microbatch
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.planning import schedule


def CheckTable(table: schedule.Table) -> None:
  """Raises ValueError unless each device's backward is its forward reversed.

  Args:
    table: The schedule.

  Raises:
    ValueError: naming the schedule and the first device that differs.
  """
  for k, order in enumerate(table.device_orders):
    calls = [(a.phase, a.chunk, a.micro_batch) for a in order]
    forward = [c for c in calls if c[0] == schedule.FORWARD]
    backward = [(schedule.FORWARD,) + c[1:] for c in calls[len(forward):]]
    if backward != forward[::-1]:
      raise ValueError(
          f"engine='unrolled' runs schedules in which each device runs all "
          f'its forwards, then their backwards in reverse order (the order '
          f"TensorFlow's gradient of chained calls takes); "
          f'schedule={table.schedule!r} does not on device {k}; use '
          "engine='loop'.")


def Run(chunks: Sequence[stage_lib.Stage], thetas: Sequence[Any],
        inputs: Sequence[Optional[tf.Tensor]], states: List[Any], *,
        table: schedule.Table, batch_dim: int, remat: str,
        first_id: tf.Tensor, training: bool,
        input_gradients: Sequence[bool],
        loss_inside: bool = False,
        skips: Sequence[Tuple[int, Optional[int]]] = ()
       ) -> Tuple[List[Optional[tf.Tensor]], List[Any]]:
  """Builds the C x M chunk calls of one step in table order.

  Args:
    chunks: C = K v chunks, each with its device.
    thetas: C nests of weights.
    inputs: The mini-batch inputs, tensors or None.
    states: C nests of initial chunk states.
    table: The schedule (see `CheckTable`).
    batch_dim: The dimension inputs are split and outputs merged along.
    remat: One of `schedule.REMAT_MODES`.
    first_id: int64 id of micro-batch 0; micro-batch m gets first_id + m.
    training: If False, no call is set up for recompute.
    input_gradients: Per input, whether it gets a gradient (else None: the
      input goes through tf.stop_gradient).
    loss_inside: Must be False: schedules with the loss inside run on the
      loop engine (`schedule.CheckEngine`).
    skips: (source chunk, target chunk or None) pairs (`pipeline.Pipeline`):
      the skip's tuple goes from the source's call to the target's call of
      the same micro-batch, device to device.

  Returns:
    (outputs, states): the last chunk's outputs merged along batch_dim, then
    the tensors of each skip into the output, and each chunk's state after
    its last micro-batch.

  Raises:
    ValueError: if the table's backward is not its forward reversed.
  """
  if loss_inside:
    raise ValueError("engine='unrolled' does not run schedules with the loss "
                     "inside; use engine='loop'.")
  CheckTable(table)
  num_micro, num_chunks = table.num_micro_batches, table.num_chunks
  recomputes = schedule.RecomputedCalls(table, remat)
  forward = [(k, a) for tick in table.ticks for k, a in enumerate(tick)
             if a is not None and a.phase == schedule.FORWARD]
  last_call = {a.chunk: a.micro_batch for _, a in forward}
  states = list(states)
  inputs = [x if x is None or wanted else tf.stop_gradient(x)
            for x, wanted in zip(inputs, input_gradients)]
  with tf.device(chunks[0].device):
    micro_inputs = microbatch.Split(inputs, num_micro, batch_dim)
  # One token per device orders its calls, whichever chunk they belong to;
  # each chunk passes its own weights along its calls.
  tokens, thetas_passed = [None] * table.num_devices, []
  for c, (s, theta) in enumerate(zip(chunks, thetas)):
    with tf.device(s.device):
      chain = s.StartChain(theta)
    thetas_passed.append(chain.theta)
    k = table.Device(c)
    tokens[k] = chain.token if tokens[k] is None else tokens[k]
  outgoing = [[s for s, (a, _) in enumerate(skips) if a == c]
              for c in range(num_chunks)]
  incoming = [[s for s, (_, b) in enumerate(skips) if b == c]
              for c in range(num_chunks)]
  outputs, skipped = {}, {}
  for k, (_, c, m) in forward:
    x = micro_inputs[m] if c == 0 else outputs.pop((c - 1, m))
    x = tuple(x) + tuple(skipped.pop((s, m)) for s in incoming[c])
    with tf.device(chunks[c].device), tf.name_scope(f'chunk{c}_mb{m}'):
      y, states[c], chain = chunks[c].Call(
          stage_lib.Chain(tokens[k], thetas_passed[c]), x, states[c],
          first_id + m, remat=training and recomputes[c, m],
          last=m == last_call[c], training=training)
    tokens[k], thetas_passed[c] = chain.token, chain.theta
    cut = len(y) - len(outgoing[c])
    outputs[c, m] = y[:cut]
    for s, value in zip(outgoing[c], y[cut:]):
      skipped[s, m] = value
  with tf.device(chunks[-1].device):
    merged = microbatch.Merge(
        [outputs[num_chunks - 1, m] for m in range(num_micro)], batch_dim)
  for s, (source, target) in enumerate(skips):
    if target is None:
      with tf.device(chunks[source].device):
        merged += microbatch.Merge(
            [tf.nest.flatten(skipped[s, m]) for m in range(num_micro)],
            batch_dim)
  return merged, states
