"""The per-device executor: one while loop per device over its own program.

Device k's loop runs its instructions of a pass in order, idle ticks
skipped, as Lingvo's `StackedRecurrent` runs its stages; a forward receives
each input over a link (`transport.Links`) from the device that produced it
and sends each output to the device that reads it, a backward does the same
with gradients. A receive waits for its send, so a device waits only for
what it reads, not for every device's tick to end. A link delivers in send
order: every edge's reader must take the micro-batches in the order its
writer produces them (`planning.lowering.Step.ChannelOrderHolds`).

It runs where the K loops run at once and their links can meet: in a TF1
graph, where a session's executor runs the loops concurrently. Not eagerly,
where the loops run one after the other, nor inside a `tf.function`, whose
runtime may run While loops one at a time on one thread (a loop waiting for
a receive would wait forever), nor under XLA, which compiles no Send, Recv
or queue op (`loop.ChooseExecutor`).
"""

from typing import Any, Dict, List

import tensorflow as tf

from lingvo_gpipe.engine import control_flow
from lingvo_gpipe.engine import interpreter as interpreter_lib
from lingvo_gpipe.engine import transport as transport_lib
from lingvo_gpipe.planning import rows as rows_lib


def Run(interp: interpreter_lib.Interpreter, links: transport_lib.Links,
        ticks: range, v: Dict[str, Any], name: str,
        lowered: bool) -> Dict[str, Any]:
  """Runs a pass's ticks as one while loop per device; returns the vars.

  Args:
    interp: The interpreter.
    links: The transport.
    ticks: The pass's ticks.
    v: All variables (`Interpreter.Initial`).
    name: The loops' name prefix.
    lowered: Whether the loops are lowered (`control_flow`).

  Returns:
    The variables after the pass.
  """
  result = {key: list(value) for key, value in v.items()}
  finals, dones = [], []
  for k in range(interp.step.table.num_devices):
    choices, fields, rows = rows_lib.DeviceRows(interp.step, k, ticks)
    if not rows:
      continue
    phases = sorted({phase for phase, _, _ in choices})
    own = interp.Own(k)
    carried = [(field, c) for phase in phases
               for field in interp.ChunkFields(phase) for c in own]
    carried += [key for phase in phases
                for key in links.Changed(interp, k, phase)]

    def Body(t, values, choices=choices, fields=fields, rows=rows,
             carried=carried, k=k):
      current = {key: list(value) for key, value in v.items()}
      for (field, i), value in zip(carried, values):
        current[field][i] = value
      row = dict(zip(fields, tf.unstack(
          tf.gather(tf.constant(rows, tf.int32), t))))

      def Instruction(key):
        new = {key: list(value) for key, value in current.items()}
        sends = interp.Run(key, row, current, new, links)
        with tf.control_dependencies(sends):
          return [new[field][i] for field, i in carried], t + 1

      new_values, next_t = control_flow.Dispatch(
          choices, False, row['branch'], Instruction, None,
          f'device{k}_{"_".join(phases)}', lowered)
      return next_t, new_values

    with tf.device(interp.DeviceName(k)), tf.name_scope(f'device{k}'):
      initial = [v[field][i] for field, i in carried]
      results = tf.while_loop(
          lambda t, _, n=len(rows): t < n, Body,
          (tf.constant(0), initial),
          # In order: a lowered loop would otherwise start an instruction's
          # sends before the previous one's, and links deliver in send order.
          parallel_iterations=1,
          shape_invariants=(tf.TensorShape([]), tf.nest.map_structure(
              lambda x: tf.TensorShape(None) if isinstance(
                  x, tf.TensorArray) else x.shape, initial)),
          name=f'{name}_device{k}')
      control_flow.KeepUnlowered(results[0], control_flow.LOOP_OPS, lowered)
    finals.append((k, carried, results[1]))
    dones.append(results[0])
  dones += links.RelayLoops(interp, ticks, name)
  # A loop's results wait for every loop: nothing else joins the loops in the
  # graph, and a fetch that needs one loop must run those it receives from,
  # or its receive would wait forever.
  with tf.control_dependencies(dones):
    for k, carried, values in finals:
      with tf.device(interp.DeviceName(k)):
        for (field, i), value in zip(carried, values):
          result[field][i] = [
              x.identity() if isinstance(x, tf.TensorArray) else
              tf.identity(x) for x in value]
  return result
