"""Scaling out: XLA, data parallel x pipeline, and stages in other processes.

* The whole training step (loss, gradients and the optimizer's update)
  compiles under XLA and equals the same step without XLA.
* `MirroredStrategy` runs R = 2 replicas of a K = 2 stage pipeline on 4
  logical CPU devices, each replica on its own 2 devices through Lingvo's model
  split; the all-reduced step equals one device on the full batch.
* The stages run in two TF server processes; a killed worker fails the step
  within a bounded time, and a new session recovers from the checkpoint.
"""

import collections
import re
import socket
import threading
import time

import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils

from benchmarks import loopback
from lingvo_gpipe.engine import channel
from lingvo_gpipe.engine import pipeline
import engine_util
import test_util

X = np.random.RandomState(0).randn(16, 8).astype(np.float32)
LEARNING_RATE = 0.05
MOMENTUM = 0.9
# Bound on every call of a session on the cluster (a step against a dead
# worker must fail, not hang).
TIMEOUT_S = 20
_WORKER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                  tf.errors.AbortedError)


def _Pipe(num_stages, num_micro_batches, **kwargs):
  return test_util.PipeParams(
      test_util.FCCells(), num_stages=num_stages,
      num_micro_batches=num_micro_batches, **kwargs).Instantiate()


def _Loss(layer, x, global_batch):
  """Mean over the global batch of the squared outputs."""
  return tf.reduce_sum(tf.square(layer.FProp(layer.theta, x))) / global_batch


def _Numpy(tensors):
  return [t.numpy() for t in tensors]


def _EagerTrainStep(layer, jit_compile):
  """One momentum step of `layer` on X in one tf.function.

  Args:
    layer: A Lingvo layer created eagerly.
    jit_compile: Whether XLA compiles the whole function.

  Returns:
    A function returning [loss] + gradients + variables after the update.
  """
  optimizer = tf.compat.v1.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM)

  @tf.function(jit_compile=jit_compile, autograph=False)
  def Step():
    with tf.GradientTape() as tape:
      loss = _Loss(layer, tf.constant(X), X.shape[0])
    variables = layer.vars.Flatten()
    grads = tape.gradient(loss, variables)
    update = optimizer.apply_gradients(zip(grads, variables))
    with tf.control_dependencies([update]):
      return [loss] + grads + [tf.identity(v) for v in variables]

  return Step


@pytest.mark.parametrize('num_stages,num_micro_batches,remat,engine', [
    (4, 4, 'always', 'unrolled'), (2, 2, 'never', 'unrolled'),
    (4, 4, 'always', 'loop')])
def testWholeTrainStepUnderXlaEqualsWithout(num_stages, num_micro_batches,
                                            remat, engine):
  """Three steps, so the momentum slots created at step 1 are used too."""
  layers = [_Pipe(num_stages, num_micro_batches, remat=remat, engine=engine)
            for _ in range(2)]
  for plain_var, xla_var in zip(layers[0].vars.Flatten(),
                                layers[1].vars.Flatten()):
    xla_var.assign(plain_var)
  plain_step = _EagerTrainStep(layers[0], jit_compile=False)
  xla_step = _EagerTrainStep(layers[1], jit_compile=True)
  for _ in range(3):
    expected = _Numpy(plain_step())
    engine_util.AssertTransparent(_Numpy(xla_step()), expected)
  assert expected[0] > 0  # The step did not degenerate to zero outputs.


def _CallDevices(graph):
  """{(replica, stage or None): devices} of the pipeline's function calls.

  Forward calls are named ".../gpipe/chunk<k>_mb<m>/...", backward (recompute)
  calls belong to the stage whose forward function they differentiate, which
  their name does not say, so they are collected under None.

  Args:
    graph: A traced graph.

  Returns:
    A dict of sets of device strings.
  """
  devices = collections.defaultdict(set)
  for op in graph.get_operations():
    if op.type != 'StatefulPartitionedCall':
      continue
    replica = int(re.match(r'(replica_(\d+)/)?', op.name).group(2) or 0)
    stage = re.search(r'gpipe/chunk(\d+)', op.name)
    devices[(replica, stage and int(stage.group(1)))].add(op.device)
  return dict(devices)


def testMirroredStrategyReplicasOfAPipeline(engine):
  """R = 2 replicas x K = 2 stages on CPU:0,1 and CPU:2,3; SGD all-reduced."""
  num_replicas, num_stages = 2, 2
  splits = [engine_util.CPUS[:2], engine_util.CPUS[2:]]
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=num_replicas * num_stages,
      split_size=num_stages)
  strategy = tf.distribute.MirroredStrategy([split[0] for split in splits])
  with strategy.scope():
    layer = _Pipe(num_stages, num_micro_batches=2, engine=engine)
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)
  initial = _Numpy(layer.vars.Flatten())
  assert [v.device for v in layer.vars.fc0.w.values] == [
      split[0] for split in splits]
  stage_devices = {}

  def ReplicaStep(x):
    context = tf.distribute.get_replica_context()
    replica = int(tf.get_static_value(context.replica_id_in_sync_group))
    # Lingvo's cluster is per thread and MirroredStrategy runs each replica in
    # its own thread: enter it here, with this replica's model split.
    with cluster, cluster_factory.SetModelSplit(replica):
      stage_devices[replica] = layer.StageDevices()
      with tf.GradientTape() as tape:
        loss = _Loss(layer, x, X.shape[0])
    variables = layer.vars.Flatten()
    grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables))  # All-reduces (sums).
    return [context.all_reduce('sum', loss)] + context.all_reduce('sum', grads)

  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices(X).batch(X.shape[0]))

  @tf.function(autograph=False)
  def Step(iterator):
    results = strategy.run(ReplicaStep, (next(iterator),))
    return [strategy.experimental_local_results(r)[0] for r in results]

  iterator = iter(dataset)
  actual = _Numpy(Step(iterator)) + _Numpy(layer.vars.Flatten())

  assert stage_devices == dict(enumerate(splits))
  graph = Step.get_concrete_function(iterator).graph
  cpus = engine_util.CPUS
  if engine == 'unrolled':
    assert _CallDevices(graph) == {
        (0, 0): {cpus[0]}, (0, 1): {cpus[1]}, (0, None): {cpus[0], cpus[1]},
        (1, 0): {cpus[2]}, (1, 1): {cpus[3]}, (1, None): {cpus[2], cpus[3]}}
  else:
    assert engine_util.LoopCallDevices(graph) == {
        (phase, k): {cpus[k], cpus[2 + k]}
        for phase in ('forward', 'backward') for k in range(num_stages)}

  reference = test_util.Reference(test_util.FCCells())
  for variable, value in zip(reference.vars.Flatten(), initial):
    variable.assign(value)
  with tf.GradientTape() as tape:
    loss = _Loss(reference, tf.constant(X), X.shape[0])
  grads = _Numpy(tape.gradient(loss, reference.vars.Flatten()))
  updated = [w - LEARNING_RATE * g for w, g in zip(initial, grads)]
  engine_util.AssertTransparent(actual, [loss.numpy()] + grads + updated)


@pytest.fixture(scope='module')
def loopback_cluster():
  """Two server processes, started once for this module, killed at its end."""
  with loopback.LoopbackCluster(2) as cluster:
    yield cluster


@pytest.mark.slow
def testClusterStartsOnNewPortsWhenAPortIsTaken(monkeypatch):
  """A port taken after it was found free: the servers start on other ports.

  Another process listening there must not pass for the server (a
  connection to the port would succeed).
  """
  taken = socket.socket()
  taken.bind(('127.0.0.1', 0))
  taken.listen()
  port = taken.getsockname()[1]
  proposals = [[port, loopback.FreePorts(1)[0]]]
  real = loopback.FreePorts
  monkeypatch.setattr(
      loopback, 'FreePorts',
      lambda count: proposals.pop() if proposals else real(count))
  try:
    with loopback.LoopbackCluster(2) as cluster:
      assert not proposals  # The taken port was tried first.
      assert f'127.0.0.1:{port}' not in cluster.addresses
      with tf.Graph().as_default():
        with tf.device(cluster.Device(1)):
          two = tf.constant(1.0) + 1.0
        with tf.compat.v1.Session(cluster.target) as sess:
          assert sess.run(two) == 2.0
  finally:
    taken.close()


@pytest.fixture
def servers(loopback_cluster):
  """The two servers, without the variables of an earlier test."""
  tf.compat.v1.Session.reset(loopback_cluster.target)
  return loopback_cluster


def _ClusterSession(cluster, graph):
  """A session on `cluster` whose every call fails after TIMEOUT_S."""
  return tf.compat.v1.Session(
      cluster.target, graph=graph,
      config=tf.compat.v1.ConfigProto(operation_timeout_in_ms=TIMEOUT_S * 1000))


def _TrainGraph(devices, engine='unrolled'):
  """One momentum step of 4 FC cells in a TF1 graph.

  Args:
    devices: The 2 stage devices of a K = 2, M = 2 pipeline, or None for the
      plain sequential stack on the default device (same variable names).
    engine: The pipeline engine.

  Returns:
    A NestedMap: graph, init, loss, grads, variables, step (the global step),
    train (runs the update, then returns the global step and the variables)
    and saver.
  """
  graph = tf.Graph()
  with graph.as_default():
    step = py_utils.GetOrCreateGlobalStepVar()
    if devices is None:
      layer = test_util.Reference(test_util.FCCells())
    else:
      layer = _Pipe(2, num_micro_batches=2, devices=devices, engine=engine)
    loss = _Loss(layer, tf.constant(X), X.shape[0])
    variables = layer.vars.Flatten()
    grads = tf.gradients(loss, variables)
    update = tf.compat.v1.train.MomentumOptimizer(
        LEARNING_RATE, MOMENTUM).apply_gradients(
            zip(grads, variables), global_step=step)
    with tf.control_dependencies([update]):
      train = [tf.identity(step)] + [tf.identity(v) for v in variables]
    return py_utils.NestedMap(
        graph=graph, init=tf.compat.v1.global_variables_initializer(),
        loss=loss, grads=grads, variables=variables, step=step,
        train=train, saver=tf.compat.v1.train.Saver())


@pytest.mark.slow
def testStagesInTwoProcessesEqualOneProcess(servers, tmp_path, engine):
  """Stage k on task k; loss, gradients and update equal a local plain run."""
  path = str(tmp_path / 'init')
  with engine_util.ObservableLoops(engine):
    piped = _TrainGraph([servers.Device(0), servers.Device(1)], engine)
  with _ClusterSession(servers, piped.graph) as sess:
    sess.run(piped.init)
    piped.saver.save(sess, path)
    metadata = tf.compat.v1.RunMetadata()
    actual = sess.run([piped.loss] + piped.grads,
                      options=tf.compat.v1.RunOptions(
                          trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                      run_metadata=metadata)
    actual += sess.run(piped.train)
  expected_runs = {}
  for cell in range(4):
    device = servers.Device(cell // 2)
    expected_runs[(cell, device, False)] = 4  # 2 forwards, 2 recomputes.
    expected_runs[(cell, device, True)] = 2  # 2 weight gradients.
  assert dict(test_util.FCKernelRuns(metadata.step_stats)) == expected_runs

  plain = _TrainGraph(None)
  with tf.compat.v1.Session(graph=plain.graph) as sess:
    plain.saver.restore(sess, path)
    expected = sess.run([plain.loss] + plain.grads) + sess.run(plain.train)
  engine_util.AssertTransparent(actual, expected)


def _ZeroBubbleGraph(devices, executor):
  """A K = 2, M = 4 'zb1p' step of engine_util's dense chunks (the last with
  the loss) in a graph, on `devices`: (graph, [loss, gradients])."""
  graph = tf.Graph()
  with graph.as_default():
    weights = [tf.constant(w) for w in engine_util.DENSE_WEIGHTS]
    x = tf.constant(engine_util.DENSE_X)
    if devices is None:
      (loss,), _ = engine_util.TanhLossChunk(weights, [x], (), None)
    else:
      pipe = pipeline.Pipeline(
          [engine_util.TanhChunk, engine_util.TanhLossChunk], devices, 4,
          remat='never', engine='loop', schedule='zb1p', executor=executor)
      (loss,), _ = pipe([weights[:2], weights[2:]], [x], [(), ()])
  with graph.as_default():
    return graph, [loss] + tf.gradients(loss, weights)


@pytest.mark.slow
def testPerDeviceLoopsAcrossProcessesNeedTheIncarnations(servers):
  """Functional per-device loops on two tasks pass tensors over Send/Recv
  (relayed), whose keys must name the sending device's incarnation: with
  `channel.DeviceIncarnations` they run and equal one process; without,
  'per_device' says why and 'auto' runs lockstep loops."""
  devices = [servers.Device(0), servers.Device(1)]
  expected_graph, expected = _ZeroBubbleGraph(None, 'auto')
  with tf.compat.v1.Session(graph=expected_graph) as sess:
    expected = sess.run(expected)
  with tf.compat.v1.Session(servers.target) as probe:
    incarnations = probe.list_devices()
  with channel.DeviceIncarnations(incarnations):
    graph, fetches = _ZeroBubbleGraph(devices, 'per_device')
  # Each direction of the edge between the tasks is relayed: a loop on the
  # receiving task receives ahead into a queue there.
  relays = [op for op in graph.get_operations() if op.type == 'FIFOQueueV2']
  assert sorted((op.name.rsplit('/', 1)[-1], op.device) for op in relays) == [
      ('edge1_data_relay', devices[1]), ('edge1_grad_relay', devices[0])]
  with _ClusterSession(servers, graph) as sess:
    for _ in range(2):  # The queues are empty again after each step.
      engine_util.AssertTransparent(sess.run(fetches), expected)
  with pytest.raises(ValueError, match=r"executor='per_device' cannot run "
                     r'this step: its devices are in several processes, and '
                     r'the incarnations of .*task:0/device:CPU:0'):
    _ZeroBubbleGraph(devices, 'per_device')
  graph, fetches = _ZeroBubbleGraph(devices, 'auto')
  with _ClusterSession(servers, graph) as sess:
    engine_util.AssertTransparent(sess.run(fetches), expected)


class _Background:
  """Runs fn() in a daemon thread and keeps the exception it raises."""

  def __init__(self, fn):
    self.error = None
    self._thread = threading.Thread(target=self._Run, args=(fn,), daemon=True)
    self._thread.start()

  def _Run(self, fn):
    try:
      fn()
    except Exception as e:  # pylint: disable=broad-except
      self.error = e

  @property
  def running(self):
    return self._thread.is_alive()

  def Join(self, seconds):
    """Whether fn() finished within `seconds`."""
    self._thread.join(seconds)
    return not self.running


@pytest.mark.slow
def testKilledWorkerFailsTheStepAndCheckpointRecovers(servers, tmp_path):
  """Kill task 1 while steps run; restart it; restore; training continues."""
  piped = _TrainGraph([servers.Device(0), servers.Device(1)])
  history = {}  # Global step -> the variables after it.

  def Train(sess, num_steps):
    for _ in range(num_steps):
      step, *values = sess.run(piped.train)
      history[step] = values

  saved_step = 3
  sess = _ClusterSession(servers, piped.graph)
  sess.run(piped.init)
  Train(sess, saved_step)
  with piped.graph.as_default():
    checkpoint = piped.saver.save(sess, str(tmp_path / 'ckpt'),
                                  global_step=saved_step)

  # Steps run back to back (until an error stops them) while task 1, which
  # runs stage 1, is killed.
  training = _Background(lambda: Train(sess, 10**9))
  while saved_step + 2 not in history and training.running:
    time.sleep(0.01)
  assert saved_step + 2 in history, training.error
  later = {s: history[s] for s in (saved_step + 1, saved_step + 2)}
  servers.Kill(1)
  assert training.Join(TIMEOUT_S + 10), 'the step hung after the kill'
  assert isinstance(training.error, _WORKER_ERRORS), repr(training.error)

  # Task 1 comes back on the same port; a new session restores and goes on.
  servers.Restart(1)
  assert _Background(sess.close).Join(2 * TIMEOUT_S), 'closing hung'
  with _ClusterSession(servers, piped.graph) as sess:
    assert sess.run(piped.step) > saved_step + 1  # Trained past the save.
    piped.saver.restore(sess, checkpoint)
    step, restored = sess.run([piped.step, piped.variables])
    assert step == saved_step
    for value, saved in zip(restored, history[saved_step]):
      np.testing.assert_array_equal(value, saved)
    Train(sess, 2)
  for s, values in later.items():
    engine_util.AssertTransparent(history[s], values)
