"""engine/call.py: the pipelined call every front end makes, on plain TF."""

import logging

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.engine import call as call_lib
from lingvo_gpipe.planning import config
import engine_util

NAMES = ['fc0', 'fc1', 'fc2', 'fc3']
RNG = np.random.RandomState(2)
WEIGHTS = [RNG.randn(6, 6).astype(np.float32) * 0.5 for _ in NAMES]
X = RNG.randn(8, 6).astype(np.float32)
TPU_CORES = ['/device:TPU_REPLICATED_CORE:0', '/device:TPU_REPLICATED_CORE:1']


def _Call(plans=None, partition='uniform', num_stages=2, num_micro_batches=1,
          micro_batch_size=None, engine='auto', schedule='gpipe'):
  """A PipelinedCall of the four cells; its plans are appended to `plans`."""
  shape = config.CheckShape(
      NAMES, num_stages, partition=partition,
      num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size,
      engine=engine, schedule_name=schedule)
  log = {} if plans is None else {'log_plan': plans.append}
  return call_lib.PipelinedCall(
      'pipe', NAMES, shape, partition=partition,
      num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size,
      batch_dim=0, remat='always', engine=engine, schedule=schedule,
      memory=lambda: [4.0] * len(NAMES), **log)


def _Counted(values, calls):
  """A function that records its call in `calls` and returns `values`."""

  def Figures(*args):
    calls.append(args)
    return values

  return Figures


def testParamsPartitionIsDecidedAndLoggedAtPlan():
  plans, calls = [], []
  call = _Call(plans, partition='params')
  assert call.partition is None
  call.Plan(_Counted([1.0, 1.0, 1.0, 3.0], calls))
  assert call.partition == [3, 1] and len(calls) == 1
  (plan,) = plans
  assert plan.startswith("pipe: partition='params'\n4 cells, 2 stages")
  assert 'Partition [3, 1]:' in plan
  assert 'largest stage memory: 12' in plan  # 3 cells of 4 bytes.


@pytest.mark.parametrize('partition,counts', [('uniform', [2, 2]),
                                              ([1, 3], [1, 3])])
def testGivenPartitionIsLoggedAtPlan(partition, counts):
  plans = []
  call = _Call(plans, partition=partition)
  call.Plan(lambda: [1.0] * 4)
  assert call.partition == counts
  (plan,) = plans
  assert plan.startswith(f'pipe: partition={partition!r}\n')
  assert f'Partition {counts}:' in plan


def testCostPartitionWaitsForTheFirstCall():
  """'profile' asks for costs once, with M, at the first Prepare."""
  plans, param_calls, micro_calls = [], [], []
  call = _Call(plans, partition='profile', num_micro_batches=4)
  call.Plan(_Counted([1.0] * 4, param_calls))
  assert not plans and not param_calls and call.partition is None
  costs = _Counted([3.0, 1.0, 1.0, 1.0], micro_calls)
  for _ in range(2):
    assert call.Prepare([tf.constant(X), None], True, costs) == 4
  assert micro_calls == [(4,)]
  assert call.partition == [1, 3]
  (plan,) = plans
  assert plan.startswith("pipe: partition='profile'\n")


def testOneChunkNeedsNoCosts():
  plans = []
  call = _Call(plans, partition='flops', num_stages=1)
  call.Plan(lambda: pytest.fail('no plan before the first call'))
  assert call.Prepare([tf.constant(X)], True) == 1
  assert call.partition == [4] and not plans


def testThePlanGoesToAbslByDefault(caplog):
  with caplog.at_level(logging.INFO):
    _Call().Plan(lambda: [1.0] * 4)
  assert any(r.getMessage().startswith("pipe: partition='uniform'\n4 cells")
             for r in caplog.records)


@pytest.mark.parametrize('num_stages,training,expected', [
    (1, True, 4), (1, False, 1), (2, True, 4), (2, False, 4)])
def testEvalOnOneStageRunsOneMicroBatch(num_stages, training, expected):
  call = _Call(num_stages=num_stages, num_micro_batches=4)
  assert call.Prepare([tf.constant(X)], training) == expected


def testMicroBatchesFromTheBatch():
  assert _Call(micro_batch_size=2).Prepare([tf.constant(X)], True) == 4
  assert _Call(num_micro_batches=2).NumMicroBatches(None) == 2
  with pytest.raises(ValueError, match='num_micro_batches=3 does not divide '
                     'the batch size 8'):
    _Call(num_micro_batches=3).Prepare([tf.constant(X)], True)
  with pytest.raises(ValueError, match='micro_batch_size=2 needs a static '
                     'batch size'):
    _Call(micro_batch_size=2).NumMicroBatches(None)


def testEngineFollowsXla():
  """'auto' builds the loop engine when XLA compiles: jit or TPU devices."""
  auto = _Call(num_micro_batches=4)
  unrolled = _Call(num_micro_batches=4, engine='unrolled')
  assert auto.Engine(4, ['', '']) == 'unrolled'
  assert auto.Engine(4, TPU_CORES) == 'loop'
  assert _Call(schedule='1f1b').Engine(4, ['', '']) == 'loop'
  chosen = {}

  @tf.function(jit_compile=True, autograph=False)
  def Jit(x):
    chosen['auto'] = auto.Engine(4, ['', ''])
    chosen['unrolled'] = unrolled.Engine(4, ['', ''])
    return x

  Jit.get_concrete_function(tf.constant(0.0))
  assert chosen == {'auto': 'loop', 'unrolled': 'unrolled'}


def _DenseStage(theta, inputs, state, micro_batch_id):
  """tanh layers; records the micro-batch size in `state`."""
  del micro_batch_id
  (x,) = inputs
  for w in theta:
    x = tf.tanh(tf.matmul(x, w))
  return (x,), state + tf.shape(x)[0]


def _Plain(x, weights):
  for w in weights:
    x = tf.tanh(tf.matmul(x, w))
  return x


@pytest.mark.parametrize('engine', ['unrolled', 'loop'])
@pytest.mark.parametrize('training', [True, False])
def testRunIsTransparent(engine, training):
  """Outputs (and, training, gradients) equal the plain stack's."""
  call = _Call(num_micro_batches=4, engine=engine)
  call.Plan(lambda: [1.0] * 4)

  @tf.function(autograph=False)
  def Step(x, weights):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch([x] + weights)
      num_micro = call.Prepare([x], training)
      (y,), states = call.Run(
          [_DenseStage] * 2, engine_util.CPUS[:2],
          [weights[:2], weights[2:]], [x], [tf.constant(0)] * 2, num_micro,
          training)
      y0 = _Plain(x, weights)
      loss, loss0 = tf.reduce_sum(y * y), tf.reduce_sum(y0 * y0)
    if not training:
      return [y], [y0], states
    grads = tape.gradient(loss, [x] + weights)
    grads0 = tape.gradient(loss0, [x] + weights)
    return [y] + grads, [y0] + grads0, states

  actual, expected, states = Step(tf.constant(X),
                                  [tf.constant(w) for w in WEIGHTS])
  engine_util.AssertTransparent(actual, expected)
  # Each chunk saw the whole batch, in 4 micro-batches.
  assert [int(s) for s in states] == [8, 8]
