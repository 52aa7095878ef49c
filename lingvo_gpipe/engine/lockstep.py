"""The lockstep executor: all devices' instructions, tick by tick, in loops.

Runs a pass of a lowered step as one while loop per segment
(`planning.rows.LockstepSegments`): at every tick each device runs its
instruction under `tf.device(device_k)`, directly if it runs the same code
at every tick of the segment, else through a `tf.cond` or `tf.switch_case`
that picks it (an idle device computes nothing); then the tick's results
are written to the buffers (`transport.Buffers`). A tick ends when its
slowest device is done. It runs anywhere: eagerly, inside `tf.function`,
under XLA, in TF1 graphs.
"""

from typing import Any, Callable, Dict, List

import tensorflow as tf

from lingvo_gpipe.engine import control_flow
from lingvo_gpipe.engine import interpreter as interpreter_lib
from lingvo_gpipe.engine import transport as transport_lib
from lingvo_gpipe.planning import lowering
from lingvo_gpipe.planning import rows as rows_lib

F, B, W = lowering.F, lowering.B, lowering.W

# What the instructions of a phase change (the rest they only read).
_CHANGED = {
    F: ('state', 'saved_state', 'stash', 'sent', 'data'),
    B: ('d_state', 'd_theta', 'stash', 'weight_stash', 'sent_grad', 'grad'),
    W: ('d_theta', 'weight_stash'),
}
# The variables that hold one entry per chunk.
_PER_CHUNK = ('state', 'saved_state', 'stash', 'weight_stash', 'd_state',
              'd_theta')


def _Invariants(interp: interpreter_lib.Interpreter, v: Dict[str, Any],
                select: Callable[[str, List[Any]], List[Any]]
               ) -> Dict[str, Any]:
  """Shape invariants: buffers unknown, tensors their static shapes.

  Args:
    interp: The interpreter.
    v: The loop's variables.
    select: select(key, per-edge list): the entries of it the loop carries.

  Returns:
    The invariants, in the structure of v.
  """
  invariants = tf.nest.map_structure(
      lambda t: tf.TensorShape(None) if isinstance(t, tf.TensorArray) else
      t.shape, v)
  invariants.update({key: select(key, shapes) for key, shapes in
                     transport_lib.Buffers.Invariants(interp).items()
                     if key in v})
  return invariants


def _Fields(segment: rows_lib.Segment, rows: List[List[tf.Tensor]]
           ) -> List[Dict[Any, tf.Tensor]]:
  """Per device, its own fields of the tick and every device's edge fields."""
  edge_fields = {f: value for hosted, row in zip(segment.hosted, rows)
                 for f, value in zip(hosted, row) if not isinstance(f, str)}
  return [dict(edge_fields, **{f: value for f, value in zip(hosted, row)
                               if isinstance(f, str)})
          for hosted, row in zip(segment.hosted, rows)]


def _Tick(interp: interpreter_lib.Interpreter, segment: rows_lib.Segment,
          rows: List[List[tf.Tensor]], v: Dict[str, Any],
          changes: Dict[str, List[int]], lowered: bool) -> Dict[str, Any]:
  """One tick: every device's instruction, then the writes to the buffers."""
  buffers = transport_lib.Buffers
  fields = _Fields(segment, rows)
  v = {key: list(value) for key, value in v.items()}
  for k in range(interp.step.table.num_devices):
    own = interp.Own(k)
    changed = [(field, c) for phase in sorted(segment.phases)
               for field in interp.ChunkFields(phase) for c in own]
    changed += [key for phase in sorted(segment.phases)
                for key in buffers.Changed(interp, k, phase)]

    def Current(changed=changed):
      return [v[field][i] for field, i in changed]

    def Run(key, row=fields[k], changed=changed):
      new = {field: list(values) for field, values in v.items()}
      interp.Run(key, row, v, new, buffers)
      return [new[field][i] for field, i in changed]

    with tf.device(interp.DeviceName(k)), tf.name_scope(f'device{k}'):
      values = control_flow.Dispatch(
          segment.choices[k], segment.idles[k], fields[k]['branch'], Run,
          Current, f'device{k}_{"_".join(sorted(segment.phases))}', lowered)
    for (field, i), value in zip(changed, values):
      v[field][i] = value
  buffers.WriteTick(interp, changes, fields[0], v)
  return v


def Run(interp: interpreter_lib.Interpreter, ticks: range,
        v: Dict[str, Any], name: str, lowered: bool) -> Dict[str, Any]:
  """Runs a pass's ticks as while loops (one per segment); returns the vars.

  Only what a loop's ticks change is carried through it; the rest (e.g. the
  forward's buffers in backward loops) is read from outside: XLA's compiler
  fails on while loops that pass loop-invariant values through.

  Args:
    interp: The interpreter.
    ticks: The pass's ticks.
    v: All variables (`Interpreter.Initial` and `Buffers.Initial`).
    name: The loops' name prefix.
    lowered: Whether the loops are lowered (`control_flow`).

  Returns:
    The variables after the last tick.
  """
  num_devices = interp.step.table.num_devices
  for i, segment in enumerate(rows_lib.LockstepSegments(interp.step, ticks)):
    carried = {key for phase in segment.phases for key in _CHANGED[phase]}
    if interp.loss_inside:
      carried.discard('d_state')
    # Of the per-chunk and per-edge variables, only those the segment's
    # instructions change are carried: XLA fails on some loops that pass a
    # constant through unchanged (e.g. a weight-gradient sum still zero).
    runs = {(phase, c) for choices in segment.choices
            for phase, c, _ in choices}
    changes = {key: sorted({c for phase, c in runs
                            if key in interp.ChunkFields(phase)})
               for key in _PER_CHUNK}
    changes['sent'] = [e for e, edge in enumerate(interp.edges)
                       if (F, edge.source) in runs]
    changes['sent_grad'] = [e for e, edge in enumerate(interp.edges)
                            if (B, edge.target) in runs]
    # A buffer changes where the segment sends on its edge.
    changes['data'], changes['grad'] = changes['sent'], changes['sent_grad']

    def Select(key, values, changes=changes):
      return [values[c] for c in changes[key]] if key in changes else values

    def Merge(key, values, changes=changes, v=v):
      if key not in changes:
        return values
      merged = list(v[key])
      for c, value in zip(changes[key], values):
        merged[c] = value
      return merged

    fixed = {key: value for key, value in v.items() if key not in carried}
    loop_vars = {key: Select(key, value) for key, value in v.items()
                 if key in carried}
    # A loop starts when the previous one has ended, whatever variable it
    # reads first: its counters wait for all of them (lowered, each loop
    # variable leaves its loop on its own). Each device counts the ticks
    # itself: none waits for another's index.
    counters = []
    with tf.control_dependencies(
        [control_flow.Flow(x) for x in tf.nest.flatten(loop_vars)]
        if i else []):
      for k in range(num_devices):
        with tf.device(interp.DeviceName(k)):
          counters.append(tf.constant(0, name=f'{name}_tick_{i}'))

    def Body(counters, loop_vars, segment=segment, fixed=fixed, merge=Merge,
             select=Select, changes=changes):
      rows = []
      for k, (t, table) in enumerate(zip(counters, segment.rows)):
        with tf.device(interp.DeviceName(k)):
          rows.append(tf.unstack(tf.constant(table, tf.int32)[t]))
      new = _Tick(interp, segment, rows,
                  dict(fixed, **{key: merge(key, value)
                                 for key, value in loop_vars.items()}),
                  changes, lowered)
      next_counters = []
      for k, t in enumerate(counters):
        with tf.device(interp.DeviceName(k)):
          next_counters.append(t + 1)
      return next_counters, {key: select(key, new[key]) for key in loop_vars}

    num_ticks = len(segment.ticks)
    results = tf.while_loop(
        lambda counters, _, n=num_ticks: counters[0] < n, Body,
        (counters, loop_vars),
        shape_invariants=([tf.TensorShape([])] * num_devices,
                          _Invariants(interp, loop_vars, Select)),
        # A tick starts when the previous one has ended, as the unlowered
        # While runs it; lowered loops would otherwise overlap ticks.
        parallel_iterations=1,
        maximum_iterations=num_ticks,
        name=f'{name}_{i}')
    control_flow.KeepUnlowered(results[0], control_flow.LOOP_OPS, lowered)
    v = dict(fixed, **{key: Merge(key, value)
                       for key, value in results[1].items()})
  return v
