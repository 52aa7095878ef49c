"""How the loop engine's executors move an edge's tensors between devices.

The interpreter (`interpreter.py`) asks a transport for a forward's inputs
and a backward's output gradients, and hands it a forward's outputs and a
backward's input gradients. Two transports:

* `Buffers` (the lockstep executor): every edge's tensors go to a buffer on
  its reader's device, their gradients to one on its writer's, at the slots
  of the lowered step's transfers. An instruction leaves its results in the
  transport's loop variables ('sent', 'sent_grad', per edge); the executor
  writes them to the buffers after each tick (`WriteTick`): one write per
  edge and tick, outside the devices' branches;
* `Links` (the per-device executor): each transfer goes over a link from
  the producing device to the receiving one, which delivers in send order:
  a channel (`channel.Channel`, TensorFlow's own Send/Recv, for functional
  loops) or a FIFO queue on the receiving device (for lowered loops, whose
  Send/Recv keys carry their loop frame). A channel between processes is
  relayed (`_Relay`): a loop of its own receives each tensor as soon as it
  is sent. A forward's received inputs are also written to the 'data'
  buffer its backward reads.

The input edge's gradients and the output edges' tensors stay in buffers on
their device, whichever transport.
"""

import collections
from typing import Any, Dict, List, Sequence, Tuple

import tensorflow as tf

from lingvo_gpipe.engine import channel
from lingvo_gpipe.engine import chunks as chunks_lib
from lingvo_gpipe.engine import control_flow
from lingvo_gpipe.planning import lowering

F, B = lowering.F, lowering.B


class Buffers:
  """Edges' tensors through buffers indexed by slot (lockstep executor)."""

  FIELDS = ('sent', 'sent_grad')

  @staticmethod
  def HasBuffer(unused_kind: str, unused_e: int) -> bool:
    return True

  @staticmethod
  def Initial(interp) -> Dict[str, List[List[tf.Tensor]]]:
    """Placeholders of the latest results sent over each edge."""
    v = {'sent': [], 'sent_grad': []}
    for e, edge in enumerate(interp.edges):
      boundary = interp.boundaries[e]
      device = interp.BufferDevice('data', e)
      with tf.device(device):
        v['sent'].append([chunks_lib.Placeholder(s) for s in boundary.specs]
                         if edge.source is not None else [])
        v['sent_grad'].append(
            [chunks_lib.Placeholder(s) for s in boundary.DifferentiableSpecs()]
            if edge.target is not None else [])
    return v

  @staticmethod
  def Invariants(interp) -> Dict[str, List[List[tf.TensorShape]]]:
    """The placeholders' unknown dimensions are 0: their specs' shapes."""
    return {
        'sent': [[s.shape for s in b.specs] if e.source is not None else []
                 for e, b in zip(interp.edges, interp.boundaries)],
        'sent_grad': [[s.shape for s in b.DifferentiableSpecs()]
                      if e.target is not None else []
                      for e, b in zip(interp.edges, interp.boundaries)],
    }

  @staticmethod
  def Changed(interp, k: int, phase: str) -> List[Tuple[str, int]]:
    own = interp.Own(k)
    if phase == F:
      return [('sent', e) for e, edge in enumerate(interp.edges)
              if edge.source in own]
    if phase == B:
      return [('sent_grad', e) for e, edge in enumerate(interp.edges)
              if edge.target in own]
    return []  # A weight gradient moves nothing between devices.

  @staticmethod
  def ForwardInput(unused_interp, e: int, row, v, unused_new
                  ) -> List[tf.Tensor]:
    return [a.read(row['data_read', e]) for a in v['data'][e]]

  @staticmethod
  def ForwardOutput(unused_interp, e: int, tensors: List[tf.Tensor],
                    unused_m, unused_row, unused_v, new) -> List[Any]:
    new['sent'][e] = list(tensors)
    return []

  @staticmethod
  def OutputGradient(unused_interp, e: int, row, v) -> List[tf.Tensor]:
    return [a.read(row['grad_read', e]) for a in v['grad'][e]]

  @staticmethod
  def InputGradient(unused_interp, e: int, grads: List[tf.Tensor], unused_m,
                    unused_row, unused_v, new) -> List[Any]:
    new['sent_grad'][e] = list(grads)
    return []

  @staticmethod
  def WriteTick(interp, changes: Dict[str, Sequence[int]], fields,
                v) -> None:
    """Writes what the tick sent to the buffers, at the rows' write slots.

    Only the edges that some instruction of the segment sends on are
    written (at the spare slot at a tick where none does): the others'
    placeholders, whose unknown dimensions are 0, must not land in a buffer
    whose gathered slots hold real micro-batches.

    Args:
      interp: The interpreter.
      changes: What the segment's instructions change; its 'sent' and
        'sent_grad' are the edges they send tensors or gradients on.
      fields: Every edge field of the tick: {(field, edge): slot}.
      v: The variables after the tick's instructions; updated.
    """
    for kind, sent in (('data', 'sent'), ('grad', 'sent_grad')):
      for e in changes[sent]:
        if v[kind][e]:
          with tf.device(interp.BufferDevice(kind, e)):
            v[kind][e] = [a.write(fields[f'{kind}_write', e], t)
                          for a, t in zip(v[kind][e], v[sent][e])]


class _Queue:
  """A link that is a FIFO queue on the receiving device."""

  def __init__(self, spec: tf.TensorSpec, unused_send_device: str,
               recv_device: str, name: str):
    self.spec = spec
    with tf.device(recv_device):
      self._queue = tf.queue.FIFOQueue(capacity=2**20, dtypes=[spec.dtype],
                                       shapes=[spec.shape], name=name)

  def Send(self, t: tf.Tensor) -> tf.Operation:
    return self._queue.enqueue([t])

  def Recv(self) -> tf.Tensor:
    t = self._queue.dequeue()
    t.set_shape(self.spec.shape)
    return t


class _Relay:
  """A channel between processes whose tensors a loop receives ahead.

  A Recv pulls its tensor from the sending process over RPC when it runs: in
  a device's loop, only once the instruction that reads it starts, so the
  transfer adds to that instruction's time even where the tensor was sent
  long before (relayed, zbv's step at K = 2, M = 4 on pinned processes is
  about 6% shorter: docs/benchmarks.md). The relay's own loop (`Loop`)
  receives each tensor as soon as it is sent and queues it on the receiving
  device, where the instruction dequeues it.
  """

  def __init__(self, spec: tf.TensorSpec, send_device: str,
               recv_device: str, name: str):
    self._channel = channel.Channel(spec, send_device, recv_device, name)
    self._queue = _Queue(spec, send_device, recv_device, f'{name}_relay')
    self.recv_device = recv_device

  def Send(self, t: tf.Tensor) -> tf.Operation:
    return self._channel.Send(t)

  def Recv(self) -> tf.Tensor:
    return self._queue.Recv()

  def Loop(self, count: int, name: str) -> tf.Tensor:
    """Receives `count` tensors into the queue; returns the loop's end."""
    with tf.device(self.recv_device):

      def Body(i):
        with tf.control_dependencies([self._queue.Send(self._channel.Recv())]):
          return i + 1

      (done,) = tf.while_loop(lambda i: i < count, Body, [tf.constant(0)],
                              parallel_iterations=1, name=name)
      control_flow.KeepUnlowered(done, control_flow.LOOP_OPS, lowered=False)
    return done


class Links:
  """Edges' tensors over links between devices (per-device executor).

  Attributes:
    training: Whether forwards save their received inputs for the backward.
  """

  FIELDS = ()

  def __init__(self, interp, devices: Sequence[str], queues: bool):
    """Builds a link per edge tensor and direction.

    Args:
      interp: The interpreter.
      devices: The K devices' full names.
      queues: Whether the links are queues (lowered loops) or channels.
    """
    self.training = interp.step.training
    table = interp.step.table
    self._links = {}

    def Link(spec, send_device, recv_device, name):
      if queues:
        return _Queue(spec, send_device, recv_device, name)
      if channel.Task(send_device) != channel.Task(recv_device):
        return _Relay(spec, send_device, recv_device, name)
      return channel.Channel(spec, send_device, recv_device, name)

    for e, edge in enumerate(interp.edges):
      if edge.source is None or edge.target is None:
        continue
      writer = devices[table.Device(edge.source)]
      reader = devices[table.Device(edge.target)]
      boundary = interp.boundaries[e]
      self._links[e, 'data'] = [Link(s, writer, reader, f'edge{e}_data')
                                for s in boundary.specs]
      self._links[e, 'grad'] = [Link(s, reader, writer, f'edge{e}_grad')
                                for s in boundary.DifferentiableSpecs()]
    self._relayed = set()  # The links whose relay loops are built.

  def RelayLoops(self, interp, ticks: Sequence[int],
                 name: str) -> List[tf.Tensor]:
    """Builds the relay loops of the links a pass receives on.

    Args:
      interp: The interpreter.
      ticks: The pass's ticks.
      name: The loops' name prefix.

    Returns:
      The loops' ends, which the step must wait for.

    Raises:
      ValueError: if a link received on in an earlier pass is received on
        again: its two relay loops could take each other's tensors.
    """
    counts = collections.Counter()
    ticks = set(ticks)
    for program in interp.step.programs:
      for instruction in program:
        if instruction.tick not in ticks:
          continue
        phase, c, _ = instruction.key
        chunk = interp.chunks[c]
        if phase == F:
          counts.update((e, 'data') for e in chunk.in_edges)
        elif phase == B:
          counts.update((e, 'grad') for e in chunk.out_edges)
    ends = []
    for key, count in sorted(counts.items()):
      for i, link in enumerate(self._links.get(key, [])):
        if not isinstance(link, _Relay):
          continue
        if (key, i) in self._relayed:
          raise ValueError(f'Edge {key[0]} {key[1]} is received on in two '
                           'passes of one step.')
        self._relayed.add((key, i))
        ends.append(link.Loop(count,
                              f'{name}_relay_edge{key[0]}_{key[1]}{i}'))
    return ends

  def HasBuffer(self, kind: str, e: int) -> bool:
    """The output's tensors, the input's gradients and, in training, the
    inputs a backward reads: links carry the rest."""
    between = (e, 'data') in self._links
    return not between if kind == 'grad' else self.training or not between

  @staticmethod
  def Initial(unused_interp) -> Dict[str, Any]:
    return {}

  @staticmethod
  def Invariants(unused_interp) -> Dict[str, Any]:
    return {}

  def Changed(self, interp, k: int, phase: str) -> List[Tuple[str, int]]:
    own = interp.Own(k)
    changed = []
    for e, edge in enumerate(interp.edges):
      if phase == F and edge.target in own and self.training and (
          (e, 'data') in self._links):
        changed.append(('data', e))
      if phase == F and edge.source in own and edge.target is None:
        changed.append(('data', e))
      if phase == B and edge.target in own and edge.source is None:
        changed.append(('grad', e))
    return changed

  def ForwardInput(self, unused_interp, e: int, row, v, new
                  ) -> List[tf.Tensor]:
    received = [link.Recv() for link in self._links[e, 'data']]
    if self.training:
      new['data'][e] = [a.write(row['data_read', e], t)
                        for a, t in zip(v['data'][e], received)]
    return received

  def ForwardOutput(self, interp, e: int, tensors: List[tf.Tensor], m,
                    unused_row, v, new) -> List[Any]:
    return self._Deliver('data', e, tensors, m,
                         interp.edges[e].target is None, v, new)

  def OutputGradient(self, unused_interp, e: int, unused_row, unused_v
                    ) -> List[tf.Tensor]:
    return [link.Recv() for link in self._links[e, 'grad']]

  def InputGradient(self, interp, e: int, grads: List[tf.Tensor], m,
                    unused_row, v, new) -> List[Any]:
    return self._Deliver('grad', e, grads, m,
                         interp.edges[e].source is None, v, new)

  def _Deliver(self, kind: str, e: int, values: List[tf.Tensor], m,
               leaves_pipeline: bool, v, new) -> List[Any]:
    """Sends an edge's values over its links, or, where the edge leaves the
    pipeline (the output's tensors, the input's gradients), writes them to
    its buffer at micro-batch m; returns the Send ops."""
    if leaves_pipeline:
      new[kind][e] = [a.write(m, t) for a, t in zip(v[kind][e], values)]
      return []
    return [link.Send(t) for link, t in zip(self._links[e, kind], values)]
