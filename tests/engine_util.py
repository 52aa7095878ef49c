"""Helpers of the engine tests: devices, sessions, numeric comparisons.

TensorFlow and numpy only; no Lingvo (the engine tests must run without it).
"""

import collections
import re

import numpy as np
import tensorflow as tf

from lingvo_gpipe.engine import control_flow
from lingvo_gpipe.engine import pipeline
from lingvo_gpipe.planning import schedule

# Every (engine, remat) pair that builds a step.
ENGINE_REMAT_MODES = [(engine, remat) for engine in schedule.ENGINES
                      for remat in schedule.REMAT_MODES]

NUM_DEVICES = 4
CPUS = [f'/job:localhost/replica:0/task:0/device:CPU:{i}'
        for i in range(NUM_DEVICES)]


# The engine tests' small model: four tanh layers of 6 x 6 weights, a batch
# of 8.
_RNG = np.random.RandomState(1)
DENSE_WEIGHTS = [_RNG.randn(6, 6).astype(np.float32) * 0.5 for _ in range(4)]
DENSE_X = _RNG.randn(8, 6).astype(np.float32)


def DenseStage(theta, inputs, state, micro_batch_id):
  """tanh layers; counts its calls and sums an auxiliary loss in `state`."""
  del micro_batch_id
  x, mask = inputs
  for w in theta:
    x = tf.tanh(tf.matmul(x, w))
  new_state = {'calls': state['calls'] + 1,
               'aux': state['aux'] + tf.reduce_mean(x)}
  return (x, mask), new_state


def TanhChunk(theta, inputs, state, unused_micro_batch_id):
  """A chunk of tanh layers, one per weight in theta; state passes through."""
  (y,) = inputs
  for w in theta:
    y = tf.tanh(tf.matmul(y, w))
  return (y,), state


def TanhLossChunk(theta, inputs, state, micro_batch_id):
  """`TanhChunk` then the loss mean(y^2): the last chunk of a loss-inside
  schedule."""
  (y,), state = TanhChunk(theta, inputs, state, micro_batch_id)
  return (tf.reduce_mean(y * y),), state


def Plain(weights, x):
  for w in weights:
    x = tf.tanh(tf.matmul(x, w))
  return x


def Piped(weights, x, k, m, remat, devices, engine, virtual_stages=1):
  """The weights cut into K v chunks, chunk c on devices[c % K]."""
  chunks = k * virtual_stages
  per = len(weights) // chunks
  pipe = pipeline.Pipeline([DenseStage] * chunks, devices[:k], m, remat=remat,
                           engine=engine, virtual_stages=virtual_stages)
  states = [{'calls': tf.constant(0), 'aux': tf.constant(0.0)}] * chunks
  (y, mask), states = pipe(
      [weights[i * per:(i + 1) * per] for i in range(chunks)], [x, None],
      states)
  assert mask is None
  return y, states


def Loss(y, aux):
  return tf.reduce_sum(y * y) + 3.0 * aux


def SessionConfig():
  """A TF1 session config with the four CPU devices the tests use."""
  return tf.compat.v1.ConfigProto(device_count={'CPU': NUM_DEVICES})


def RelErr(actual, expected, floor=0.0):
  """max |actual - expected| / max(max |expected|, floor); 0 if equal."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  if not expected.size:
    return 0.0
  diff = np.max(np.abs(actual - expected))
  return 0.0 if diff == 0 else diff / max(np.max(np.abs(expected)), floor)


def AssertTransparent(actual_values, expected_values, tol=1e-5):
  """Every tensor matches to relative error < tol.

  A tensor whose expected value is mathematically zero (e.g. the gradient of
  an attention key bias, which softmax ignores) holds only float round-off of
  the size of 1e-8 of the largest tensor; it can have no relative error, so
  both sides must stay below 1e-6 of the largest tensor instead.

  Args:
    actual_values: Arrays from the pipeline.
    expected_values: Arrays from the reference, same shapes.
    tol: The largest relative error allowed.
  """
  assert len(actual_values) == len(expected_values)
  zero = 1e-6 * max(
      np.max(np.abs(e)) if np.size(e) else 0.0 for e in expected_values)
  for i, (a, e) in enumerate(zip(actual_values, expected_values)):
    assert np.shape(a) == np.shape(e), (i, np.shape(a), np.shape(e))
    if np.size(e) and np.max(np.abs(e)) < zero:
      assert np.max(np.abs(a)) < zero, f'tensor {i} should be ~0: {a}'
    else:
      err = RelErr(a, e)
      assert err < tol, f'tensor {i}: relative error {err}'


def ObservableLoops(engine):
  """With engine='loop', builds loops whose kernels show in step stats."""
  return control_flow.ObservableLoops(lowered=engine == 'loop')


def LoopCallDevices(graph):
  """{(phase, chunk): devices} of the loop engine's chunk calls in `graph`.

  Each tick's call of chunk c is built in name scope 'chunk<c>' of a loop
  body ('..._<phase>_<i>_body_...') or of a branch of a device's cond or
  switch ('...device<k>_<phase>_...'): a node
  'chunk<c>/StatefulPartitionedCall' where the call is a function (a
  backward, or a forward that keeps its activations), the body's own ops
  where it is built inline (a forward that recomputes); the call's Recv,
  Send and buffer ops are in that scope too.

  Args:
    graph: A graph with the loop engine's loops (TF1 or tf.function's).

  Returns:
    A dict of sets of device strings.
  """
  devices = collections.defaultdict(set)
  for function in graph.as_graph_def().library.function:
    phase = re.search(r'(?:^|_)(forward|backward)_',
                      function.signature.name)
    if not phase:
      continue
    for node in function.node_def:
      chunk = re.search(r'(?:^|/)chunk(\d+)/', node.name)
      if chunk:
        devices[phase.group(1), int(chunk.group(1))].add(node.device)
  return dict(devices)


def ExecutedAncestors(partition_graphs):
  """{node: the nodes it waits for} in the graphs a session run executed.

  `RunMetadata.partition_graphs` (from `RunOptions(output_partition_graphs=
  True)`) are the graphs as they ran: after Grappler and function inlining,
  one per device, with the node names that step stats report. A node waits
  for its data and control inputs; a `_Recv` for the `_Send` of the same
  rendezvous key (tensor name, sending and receiving device) on another
  device. The executor starts a kernel only once every node it waits for has
  finished, and it records a kernel's end in the step stats before it
  schedules the kernels waiting for it, so a node's step-stats start is never
  earlier than the end of any of its ancestors. A kernel that is not an
  ancestor may run before, during or after: when it runs is then a matter of
  threads and load, not of the graph.

  Args:
    partition_graphs: `RunMetadata.partition_graphs`.

  Returns:
    A function from a node's name to the frozenset of its transitive
    ancestors' names.
  """
  nodes = {n.name: n for g in partition_graphs for n in g.node}

  def Key(node):
    return tuple(node.attr[a].s
                 for a in ('tensor_name', 'send_device', 'recv_device'))

  sends = {Key(n): n.name for n in nodes.values()
           if n.op in ('_Send', '_HostSend')}
  inputs = {}
  for name, node in nodes.items():
    inputs[name] = [i.lstrip('^').split(':')[0] for i in node.input]
    if node.op in ('_Recv', '_HostRecv'):
      inputs[name].append(sends[Key(node)])
  ancestors = {}

  def Ancestors(name):
    if name not in ancestors:
      # Iterative depth-first search (graphs are deep for recursion).
      seen, stack = set(), [name]
      while stack:
        for parent in inputs[stack.pop()]:
          if parent not in seen:
            seen.add(parent)
            stack.append(parent)
      ancestors[name] = frozenset(seen)
    return ancestors[name]

  return Ancestors
