"""Rows: a lowered step's programs as tables of ints that loops index.

Pure Python, no TensorFlow. A loop of the loop engine reads, at each of its
iterations, one row of ints on each device: which code the device runs (an
index into its `choices`, the instruction keys it runs in the loop), the
micro-batch, and the slots the instruction reads and writes. A row lives on
its own device, so no iteration sends indices between devices.

* `LockstepSegments`: the lockstep executor runs all devices tick by tick;
  it cuts a pass's ticks into stretches in which every device works, or not
  (a GPipe pass: filling, full, draining; three loops whatever M is), with a
  row per device per tick; an idle device's branch index is
  len(choices).
* `DeviceRows`: the per-device executor runs each device's instructions of
  a pass in its own loop, a row per instruction.

    >>> from lingvo_gpipe.planning import lowering, schedule
    >>> table = schedule.BuildTable('gpipe', 2, 4)
    >>> step = lowering.Lower(table, lowering.Edges(2, ()), 'always', True)
    >>> [len(s.ticks) for s in LockstepSegments(step, step.phases[0][1])]
    [1, 3, 1]
    >>> choices, fields, rows = DeviceRows(step, 1, step.phases[0][1])
    >>> choices, fields[:4], rows[0][:4]
    ([('forward', 1, False)], ['branch', 'micro_batch', 'state_slot', \
'stash_slot'], [0, 0, 0, 0])
"""

from typing import Any, Dict, List, Sequence, Tuple

from lingvo_gpipe.planning import lowering

# Per device, the fields of a row: the branch index, the micro-batch and the
# slots of its chunk's state, stash and weight stash buffers.
DEVICE_FIELDS = ('branch', 'micro_batch', 'state_slot', 'stash_slot',
                 'weight_slot')
# Per edge, in a lockstep row: the slot its reader reads (data_read) and its
# writer's backward reads (grad_read) at the tick, and the slot written
# after the tick (data_write, grad_write; the spare slot when nothing was).
EDGE_FIELDS = ('data_read', 'grad_read', 'data_write', 'grad_write')


def _FieldDevice(step: lowering.Step, e: int, field: str) -> int:
  """The device that uses an edge's field: its reader or its buffer's."""
  if field in ('data_write', 'grad_write'):
    return step.Device(field.split('_')[0], e)
  edge = step.edges[e]
  chunk = edge.target if field == 'data_read' else edge.source
  return step.table.Device(0 if chunk is None else chunk)


class Segment:
  """A stretch of ticks that one lockstep loop runs.

  Attributes:
    ticks: The step's ticks it covers.
    choices: Per device, the instruction keys it runs, in order of first
      appearance.
    idles: Per device, whether it idles at some tick of the segment.
    phases: The phases of the segment's actions.
    hosted: Per device, the fields of its rows: DEVICE_FIELDS, then
      (field, edge) for the EDGE_FIELDS it uses (`_FieldDevice`).
    rows: Per device, per tick, the values of its hosted fields.
  """

  def __init__(self, step: lowering.Step, ticks: Sequence[int]):
    num_devices = step.table.num_devices
    self.ticks = list(ticks)
    at = {(i.tick, k): i for k, program in enumerate(step.programs)
          for i in program}
    self.choices = [[] for _ in range(num_devices)]
    self.idles = [False] * num_devices
    self.phases = set()
    for t in self.ticks:
      for k in range(num_devices):
        instruction = at.get((t, k))
        if instruction is None:
          self.idles[k] = True
        else:
          self.phases.add(instruction.action.phase)
          if instruction.key not in self.choices[k]:
            self.choices[k].append(instruction.key)
    self.hosted = [list(DEVICE_FIELDS) for _ in range(num_devices)]
    for e in range(len(step.edges)):
      for field in EDGE_FIELDS:
        self.hosted[_FieldDevice(step, e, field)].append((field, e))
    self.rows = [[] for _ in range(num_devices)]
    for t in self.ticks:
      values = self._Values(step, [at.get((t, k))
                                   for k in range(num_devices)])
      for k, hosted in enumerate(self.hosted):
        self.rows[k].append([values[k, f] if isinstance(f, str) else values[f]
                             for f in hosted])

  def _Values(self, step: lowering.Step,
              tick: Sequence[Any]) -> Dict[Tuple[Any, Any], int]:
    """{(device, field) or (edge field, edge): value} of one tick."""
    values = {}
    for e in range(len(step.edges)):
      values['data_read', e] = values['grad_read', e] = 0
      values['data_write', e] = step.Size('data', e)  # The spare slot.
      values['grad_write', e] = step.Size('grad', e)
    for k, instruction in enumerate(tick):
      if instruction is None:
        values.update({(k, f): 0 for f in DEVICE_FIELDS})
        values[k, 'branch'] = len(self.choices[k])
        continue
      values.update({
          (k, 'branch'): self.choices[k].index(instruction.key),
          (k, 'micro_batch'): instruction.action.micro_batch,
          (k, 'state_slot'): instruction.state_slot,
          (k, 'stash_slot'): instruction.stash_slot,
          (k, 'weight_slot'): instruction.weight_slot or 0})
      for e, slot in instruction.reads:
        values['data_read', e] = slot
      for e, slot in instruction.grad_reads:
        values['grad_read', e] = slot
      kind = 'data' if instruction.action.phase == lowering.F else 'grad'
      for e, slot in instruction.writes:
        values[f'{kind}_write', e] = slot
    return values


def LockstepSegments(step: lowering.Step,
                     ticks: Sequence[int]) -> List[Segment]:
  """Cuts a pass's ticks into stretches in which every device works, or not.

  In a stretch where every device works, a device with one chunk calls it
  directly, with no branch.

  Args:
    step: The lowered step.
    ticks: The pass's ticks (`lowering.Step.phases`).

  Returns:
    The segments, in order.
  """
  runs = []
  for t in ticks:
    busy = None not in step.ticks[t]
    if runs and runs[-1][0] == busy:
      runs[-1][1].append(t)
    else:
      runs.append((busy, [t]))
  return [Segment(step, run) for _, run in runs]


def DeviceRows(step: lowering.Step, k: int, ticks: Sequence[int]
              ) -> Tuple[List[Tuple[str, int, bool]], List[Any],
                         List[List[int]]]:
  """Device k's instructions in a pass, as the per-device executor runs them.

  Args:
    step: The lowered step.
    k: The device.
    ticks: The pass's ticks.

  Returns:
    (choices, fields, rows): the instruction keys it runs, in order of first
    appearance; its row fields, DEVICE_FIELDS then ('data_read', e) for
    every edge between chunks it reads; a row per instruction, in order.
  """
  ticks = set(ticks)
  program = [i for i in step.programs[k] if i.tick in ticks]
  choices = []
  for instruction in program:
    if instruction.key not in choices:
      choices.append(instruction.key)
  reads = sorted({e for i in step.programs[k] for e, _ in i.reads})
  fields = list(DEVICE_FIELDS) + [('data_read', e) for e in reads]
  rows = []
  for instruction in program:
    slots = dict(instruction.reads)
    rows.append([choices.index(instruction.key),
                 instruction.action.micro_batch, instruction.state_slot,
                 instruction.stash_slot, instruction.weight_slot or 0] +
                [slots.get(e, 0) for e in reads])
  return choices, fields, rows
