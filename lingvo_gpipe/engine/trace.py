"""Reading a traced step: which chunk ran which micro-batch and phase when.

Turns `RunMetadata.step_stats` of a training step into `simulate.Event`s, for
either engine and any schedule table:

* unrolled: the call of chunk c on micro-batch m runs under the name scope
  '<pipeline>/chunk<c>_mb<m>' (`unrolled.py`); its forward kernels are
  inlined ('.../chunk<c>_mb<m>/StatefulPartitionedCall/<body node>') or the
  call itself, its backward is the gradient function of that call
  ('gradients/.../chunk<c>_mb<m>/<op>_grad/StatefulPartitionedCall');
* loop (`loop.py`), its loops lowered (`control_flow.ObservableLoops`, the
  only way step stats show the kernels inside them), either executor: the
  loops of a pass ('forward', 'backward' or, with the loss inside, 'step')
  are '<pass>_<i>' (lockstep, one loop per segment for all devices) or
  '<pass>_device<k>' (per device, `Executor` tells which ran), and each
  device's instruction of chunk c runs under '.../chunk<c>/', inside the
  branch that picked it: the instruction's path ('<loop>/.../chunk<c>')
  names its kind (`interpreter.py`). Its work is its call of the chunk's
  function ('.../chunk<c>/StatefulPartitionedCall': a backward, a forward
  that keeps its activations), that call's body where TensorFlow inlined
  it ('.../chunk<c>/PartitionedCall/<body node>'), or, for a forward that
  recomputes, its body built inline ('.../chunk<c>/inline_forward/<body
  node>', `scopes.INLINE_FORWARD_SCOPE`). Each executor runs a device's
  actions one at a time in table order, so the n-th instruction a device
  ran (by start) is its n-th action: that tells each kind's phase (in a
  'step' pass a chunk's forward and backward are two kinds, told apart by
  their branches, not by their names) and each run's micro-batch, and so
  the n-th call of chunk c in a phase is the n-th action of chunk c in
  that phase of the table.

A call's window runs from its first kernel's start to its last kernel's end;
transfers (Send/Recv, the per-device executor's queues) are not part of it:
a receive waits for its sender.
For calls that recompute, the recompute is the part of the backward call up
to the end of the last kernel that repeats a forward kernel of the same
chunk (same node name inside the function), and the backward the rest.
A traced step of two chunks on two devices, two micro-batches:

    >>> import numpy as np
    >>> import tensorflow as tf
    >>> from lingvo_gpipe.engine import pipeline
    >>> def Chunk(theta, inputs, state, micro_batch_id):
    ...   return (tf.tanh(tf.matmul(inputs[0], theta)),), state
    >>> pipe = pipeline.Pipeline([Chunk] * 2, ['/cpu:0', '/cpu:1'],
    ...                          num_micro_batches=2, engine='unrolled')
    >>> with tf.Graph().as_default():
    ...   x = tf.compat.v1.placeholder(tf.float32, [4, 8])
    ...   thetas = [tf.compat.v1.placeholder(tf.float32, [8, 8])] * 2
    ...   (y,), _ = pipe(thetas, [x])
    ...   grads = tf.gradients(tf.reduce_sum(y), thetas)
    ...   feed = {x: np.ones([4, 8]), thetas[0]: np.eye(8)}
    ...   config = tf.compat.v1.ConfigProto(device_count={'CPU': 2})
    ...   trace = tf.compat.v1.RunOptions(
    ...       trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    ...   run_metadata = tf.compat.v1.RunMetadata()
    ...   with tf.compat.v1.Session(config=config) as session:
    ...     _ = session.run([y, grads], feed, options=trace,
    ...                     run_metadata=run_metadata)
    >>> kernels = StepKernels(run_metadata.step_stats)
    >>> events, devices = StepEvents(kernels, pipe.table, remat='always',
    ...                              engine='unrolled')
    >>> for k in (0, 1):  # Forward, recompute and backward of each call.
    ...   print(k, ' '.join(f'{e.phase[0]}{e.micro_batch}' for e in events
    ...                     if e.stage == k), devices[k][0].split('/')[-1])
    0 f0 f1 r1 b1 r0 b0 device:CPU:0
    1 f0 f1 r1 b1 r0 b0 device:CPU:1
"""

import collections
import re
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from lingvo_gpipe.engine import scopes
from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate


class Kernel(NamedTuple):
  """One kernel of a traced step."""
  name: str  # The node name.
  op: str  # The op type ('' if the trace does not say).
  device: str  # Where it ran.
  start: int  # Microseconds.
  end: int  # Microseconds.


_CALL = r'((?:Stateful)?PartitionedCall(?:_\d+)?)(?:/(.+))?$'
# Unrolled forward: the chunk's tf.function call, inlined (its body kernels
# are named <scope>/StatefulPartitionedCall/<body node>) or not.
_UNROLLED_FORWARD_RE = re.compile(r'(?:.*/)?chunk(\d+)_mb(\d+)(?:_\d+)?/' +
                                  _CALL)
# Unrolled backward: the gradient function of that call (recompute.py's or
# TensorFlow's). Not inlined, its body kernels show their own names.
_UNROLLED_BACKWARD_RE = re.compile(
    r'gradients(?:_\d+)?/(?:.*/)?chunk(\d+)_mb(\d+)(?:_\d+)?/[^/]+_grad/' +
    _CALL)
# Loop: a kernel of a device's instruction of chunk c in a loop of a pass,
# '<pass>_<i>' (lockstep) or '<pass>_device<k>' (per device); group 1 is the
# instruction's path (one per kind of instruction: the loop, the branch
# picked), group 3 the chunk, group 4 the node inside the instruction.
_LOOP_RE = re.compile(
    r'^((?:.*?/)?(forward|backward|step)_(?:device)?\d+/(?:.*?/)?'
    r'chunk(\d+))/(.+)$')
# Inside an instruction: its call of the chunk's function (a forward that
# keeps its activations, a backward), the call's body kernels where
# TensorFlow inlined it, or the body of a forward built inline.
_LOOP_CALL_RE = re.compile(
    r'^(?:(?:Stateful)?PartitionedCall(?:_\d+)?|'
    r'(?:(?:Stateful)?PartitionedCall(?:_\d+)?|' + scopes.INLINE_FORWARD_SCOPE +
    r')/(.+))$')
# The loops of each executor ('<pass>_device<k>' or '<pass>_<i>').
_PER_DEVICE_LOOP_RE = re.compile(r'(?:^|/)(?:forward|backward|step)_device\d+/')
_LOCKSTEP_LOOP_RE = re.compile(r'(?:^|/)(?:forward|backward|step)_\d+/')
_PASS_PHASES = {'forward': schedule.FORWARD, 'backward': schedule.BACKWARD}
# Op types that do no work of a call (transfers, graph plumbing).
# Asserts are Lingvo's shape checks: on static shapes they read constants
# and run at once, whenever their call comes. A queue's dequeue waits for
# its enqueue (the per-device executor's transfers of lowered loops).
_PLUMBING_OPS = frozenset(['_Send', '_Recv', '_HostSend', '_HostRecv', 'NoOp',
                           '_Arg', '_Retval', 'Identity', 'IdentityN',
                           'Assert', 'QueueEnqueueV2', 'QueueDequeueV2'])
_LABEL_RE = re.compile(r'^\S+ = ([\w.]+)\((.*)\)')
# Nodes the graph partitioner adds: transfers and control edges,
# '.../_<n>', and, where a loop spans processes, each process's copy of the
# loop's control ('_cloop<node>').
_PARTITIONER_NODE_RE = re.compile(r'(^|/)_\d+$|^_cloop')


def StepKernels(step_stats: Any) -> List[Kernel]:
  """The kernels of a `RunMetadata.step_stats` that work on their inputs.

  Kernels without inputs (constants, variable handles, arguments), asserts,
  transfers (Send/Recv, queue ops) and the partitioner's transfer and
  control nodes (`.../_<n>`, `_cloop...`) are left out: they run whenever
  the executor gets to them, or wait for another device, not when their
  call runs.

  Args:
    step_stats: A `tf.compat.v1.RunMetadata().step_stats`.

  Returns:
    The kernels, with times in microseconds.
  """
  kernels = []
  for dev_stats in step_stats.dev_stats:
    for node in dev_stats.node_stats:
      label = _LABEL_RE.match(node.timeline_label)
      op, inputs = label.groups() if label else ('', '?')
      if (not inputs or op in _PLUMBING_OPS or
          _PARTITIONER_NODE_RE.search(node.node_name)):
        continue
      kernels.append(
          Kernel(node.node_name, op, dev_stats.device, node.all_start_micros,
                 node.all_start_micros + node.all_end_rel_micros))
  return kernels


def Executor(kernels: Sequence[Kernel]) -> Optional[str]:
  """Which loop engine executor ran the traced step's loops, if any.

  Args:
    kernels: From `StepKernels`.

  Returns:
    'per_device' (loops '<pass>_device<k>'), 'lockstep' (loops
    '<pass>_<i>'), or None if no kernel is in a lowered loop (the unrolled
    engine, or loops that ran unlowered).
  """
  names = [k.name for k in kernels if _LOOP_RE.match(k.name)]
  if any(_PER_DEVICE_LOOP_RE.search(n) for n in names):
    return 'per_device'
  if any(_LOCKSTEP_LOOP_RE.search(n) for n in names):
    return 'lockstep'
  return None


def _Window(kernels: Sequence[Kernel]) -> Tuple[int, int]:
  return min(k.start for k in kernels), max(k.end for k in kernels)


class _Calls:
  """The kernels of each call, by (phase, chunk, micro-batch).

  Attributes:
    kernels: {(phase, chunk, micro_batch): kernels of the call}.
    inner: {(phase, chunk, micro_batch): (name inside the call, kernel)} for
      kernels named after their call (the unrolled engine's; the loop
      engine's inline and inlined bodies).
  """

  def __init__(self):
    self.kernels = collections.defaultdict(list)
    self.inner = collections.defaultdict(list)


def _UnrolledCalls(kernels: Sequence[Kernel]) -> _Calls:
  calls = _Calls()
  for kernel in kernels:
    match = _UNROLLED_BACKWARD_RE.match(kernel.name)
    phase = schedule.BACKWARD
    if not match and not kernel.name.startswith('gradients'):
      match = _UNROLLED_FORWARD_RE.match(kernel.name)
      phase = schedule.FORWARD
    if match:
      key = (phase, int(match.group(1)), int(match.group(2)))
      calls.kernels[key].append(kernel)
      if match.group(4):
        calls.inner[key].append((match.group(4), kernel))
  return calls


class _Instruction(NamedTuple):
  """One run of a kind of instruction (a loop's branch) on its device."""
  start: int  # Its anchor kernel's start.
  path: str  # The kind: '<loop ...>/chunk<c>'.
  kernels: List[Tuple[str, Kernel]]  # (node inside the instruction, kernel).


def _Instructions(kernels: Sequence[Kernel]
                 ) -> Dict[Tuple[str, str, int], List[_Instruction]]:
  """The runs of each kind of instruction, by (path, pass, chunk), in order.

  The nodes of a kind of instruction run once per run of it; the n-th run
  of each node belongs to its n-th run. Its anchor is its call (else the
  node that ran most often): the runs are counted by it, and a node that
  ran another number of times is left out.
  """
  nodes = collections.defaultdict(lambda: collections.defaultdict(list))
  for kernel in kernels:
    match = _LOOP_RE.match(kernel.name)
    if match:
      path, pass_name, chunk, node = match.groups()
      nodes[path, pass_name, int(chunk)][node].append(kernel)
  instructions = {}
  for key, runs_by_node in nodes.items():
    for runs in runs_by_node.values():
      runs.sort(key=lambda k: k.start)
    calls = [n for n in runs_by_node if _LOOP_CALL_RE.match(n) and
             not _LOOP_CALL_RE.match(n).group(1)]
    anchor = max(calls or runs_by_node,
                 key=lambda n: (len(runs_by_node[n]), n))
    count = len(runs_by_node[anchor])
    instructions[key] = [
        _Instruction(runs_by_node[anchor][i].start, key[0],
                     [(n, runs[i]) for n, runs in runs_by_node.items()
                      if len(runs) == count])
        for i in range(count)
    ]
  return instructions


def _LoopCalls(kernels: Sequence[Kernel], table: schedule.Table) -> _Calls:
  """Loop calls: each device's n-th instruction is its n-th table action.

  Both executors run each device's actions in the table's order, one at a
  time (a tick, or an iteration of the device's loop, per action). Each
  kind of instruction (a loop's branch of one chunk: its path) is one
  phase of one chunk; the device's runs of all its kinds, by start, are its
  actions in order, which says the phase of each kind (in a 'step' pass,
  forward and backward instructions of a chunk are different kinds) and
  the micro-batch of each run. A call's kernels are its function call, the
  call's body where TensorFlow inlined it, or its forward body built
  inline; an instruction without those (a forward whose outputs nothing
  reads, pruned) is timed by its other kernels (buffer reads and writes).

  Args:
    kernels: From `StepKernels`.
    table: The table the step ran.

  Returns:
    The calls.

  Raises:
    ValueError: if a device ran another number of instructions than it has
      actions, or a kind of instruction lines up with several phases or
      another chunk.
  """
  calls = _Calls()
  by_device = collections.defaultdict(list)
  for (path, pass_name, c), runs in _Instructions(kernels).items():
    if c >= table.num_chunks:
      raise ValueError(f'{path}: chunk {c} is not in the table '
                       f'({table.num_chunks} chunks).')
    by_device[table.Device(c)] += [(run, pass_name, c) for run in runs]
  for k, order in enumerate(table.device_orders):
    runs = sorted(by_device[k], key=lambda r: r[0].start)
    if len(runs) != len(order):
      raise ValueError(
          f'device {k} ran {len(runs)} instructions in the traced loops, its '
          f'table has {len(order)} actions; its op names may have changed '
          '(see lingvo_gpipe/engine/trace.py), or loops ran unlowered.')
    phases = {}
    for (run, pass_name, c), (phase, chunk, m) in zip(runs, order):
      expected = _PASS_PHASES.get(pass_name, phase)
      if (chunk != c or phase != expected or
          phases.setdefault(run.path, phase) != phase):
        raise ValueError(
            f"device {k}'s instructions do not run in its table order: "
            f'{run.path} ({pass_name} pass) lines up with {phase} of chunk '
            f'{chunk}, micro-batch {m}.')
      work = [(n, kernel) for n, kernel in run.kernels
              if _LOOP_CALL_RE.match(n)]
      for n, kernel in work or run.kernels:
        calls.kernels[phase, c, m].append(kernel)
        inner = _LOOP_CALL_RE.match(n)
        if inner and inner.group(1):
          calls.inner[phase, c, m].append((inner.group(1), kernel))
  return calls


def StepEvents(kernels: Sequence[Kernel], table: schedule.Table, remat: str,
               engine: str) -> Tuple[List[simulate.Event], Dict[int,
                                                                List[str]]]:
  """Which chunk ran which micro-batch and phase when, in a traced step.

  Args:
    kernels: From `StepKernels`.
    table: The schedule the step ran.
    remat: The pipeline's remat mode.
    engine: 'unrolled' or 'loop' (traced with lowered loops).

  Returns:
    (events, devices): the events with times in seconds from the step's first
    event, ordered by device (stage) and start; and for each device, the
    devices its calls' kernels ran on.

  Raises:
    ValueError: if a call's kernels are missing from the trace.
  """
  calls = (_UnrolledCalls(kernels) if engine == 'unrolled' else
           _LoopCalls(kernels, table))
  by_device = collections.defaultdict(list)
  for kernel in kernels:
    by_device[kernel.device].append(kernel)
  recomputes = schedule.RecomputedCalls(table, remat)
  # The kernel names of each chunk's forward body: inner names (unrolled;
  # loop: inline and inlined bodies), or the kernels of a called function's
  # body inside the forward calls' windows on their device (loop; not the
  # loops' own ops).
  body_names = collections.defaultdict(set)
  for (phase, c, m), call_kernels in calls.kernels.items():
    if phase != schedule.FORWARD:
      continue
    body_names[c].update(name for name, _ in calls.inner[phase, c, m])
    start, end = _Window(call_kernels)
    body_names[c].update(k.name for k in by_device[call_kernels[0].device]
                         if start <= k.start and k.end <= end and
                         k not in call_kernels and
                         (engine == 'unrolled' or not _LOOP_RE.match(k.name)))

  raw, devices = [], collections.defaultdict(set)
  for tick in table.ticks:
    for k, action in enumerate(tick):
      if action is None:
        continue
      phase, c, m = action
      key = (phase, c, m)
      if not calls.kernels.get(key):
        raise ValueError(
            f'no {phase} kernels of chunk {c}, micro-batch {m} in the step '
            f"stats of the {engine} engine; its op names may have changed "
            '(see lingvo_gpipe/engine/trace.py), or loops ran unlowered.')
      call_kernels = calls.kernels[key]
      devices[k].update(kernel.device for kernel in call_kernels)
      start, end = _Window(call_kernels)
      if phase == schedule.BACKWARD and recomputes[c, m]:
        device = call_kernels[0].device
        repeats = [kernel for name, kernel in calls.inner[key]
                   if name in body_names[c]]
        repeats += [kernel for kernel in by_device[device]
                    if start <= kernel.start and kernel.end <= end and
                    kernel.name in body_names[c]]
        if repeats:
          split = max(kernel.end for kernel in repeats)
          raw.append((k, c, m, 'recompute', start, split))
          start = split
      raw.append((k, c, m, phase, start, end))
  first = min(r[4] for r in raw)
  events = [
      simulate.Event(k, c, m, phase, (s - first) * 1e-6, (e - first) * 1e-6)
      for k, c, m, phase, s, e in raw
  ]
  events.sort(key=lambda e: (e.stage, e.start))
  return events, {k: sorted(d) for k, d in devices.items()}
