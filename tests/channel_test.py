"""Channels, and the loop engine's per-device loops joined by them."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.engine import channel
from lingvo_gpipe.engine import control_flow
from lingvo_gpipe.engine import pipeline
import engine_util

RNG = np.random.RandomState(3)
WEIGHTS = [RNG.randn(5, 5).astype(np.float32) * 0.6 for _ in range(4)]
X = RNG.randn(16, 5).astype(np.float32)


def testFullDeviceNames():
  full = engine_util.CPUS[1]
  assert channel.FullDeviceName(full) == full
  assert channel.FullDeviceName('/cpu:1') == full
  assert channel.FullDeviceName('/device:CPU:1') == full
  assert channel.FullDeviceName('/job:localhost/device:CPU:1') == full
  assert channel.FullDeviceName('') is None
  assert channel.FullDeviceName('/job:localhost') is None
  assert (channel.FullDeviceName('/job:worker/device:GPU:1') ==
          '/job:worker/replica:0/task:0/device:GPU:1')


def _Unlowered(loop_output):
  """Keeps the While op that made `loop_output` functional (not lowered)."""
  op = loop_output.op
  while op.type == 'Identity':
    op = op.inputs[0].op
  op._set_attr('_lower_using_switch_merge',  # pylint: disable=protected-access
               tf.compat.v1.AttrValue(b=False))


def testAChannelDeliversInOrderBetweenLoops():
  """Two functional loops on two devices: the k-th Recv gets the k-th Send.

  Lowered loops would key each end by its own frame, and never meet.
  """
  send_device, recv_device = engine_util.CPUS[:2]
  ch = channel.Channel(tf.TensorSpec([], tf.float32), send_device,
                       recv_device, 'squares')
  with tf.Graph().as_default():
    with tf.device(send_device):

      def Send(i):
        with tf.control_dependencies([ch.Send(tf.cast(i * i, tf.float32))]):
          return i + 1

      (sent,) = tf.while_loop(lambda i: i < 6, Send, [tf.constant(0)])
      _Unlowered(sent)
    with tf.device(recv_device):

      def Recv(i, total):
        return i + 1, total + tf.cast(i, tf.float32) * ch.Recv()

      _, total = tf.while_loop(lambda i, _: i < 6, Recv,
                               [tf.constant(0), tf.constant(0.0)])
      _Unlowered(total)
    with tf.compat.v1.Session(config=engine_util.SessionConfig()) as sess:
      # Fetch both loops: nothing else makes the receiver need the sender.
      assert sess.run([sent, total]) == [6, sum(i**3 for i in range(6))]


def _Stage(theta, inputs, state, micro_batch_id):
  del micro_batch_id
  (x,) = inputs
  for w in theta:
    x = tf.tanh(tf.matmul(x, w))
  return (x,), state


def _GradientsOfPipe(k, m, v=1, remat='always'):
  """The loss and its gradients (weights, input), and the plain ones."""
  ws = [tf.constant(w) for w in WEIGHTS]
  x = tf.constant(X)
  chunks = k * v
  per = len(ws) // chunks
  pipe = pipeline.Pipeline([_Stage] * chunks, engine_util.CPUS[:k], m,
                           remat=remat, engine='loop', virtual_stages=v)
  (y,), _ = pipe([ws[c * per:(c + 1) * per] for c in range(chunks)], [x],
                 [{}] * chunks)
  plain = x
  for w in ws:
    plain = tf.tanh(tf.matmul(plain, w))
  piped_loss, plain_loss = tf.reduce_sum(y * y), tf.reduce_sum(plain * plain)
  return ([piped_loss] + tf.gradients(piped_loss, ws + [x]),
          [plain_loss] + tf.gradients(plain_loss, ws + [x]))


def _LoopsAndChannelOps(graph):
  """(devices of the graph's While ops, Send and Recv ops in loop bodies)."""
  whiles = [op.device for op in graph.get_operations()
            if op.type in ('While', 'StatelessWhile')]
  nodes = [n.op for f in graph.as_graph_def().library.function
           for n in f.node_def]
  return whiles, nodes.count('Send'), nodes.count('Recv')


@pytest.mark.parametrize('k,v', [(2, 1), (4, 1), (2, 2)])
def testGraphModeRunsOneLoopPerDeviceJoinedByChannels(k, v):
  """TF1 graph: K forward and K backward loops, a channel per edge way.

  C = K v chunks have C - 1 edges between them; each carries the
  activations forward (a Send in the writer's forward loop, a Recv in the
  reader's) and their gradients back. The step stays transparent.
  """
  graph = tf.Graph()
  with graph.as_default():
    piped, plain = _GradientsOfPipe(k, 8, v)
    whiles, sends, recvs = _LoopsAndChannelOps(graph)
    with tf.compat.v1.Session(config=engine_util.SessionConfig()) as sess:
      actual, expected = sess.run([piped, plain])
  assert sorted(whiles) == sorted(engine_util.CPUS[:k] * 2)
  assert sends == recvs == 2 * (k * v - 1)
  engine_util.AssertTransparent(actual, expected)


def testOneFOneBRunsOneLoopPerDevice():
  """With the loss inside, each device runs one loop of both phases."""
  graph = tf.Graph()
  with graph.as_default():
    ws = [tf.constant(w) for w in WEIGHTS]
    x = tf.compat.v1.placeholder_with_default(X, X.shape)

    def LossStage(theta, inputs, state, micro_batch_id):
      (y,), state = _Stage(theta, inputs, state, micro_batch_id)
      return (tf.reduce_mean(y * y),), state

    pipe = pipeline.Pipeline([_Stage, LossStage], engine_util.CPUS[:2], 4,
                             remat='never', engine='loop', schedule='1f1b')
    (loss,), _ = pipe([ws[:2], ws[2:]], [x], [{}, {}])
    d_x = tf.gradients(loss, [x])[0]
    whiles, sends, recvs = _LoopsAndChannelOps(graph)
    plain = x
    for w in ws:
      plain = tf.tanh(tf.matmul(plain, w))
    plain_loss = tf.add_n([tf.reduce_mean(p * p)
                           for p in tf.split(plain, 4)]) / 4
    with tf.compat.v1.Session(config=engine_util.SessionConfig()) as sess:
      # d_x alone: its loop (device 0) must still run the loop it receives
      # the gradients from.
      actual_d_x = sess.run(d_x)
      actual, expected = sess.run(
          [[loss, d_x], [plain_loss, tf.gradients(plain_loss, [x])[0]]])
  assert sorted(whiles) == engine_util.CPUS[:2]
  assert (sends, recvs) == (2, 2)
  engine_util.AssertTransparent(actual, expected)
  engine_util.AssertTransparent([actual_d_x], [expected[1]])


def testFunctionsAndXlaRunTicksInLockstep():
  """Inside tf.function (with or without XLA): one loop per segment."""
  for jit_compile in (False, True):

    @tf.function(jit_compile=jit_compile, autograph=False)
    def Step():
      return _GradientsOfPipe(2, 8)

    concrete = Step.get_concrete_function()
    whiles, sends, _ = _LoopsAndChannelOps(concrete.graph)
    assert sends == 0
    # GPipe's fill, full and drain ticks, forward and backward.
    assert len(whiles) == 6, whiles
    actual, expected = Step()
    engine_util.AssertTransparent([a.numpy() for a in actual],
                                  [e.numpy() for e in expected])


def testObservableLoopsRunTheSameExecutorOverQueues():
  """Lowered loops (for step stats): per-device loops, links are queues.

  Send/Recv keys carry a lowered loop's frame; FIFO queues, on the
  receiving device, do not. The step stays transparent, and step stats show
  the kernels of every device's loop.
  """
  graph = tf.Graph()
  with graph.as_default(), control_flow.ObservableLoops():
    piped, plain = _GradientsOfPipe(2, 4)
    whiles, sends, _ = _LoopsAndChannelOps(graph)
    queues = [op.device for op in graph.get_operations()
              if op.type == 'FIFOQueueV2']
    with tf.compat.v1.Session(config=engine_util.SessionConfig()) as sess:
      trace = tf.compat.v1.RunOptions(
          trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
      metadata = tf.compat.v1.RunMetadata()
      actual, expected = sess.run([piped, plain], options=trace,
                                  run_metadata=metadata)
  assert sends == 0
  assert sorted(whiles) == sorted(engine_util.CPUS[:2] * 2)
  # Edge 1 forward (to device 1) and back (to device 0).
  assert sorted(queues) == engine_util.CPUS[:2]
  engine_util.AssertTransparent(actual, expected)
  matmuls = {dev.device for dev in metadata.step_stats.dev_stats
             for node in dev.node_stats
             if '/chunk' in node.node_name and 'MatMul' in node.node_name}
  assert sorted(matmuls) == engine_util.CPUS[:2]


