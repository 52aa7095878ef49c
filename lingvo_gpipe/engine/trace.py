"""Reading a traced step: which stage ran which micro-batch and phase when.

Knows the op names the unrolled engine gives its calls (`pipeline.py`: name
scope '<pipeline name>/stage<k>' for the m-th call of stage k, '_<m>' suffixed
for m > 0; the backward under 'gradients/.../<op>_grad'), so that tools can
turn `RunMetadata.step_stats` of a training step into `simulate.Event`s.

    kernels = StepKernels(run_metadata.step_stats)
    events, devices = StepEvents(kernels, num_stages=4, num_micro=8,
                                 remat='always')
"""

import collections
import re
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate


class Kernel(NamedTuple):
  """One kernel of a traced step."""
  name: str  # The node name.
  op: str  # The op type ('' if the trace does not say).
  device: str  # Where it ran.
  start: int  # Microseconds.
  end: int  # Microseconds.


# Name scope of the engine's ops (`GPipeSequentialLayer` passes 'gpipe'); the
# m-th call of stage k runs under 'stage{k}' (m = 0) or 'stage{k}_{m}'.
_STAGE_SCOPE = r'gpipe/stage(\d+)(?:_(\d+))?/'
_CALL = r'((?:Stateful)?PartitionedCall(?:_\d+)?)(?:/(.+))?$'
# Forward: the stage's tf.function call, inlined (its body kernels are named
# <scope>/StatefulPartitionedCall/<body node>) or not (the call node itself).
_FORWARD_RE = re.compile(r'(?:.*/)?' + _STAGE_SCOPE + _CALL)
# Backward: the gradient function of that call (recompute.py's or
# TensorFlow's), named gradients/.../<scope>/<op>_grad/StatefulPartitionedCall.
# Not inlined, its body kernels show their own names (e.g. 'fc0/MatMul' for
# the recompute, 'gradients/fc0/MatMul_grad/MatMul' for the backward).
_BACKWARD_RE = re.compile(r'gradients(?:_\d+)?/(?:.*/)?' + _STAGE_SCOPE +
                          r'[^/]+_grad/' + _CALL)
# Op types that do no work of a call (transfers, graph plumbing).
_PLUMBING_OPS = frozenset(['_Send', '_Recv', '_HostSend', '_HostRecv', 'NoOp',
                           '_Arg', '_Retval', 'Identity', 'IdentityN'])
_LABEL_RE = re.compile(r'^\S+ = ([\w.]+)\((.*)\)')
# Nodes the graph partitioner adds (transfers, control edges): '.../_<n>'.
_PARTITIONER_NODE_RE = re.compile(r'(^|/)_\d+$')


def StepKernels(step_stats: Any) -> List[Kernel]:
  """The kernels of a `RunMetadata.step_stats` that work on their inputs.

  Kernels without inputs (constants, variable handles, arguments) and the
  partitioner's transfer and control nodes (`.../_<n>`) are left out: they
  run whenever the executor gets to them, not when their call runs.

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


def _Window(kernels: Sequence[Kernel]) -> Tuple[int, int]:
  return min(k.start for k in kernels), max(k.end for k in kernels)


def StepEvents(kernels: Sequence[Kernel], num_stages: int, num_micro: int,
               remat: str
              ) -> Tuple[List[simulate.Event], Dict[int, List[str]]]:
  """Which stage ran which micro-batch and phase when, in a traced step.

  A call's forward spans the kernels of its (inlined) forward function; its
  backward spans its gradient function call. For calls that recompute, the
  recompute is the part of the gradient call up to the end of the last kernel
  that repeats a forward kernel of the same stage (same node name inside the
  function), and the backward the rest (if no such kernel shows, the whole
  call counts as backward).

  Args:
    kernels: From `StepKernels`.
    num_stages: K.
    num_micro: M.
    remat: The pipeline's remat mode.

  Returns:
    (events, devices): the events with times in seconds from the step's first
    event, ordered by stage and start; and for each stage, the devices its
    kernels ran on.

  Raises:
    ValueError: if a call's kernels are missing from the trace.
  """
  forward = collections.defaultdict(list)
  backward = collections.defaultdict(list)
  inlined_backward = collections.defaultdict(list)
  body_names = collections.defaultdict(set)
  for kernel in kernels:
    match = _BACKWARD_RE.match(kernel.name)
    if match:
      key = (int(match.group(1)), int(match.group(2) or 0))
      backward[key].append(kernel)
      if match.group(4):
        inlined_backward[key].append((match.group(4), kernel))
      continue
    match = (None if kernel.name.startswith('gradients')
             else _FORWARD_RE.match(kernel.name))
    if match:
      k = int(match.group(1))
      forward[k, int(match.group(2) or 0)].append(kernel)
      if match.group(4):
        body_names[k].add(match.group(4))
  by_device = collections.defaultdict(list)
  for kernel in kernels:
    by_device[kernel.device].append(kernel)

  raw, devices = [], collections.defaultdict(set)
  for k in range(num_stages):
    for m in range(num_micro):
      for phase, calls in (('forward', forward), ('backward', backward)):
        if not calls.get((k, m)):
          raise ValueError(
              f'no {phase} kernels of stage {k}, micro-batch {m} in the step '
              "stats; the engine's op names may have changed (expected "
              "'gpipe/stage<k>_<m>/StatefulPartitionedCall...' and "
              "'gradients/.../gpipe/stage<k>_<m>/<op>_grad/"
              "StatefulPartitionedCall...').")
        devices[k].update(kernel.device for kernel in calls[k, m])
      raw.append((k, m, 'forward') + _Window(forward[k, m]))
      start, end = _Window(backward[k, m])
      if schedule.Recomputes(remat, m, num_micro):
        call_device = backward[k, m][0].device
        repeats = [kernel for name, kernel in inlined_backward[k, m]
                   if name in body_names[k]]
        repeats += [kernel for kernel in by_device[call_device]
                    if start <= kernel.start and kernel.end <= end and
                    kernel.name in body_names[k]]
        if repeats:
          split = max(kernel.end for kernel in repeats)
          raw.append((k, m, 'recompute', start, split))
          start = split
      raw.append((k, m, 'backward', start, end))
  first = min(r[3] for r in raw)
  events = [simulate.Event(k, m, phase, (s - first) * 1e-6, (e - first) * 1e-6)
            for k, m, phase, s, e in raw]
  events.sort(key=lambda e: (e.stage, e.start))
  return events, {k: sorted(d) for k, d in devices.items()}
