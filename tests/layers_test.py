"""GPipeSequentialLayer: transparency, variable names, structure, errors."""

import logging
import re

import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import cluster_factory
from lingvo.core import py_utils

from lingvo_gpipe import layers as layers_lib
from params import lm
import engine_util
import test_util

RNG = np.random.RandomState(0)
FC_INPUT = RNG.randn(16, 8).astype(np.float32)
CONV_INPUT = RNG.randn(8, 6, 6, 3).astype(np.float32)
TR_VECS = RNG.randn(5, 8, 8).astype(np.float32)  # [time, batch, dim]
TR_PADDINGS = np.zeros([5, 8], np.float32)
TR_PADDINGS[3:, :4] = 1.0
CIRCULAR_INPUT = RNG.randn(32, 8).astype(np.float32)

# (K, M): for each K, fewer micro-batches than stages, as many, and more
# (M = 2 and M = 4 above K run the same schedule shape; one of them is kept).
FC_SHAPES = [(1, 1), (1, 8), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (4, 8)]


@pytest.mark.parametrize('k,m', FC_SHAPES)
def testFCTransparentInGraph(k, m, engine):
  p = test_util.PipeParams(test_util.FCCells(), num_stages=k,
                           num_micro_batches=m, engine=engine)
  pipe, ref, _ = test_util.RunGraph(p, test_util.FCCells, [FC_INPUT])
  engine_util.AssertTransparent(pipe, ref)


@pytest.mark.parametrize('k,m', FC_SHAPES)
def testFCTransparentInFunction(k, m, engine):
  p = test_util.PipeParams(test_util.FCCells(), num_stages=k,
                           num_micro_batches=m, engine=engine)
  pipe, ref = test_util.RunFunction(p, test_util.FCCells, [FC_INPUT])
  engine_util.AssertTransparent(pipe, ref)


def _CircularCells():
  return test_util.FCCells(8)


# (K, v, M): each (K, v) with fewer micro-batches than devices, as many, and
# more, where K allows.
CIRCULAR_GRID = [(1, 2, 1), (1, 2, 4), (1, 4, 2), (1, 4, 8), (2, 2, 1),
                 (2, 2, 2), (2, 2, 4), (2, 4, 2), (2, 4, 8), (4, 2, 1),
                 (4, 2, 4), (4, 2, 8)]


@pytest.mark.parametrize('k,v,m', CIRCULAR_GRID)
def testCircularTransparentInGraph(k, v, m, engine):
  """8 FC cells as K v chunks (K v <= 8), chunk c on device c % K."""
  _CheckCircularInGraph(k, v, m, engine)


@pytest.mark.parametrize('k,v', [(1, 4), (2, 4), (4, 2)])
def testCircularTransparentInGraphManyMicroBatches(k, v):
  """M = 32 on the loop engine, whose graph does not grow with M."""
  _CheckCircularInGraph(k, v, 32, 'loop')


def _CheckCircularInGraph(k, v, m, engine):
  p = test_util.PipeParams(_CircularCells(), num_stages=k, virtual_stages=v,
                           num_micro_batches=m, engine=engine)
  pipe, ref, _ = test_util.RunGraph(p, _CircularCells, [CIRCULAR_INPUT])
  engine_util.AssertTransparent(pipe, ref)


@pytest.mark.parametrize('jit_compile', [False, True])
@pytest.mark.parametrize('engine,remat', engine_util.ENGINE_REMAT_MODES)
def testCircularTransparentInFunction(jit_compile, engine, remat):
  p = test_util.PipeParams(_CircularCells(), num_stages=2, virtual_stages=2,
                           num_micro_batches=4, engine=engine, remat=remat,
                           partition='params')
  pipe, ref = test_util.RunFunction(p, _CircularCells, [CIRCULAR_INPUT],
                                    jit_compile=jit_compile)
  engine_util.AssertTransparent(pipe, ref)


@pytest.mark.parametrize('k,m', [(1, 8), (2, 4), (4, 2), (4, 8)])
def testConvTransparentInGraph(k, m, engine):
  p = test_util.PipeParams(test_util.ConvCells(), num_stages=k,
                           num_micro_batches=m, engine=engine)
  pipe, ref, _ = test_util.RunGraph(p, test_util.ConvCells, [CONV_INPUT, None])
  engine_util.AssertTransparent(pipe, ref)


@pytest.mark.parametrize('function', [False, True])
def testTransformerTransparentBatchDim1(function, engine):
  """Transformer cells, time-major inputs (batch_dim=1) with paddings.

  At K = M = 4 in a TF1 graph and in tf.function (each run builds the Lingvo
  layers twice: about 5 s; the FC grid covers the other K and M).

  Args:
    function: Whether to run in tf.function instead of a graph.
    engine: The pipeline engine.
  """
  p = test_util.PipeParams(test_util.TransformerCells(), num_stages=4,
                           num_micro_batches=4, batch_dim=1, engine=engine)
  inputs = [TR_VECS, TR_PADDINGS]
  if function:
    pipe, ref = test_util.RunFunction(p, test_util.TransformerCells, inputs)
  else:
    pipe, ref, _ = test_util.RunGraph(p, test_util.TransformerCells, inputs)
  engine_util.AssertTransparent(pipe, ref)


@pytest.mark.parametrize('engine,remat,sparse', [('unrolled', 'always', True),
                                                 ('unrolled', 'never', True),
                                                 ('loop', 'always', False)])
def testEmbeddingGradientsAreExactAndSparseInTheUnrolledEngine(engine, remat,
                                                               sparse):
  """An embedding cell's gradient sums over micro-batches, exactly.

  The unrolled engine keeps it sparse (IndexedSlices holding one row per id
  looked up in any micro-batch), so an optimizer updates only those rows; the
  loop engine sums weight gradients densely (engine/loop.py).

  Args:
    engine: The engine.
    remat: The remat mode.
    sparse: Whether the embedding gradient must be IndexedSlices.
  """

  def Cells():
    return lm.CharLmCells(num_layers=1, dim=8, num_heads=2, hidden_dim=8)

  ids = RNG.randint(0, lm.VOCAB_SIZE, size=[5, 8]).astype(np.int32)
  p = test_util.PipeParams(Cells(), num_stages=3, num_micro_batches=4,
                           batch_dim=1, remat=remat, engine=engine)
  pipe, ref, sparse_grads = test_util.RunGraph(p, Cells, [ids, TR_PADDINGS])
  engine_util.AssertTransparent(pipe, ref)
  if not sparse:
    assert not sparse_grads
    return
  ((name, indices),) = sparse_grads.items()
  assert name.startswith('pipe/embedding/emb/'), name
  np.testing.assert_array_equal(np.sort(indices), np.sort(ids.ravel()))


@pytest.mark.parametrize('k,m', [(1, 1), (2, 4), (4, 8)])
def testXla(k, m, engine):
  p = test_util.PipeParams(test_util.FCCells(), num_stages=k,
                           num_micro_batches=m, engine=engine)
  pipe, ref = test_util.RunFunction(
      p, test_util.FCCells, [FC_INPUT], jit_compile=True)
  engine_util.AssertTransparent(pipe, ref)


class CountingAccumulator(base_layer.Accumulator):

  def DefaultValue(self):
    return tf.constant(0.0)

  def Update(self, value):
    self.SetValue(self.GetValue() + value)


class CountingCell(base_layer.BaseLayer):
  """x * w; counts its FProp calls in an accumulator (as Lingvo's test)."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('w', py_utils.WeightParams(
        shape=[], init=py_utils.WeightInit.Constant(1.5)))
    self.RegisterAccumulator('calls', CountingAccumulator())

  def FProp(self, theta, x):
    self.accumulators.calls.Update(1.0)
    return x * theta.w


class NestedCell(base_layer.BaseLayer):
  """Takes and returns a NestedMap; the first cell adds a field."""

  def FProp(self, theta, inputs):
    out = inputs.DeepCopy()
    out.x = tf.tanh(inputs.x) * 2.0
    out.count = inputs.get('count', tf.zeros_like(inputs.x[:, :1])) + 1.0
    return out


@pytest.mark.parametrize('engine,remat', engine_util.ENGINE_REMAT_MODES)
def testAccumulatorsSeeEachMicroBatchOnce(engine, remat):
  cells = [CountingCell.Params().Set(name=f'c{i}') for i in range(4)]
  p = test_util.PipeParams(cells, num_stages=2, num_micro_batches=4,
                           remat=remat, engine=engine)
  graph = tf.Graph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = p.Instantiate()
    y = pipe.FProp(pipe.theta, tf.ones([8, 2]))
    grads = tf.gradients(tf.reduce_sum(y), pipe.vars.Flatten())
    counts = [c.accumulators.calls.GetValue() for c in pipe.children.values()]
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      counts, grads = sess.run([counts, grads])
  assert counts == [4.0] * 4
  np.testing.assert_allclose(grads, [16 * 1.5**3] * 4, rtol=1e-6)


def testNestedMapFPropAndNoneFields(engine):
  cells = [NestedCell.Params().Set(name=f'n{i}') for i in range(3)]
  p = test_util.PipeParams(cells, num_stages=3, num_micro_batches=2,
                           nested_map_fprop=True, engine=engine)
  pipe = p.Instantiate()
  x = tf.constant(FC_INPUT[:4])
  out = pipe.FProp(pipe.theta, py_utils.NestedMap(x=x, mask=None))
  assert sorted(out.keys()) == ['count', 'mask', 'x'] and out.mask is None
  expected = x
  for _ in range(3):
    expected = tf.tanh(expected) * 2.0
  np.testing.assert_allclose(out.x.numpy(), expected.numpy(), rtol=1e-6)
  np.testing.assert_array_equal(out.count.numpy(), np.full([4, 1], 3.0))


def _VariableNames(p):
  with tf.Graph().as_default():
    return sorted(v.name for v in p.Instantiate().vars.Flatten())


def testVariableNamesDoNotDependOnPipelineShape():
  expected = _VariableNames(
      test_util.builder_layers.SequentialLayer.Params().Set(
          name='pipe', sub=test_util.TransformerCells()))
  assert len(expected) > 10
  for kwargs in [dict(num_stages=1), dict(num_stages=2, num_micro_batches=4),
                 dict(num_stages=4, devices=engine_util.CPUS, remat='never'),
                 dict(partition=[1, 3])]:
    p = test_util.PipeParams(test_util.TransformerCells(), **kwargs)
    assert _VariableNames(p) == expected, kwargs


def testEvalUsesTheSameStagesWithoutRecompute(engine):
  p = test_util.PipeParams(test_util.FCCells(), num_stages=2,
                           num_micro_batches=4, engine=engine)
  graph = tf.Graph()
  with graph.as_default(), cluster_factory.SetEval(True):
    pipe = p.Instantiate()
    ref = test_util.Reference(test_util.FCCells())
    x = tf.constant(FC_INPUT)
    y, y_ref = pipe.FProp(pipe.theta, x), ref.FProp(pipe.theta, x)
    assert not [op for op in graph.get_operations() if op.type == 'IdentityN']
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      y, y_ref = sess.run([y, y_ref])
  engine_util.AssertTransparent([y], [y_ref])


class BatchRecordingCell(base_layer.BaseLayer):
  """The identity; records the static batch size of every trace."""

  def __init__(self, params):
    super().__init__(params)
    self.batch_sizes = []

  def FProp(self, theta, x):
    self.batch_sizes.append(x.shape[0])
    return x


@pytest.mark.parametrize('do_eval,k,micro_batch', [(True, 1, 16),
                                                   (True, 2, 4),
                                                   (False, 1, 4)])
def testEvalAtOneStageDoesNotSplitTheBatch(do_eval, k, micro_batch, engine):
  """Eval at K = 1 runs the cells on the whole batch, not on M pieces.

  Without a backward pass one stage has nothing to overlap; with K = 2 (or in
  training) the cells see micro-batches of 16 / M = 4.

  Args:
    do_eval: Whether the layer is built for eval.
    k: K.
    micro_batch: The batch size the cells must see.
    engine: The pipeline engine.
  """
  cells = [BatchRecordingCell.Params().Set(name=f'c{i}') for i in range(2)]
  p = test_util.PipeParams(cells, num_stages=k, num_micro_batches=4,
                           engine=engine)
  with tf.Graph().as_default(), cluster_factory.SetEval(do_eval):
    py_utils.GetOrCreateGlobalStepVar()
    pipe = p.Instantiate()
    y = pipe.FProp(pipe.theta, tf.constant(FC_INPUT))
    with tf.compat.v1.Session(config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      np.testing.assert_array_equal(sess.run(y), FC_INPUT)
  for cell in pipe.children.values():
    assert cell.batch_sizes and set(cell.batch_sizes) == {micro_batch}


@pytest.mark.parametrize('partition,num_stages,logged_at_init', [
    ('uniform', 2, True), ('params', 2, True), ([1, 3], None, True),
    ('flops', 2, False), ('profile', 2, False)])
def testPartitionPlanIsLoggedOnce(partition, num_stages, logged_at_init,
                                  caplog):
  """One INFO record with every stage's cells, whenever the plan is known.

  At construction, or at the first FProp for costs that need shapes; a second
  FProp logs nothing more.

  Args:
    partition: The partition parameter.
    num_stages: K.
    logged_at_init: Whether the plan is known at construction.
    caplog: pytest's log capture.
  """

  def Plans():
    return [r.getMessage() for r in caplog.records
            if r.pathname == layers_lib.__file__ and
            r.getMessage().startswith('pipe: partition=')]

  p = test_util.PipeParams(test_util.FCCells(), num_stages=num_stages,
                           partition=partition, num_micro_batches=2)
  with tf.Graph().as_default(), caplog.at_level(logging.INFO):
    py_utils.GetOrCreateGlobalStepVar()
    pipe = p.Instantiate()
    assert len(Plans()) == int(logged_at_init)
    for _ in range(2):
      pipe.FProp(pipe.theta, tf.constant(FC_INPUT))
  (plan,) = Plans()
  assert plan.startswith(f'pipe: partition={partition!r}\n4 cells, 2 stages')
  assert f'Partition {pipe.partition}:' in plan
  # The plan's rows (Lingvo's heuristic follows): stage, first cell.
  stage_rows = re.findall(r'^ +([01]) +(fc\d)\b', plan, re.MULTILINE)[:2]
  assert stage_rows == [('0', 'fc0'), ('1', f'fc{pipe.partition[0]}')], plan


@pytest.mark.parametrize('kwargs,message', [
    (dict(cell_tpl=[]), 'cell_tpl is empty'),
    (dict(cell_tpl=test_util.FCCells(2) + test_util.FCCells(1)),
     r"^cell_tpl: the cell names \['fc0', 'fc1', 'fc0'\] must be unique"
     r".*repeated: \['fc0'\]"),
    (dict(num_stages=5), r'num_stages=5 must be an int in \[1, 4\]'),
    (dict(num_stages=0), r'num_stages=0 must be an int in \[1, 4\]'),
    (dict(partition=[1, 2]), r'partition=\[1, 2\] sums to 3 but there are 4'),
    (dict(partition=[4, 0]), r'partition=\[4, 0\] must be a non-empty list of '
     'positive ints'),
    (dict(partition=[2, 2], num_stages=3), r'partition=\[2, 2\] has 2 '
     'entries but num_stages=3 and virtual_stages=1 make 3 chunks'),
    (dict(partition='magic'), "partition='magic' is not supported"),
    (dict(remat='sometimes'), "remat='sometimes' is not supported; use one of"),
    (dict(num_stages=2, devices=['/cpu:0']),
     r"devices=\['/cpu:0'\] must be a list of 2 device strings"),
    (dict(num_micro_batches=0), 'num_micro_batches=0 must be a positive int'),
    (dict(virtual_stages=0), 'virtual_stages=0 must be a positive int'),
    (dict(num_stages=2, virtual_stages=3), 'virtual_stages=3 with '
     r'num_stages=2 needs 6 chunks .* there are 4 cells; use virtual_stages '
     '<= 2'),
    (dict(num_stages=None, virtual_stages=3), r'virtual_stages=3 with '
     r'num_stages=None \(one chunk per cell\) needs a multiple of 3 cells'),
    (dict(partition=[1, 1, 2], virtual_stages=2), r'partition=\[1, 1, 2\] '
     'has 3 chunks, not a multiple of virtual_stages=2'),
    (dict(partition=[1, 1, 1, 1], num_stages=1, virtual_stages=2),
     'has 4 entries but num_stages=1 and virtual_stages=2 make 2 chunks'),
    (dict(schedule='zigzag'), "schedule='zigzag' is not supported; use one "
     r"of \['gpipe'"),
    (dict(engine='fast'), "engine='fast' is not supported; use one of "
     r"\['auto', 'unrolled', 'loop'\]"),
    (dict(engine='unrolled', schedule='1f1b'),
     "schedule='1f1b' is not supported with engine='unrolled'"),
    (dict(num_stages=2, virtual_stages=2, schedule='1f1b',
          num_micro_batches=3), 'num_micro_batches=3 with '
     "schedule='1f1b' and virtual_stages=2 must be a multiple of "
     'num_stages=2'),
    (dict(num_stages=2, schedule='zbv'), "virtual_stages=1 is not "
     "supported with schedule='zbv'"),
    (dict(num_stages=2, virtual_stages=2, schedule='zb1p'),
     "virtual_stages=2 is not supported with schedule='zb1p'"),
    (dict(engine='unrolled', schedule='zb1p'),
     "schedule='zb1p' is not supported with engine='unrolled'"),
    (dict(cell_tpl=test_util.FCCells(1) + [
        test_util.layers.FCLayer.Params().Set(name='', input_dim=8,
                                              output_dim=8)]),
     r"^cell_tpl: the cell names \['fc0', ''\] must be unique and "
     r"non-empty; repeated: \[\]"),
    # A string of K characters must not pass as K devices.
    (dict(num_stages=4, devices='/gpu'),
     "devices='/gpu' must be a list of 4 device strings"),
    (dict(num_stages=2, devices=[0, 1]),
     r'devices=\[0, 1\] must be a list of 2 device strings'),
    (dict(micro_batch_size=0), 'micro_batch_size=0 must be a positive int'),
    (dict(micro_batch_size=-4), 'micro_batch_size=-4 must be a positive int'),
    (dict(batch_dim=-1), 'batch_dim=-1 must be an int >= 0'),
])
def testBadParamsFailBeforeAnyVariable(kwargs, message):
  p = test_util.PipeParams(test_util.FCCells()).Set(**kwargs)
  graph = tf.Graph()
  with graph.as_default():
    with pytest.raises(ValueError, match=message):
      p.Instantiate()
    assert not graph.get_operations()


class CapturingCell(base_layer.BaseLayer):
  """x * w, reading w from its variables instead of theta (a bug)."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('w', py_utils.WeightParams(
        shape=[], init=py_utils.WeightInit.Constant(1.5)))

  def FProp(self, theta, x):
    return x * self.vars.w


class ChangingOutputsCell(base_layer.BaseLayer):
  """Returns (x, None) when first traced, (x, x) afterwards (a bug)."""

  def __init__(self, params):
    super().__init__(params)
    self._traces = 0

  def FProp(self, theta, x):
    self._traces += 1
    return (x, None) if self._traces == 1 else (x, x)


class LateAccumulatorCell(base_layer.BaseLayer):
  """Registers an accumulator in FProp instead of __init__ (a bug)."""

  def FProp(self, theta, x):
    if 'calls' not in self.accumulators:
      self.RegisterAccumulator('calls', CountingAccumulator())
    self.accumulators.calls.Update(1.0)
    return x


def _NestedCells():
  return [NestedCell.Params().Set(name=f'n{i}') for i in range(3)]


def _OneCell(cls):
  return lambda: [cls.Params().Set(name='c0')]


def _Placeholder(shape):
  return lambda: [tf.compat.v1.placeholder(tf.float32, shape)]


def _NestedInputs(*num_maps):
  return lambda: [py_utils.NestedMap(x=tf.zeros([4, 8]))] * num_maps[0]


# (cells, params, inputs, message) of FProp calls that fail. The inputs are
# made in the test's graph; placeholders have dynamic shapes.
_BAD_FPROPS = {
    'nested_map_flops': (
        _NestedCells, dict(nested_map_fprop=True, partition='flops'),
        _NestedInputs(1), "partition='flops' does not support "
        'nested_map_fprop=True'),
    'nested_map_profile': (
        _NestedCells, dict(nested_map_fprop=True, partition='profile'),
        _NestedInputs(1), "partition='profile' does not support "
        'nested_map_fprop=True'),
    'nested_map_two_args': (
        _NestedCells, dict(nested_map_fprop=True), _NestedInputs(2),
        'nested_map_fprop=True: FProp takes one NestedMap'),
    'nested_map_tensor': (
        _NestedCells, dict(nested_map_fprop=True), lambda: [tf.zeros([4, 8])],
        'nested_map_fprop=True: FProp takes one NestedMap'),
    'flops_dynamic_batch': (
        test_util.FCCells, dict(num_stages=2, partition='flops'),
        _Placeholder([None, 8]),
        r"partition='flops' needs static input shapes, got \(None, 8\)"),
    'profile_dynamic_dim': (
        test_util.FCCells, dict(num_stages=2, partition='profile'),
        _Placeholder([16, None]),
        r"partition='profile' needs static input shapes, got \(16, None\)"),
    'flops_unknown_rank': (
        test_util.FCCells, dict(num_stages=2, partition='flops'),
        _Placeholder(None),
        "partition='flops' needs static input shapes, got <unknown>"),
    'flops_rejected_shape': (
        test_util.FCCells, dict(num_stages=2, partition='flops'),
        lambda: [tf.zeros([16, 5])],
        r"partition='flops': .*'fc0'.* rejects input shapes \(\[16, 5\]\)"),
    'micro_batch_size_dynamic_batch': (
        test_util.FCCells, dict(micro_batch_size=4), _Placeholder([None, 8]),
        'micro_batch_size=4 needs a static batch size; the inputs have none'),
    'batch_dim_beyond_rank': (
        test_util.FCCells, dict(batch_dim=2), lambda: [tf.zeros([16, 8])],
        r'batch_dim=2 but input 0 has shape \(16, 8\); batch_dim must be in '
        r'\[0, 1\]'),
    'batch_sizes_disagree': (
        test_util.TransformerCells, dict(batch_dim=1),
        lambda: [tf.constant(TR_VECS), tf.zeros([5, 4])],
        r'Inputs disagree on the batch size along batch_dim=1: \[4, 8\]'),
    'weight_not_in_theta': (
        _OneCell(CapturingCell), dict(num_micro_batches=2),
        lambda: [tf.ones([4, 1])],
        r"stage 0 reads trainable variables \['pipe/c0/w/var:0'\] that are "
        'not passed in its theta'),
    'outputs_change_between_traces': (
        _OneCell(ChangingOutputsCell), dict(num_micro_batches=2),
        lambda: [tf.ones([4, 1])],
        r'stage 0: outputs changed from one trace to the next: \(True, False\)'
        r' vs \(True, True\)'),
    'accumulator_registered_in_fprop': (
        _OneCell(LateAccumulatorCell), dict(num_micro_batches=2),
        lambda: [tf.ones([4, 1])],
        'stage 0: the stage function returned a state with 1 tensors, '
        'expected 0'),
}


@pytest.mark.parametrize('name', sorted(_BAD_FPROPS))
def testBadInputsFailNamingTheParameter(name):
  """FProp (or, for what only a recompute sees, its gradient) raises.

  Args:
    name: A key of _BAD_FPROPS.
  """
  cells, kwargs, inputs, message = _BAD_FPROPS[name]
  with tf.Graph().as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = test_util.PipeParams(cells(), **kwargs).Instantiate()
    xs = inputs()
    with pytest.raises(ValueError, match=message):
      outputs = tf.nest.flatten(pipe.FProp(pipe.theta, *xs))
      tf.gradients(outputs[0], tf.nest.flatten(xs))


@pytest.mark.parametrize('kwargs,batch,message', [
    (dict(num_micro_batches=3), 16, r'num_micro_batches=3 does not divide the '
     r'batch size 16; valid values are \[1, 2, 4, 8, 16\]'),
    (dict(num_micro_batches=32), 16, 'num_micro_batches=32 is larger than the '
     'batch size 16'),
    (dict(micro_batch_size=5), 16, 'micro_batch_size=5 does not divide the '
     'batch size 16'),
    (dict(micro_batch_size=2, num_micro_batches=4), 16, 'num_micro_batches=4 '
     'and micro_batch_size=2 are both set, but their product is not the '
     'batch size 16'),
])
def testBadBatchFailsBeforeBuildingThePipeline(kwargs, batch, message,
                                               engine):
  graph = tf.Graph()
  with graph.as_default():
    pipe = test_util.PipeParams(test_util.FCCells(), engine=engine,
                                **kwargs).Instantiate()
    x = tf.zeros([batch, 8])
    num_ops = len(graph.get_operations())
    with pytest.raises(ValueError, match=message):
      pipe.FProp(pipe.theta, x)
    assert len(graph.get_operations()) == num_ops


def testMicroBatchSizeSetsM():
  pipe = test_util.PipeParams(test_util.FCCells(), num_stages=2,
                              micro_batch_size=4).Instantiate()
  assert pipe.NumMicroBatches(16) == 4
  assert pipe.BubbleFraction(16) == pytest.approx(1 / 5)
  # Both, as Lingvo's PipeliningLayer accepts them: their product is the batch.
  pipe = test_util.PipeParams(test_util.FCCells(), num_stages=2,
                              num_micro_batches=8,
                              micro_batch_size=2).Instantiate()
  assert pipe.NumMicroBatches(16) == 8


def _UnevenFCCells():
  dims = [8, 8, 64, 64, 8]
  return [
      test_util.layers.FCLayer.Params().Set(
          name=f'fc{i}', input_dim=dims[i], output_dim=dims[i + 1])
      for i in range(4)
  ]


@pytest.mark.parametrize('method,expected', [('params', [2, 1, 1]),
                                             ('flops', [2, 1, 1]),
                                             ('profile', None)])
def testCostBasedPartitionIsOptimalAndTransparent(method, expected):
  p = test_util.PipeParams(_UnevenFCCells(), num_stages=3, partition=method,
                           num_micro_batches=2)
  pipe, ref, _ = test_util.RunGraph(p, _UnevenFCCells, [FC_INPUT])
  engine_util.AssertTransparent(pipe, ref)
  with tf.Graph().as_default():
    layer = p.Instantiate()
    if method != 'params':
      assert layer.partition is None  # Decided at the first FProp.
      layer.FProp(layer.theta, tf.constant(FC_INPUT))
    assert sum(layer.partition) == 4 and len(layer.partition) == 3
    if expected:
      assert layer.partition == expected


def testFlopsPartitionNamesTheCellWithoutFPropMeta():
  p = test_util.PipeParams(test_util.TransformerCells(), num_stages=2,
                           partition='flops', batch_dim=1)
  with tf.Graph().as_default():
    layer = p.Instantiate()
    with pytest.raises(ValueError, match="cell 'tr0'.*FPropMeta"):
      layer.FProp(layer.theta, tf.constant(TR_VECS), tf.constant(TR_PADDINGS))


def testCheckpointRestoresAcrossPipelineShapes(tmp_path):
  """Saved with K=4, restored into K=2, K=1 and the plain stack: same outputs."""
  path = str(tmp_path / 'ckpt')
  x = FC_INPUT
  outputs = {}
  for shape in ['k4', 'k2', 'k1', 'plain']:
    graph = tf.Graph()
    with graph.as_default():
      if shape == 'plain':
        layer = test_util.builder_layers.SequentialLayer.Params().Set(
            name='pipe', sub=test_util.FCCells()).Instantiate()
      else:
        k = int(shape[1])
        layer = test_util.PipeParams(test_util.FCCells(), num_stages=k,
                                     num_micro_batches=k).Instantiate()
      y = layer.FProp(layer.theta, tf.constant(x))
      saver = tf.compat.v1.train.Saver()
      with tf.compat.v1.Session(graph=graph,
                                config=engine_util.SessionConfig()) as sess:
        if shape == 'k4':
          sess.run(tf.compat.v1.global_variables_initializer())
          saver.save(sess, path)
        else:
          saver.restore(sess, path)
        outputs[shape] = sess.run(y)
  for shape in ['k2', 'k1', 'plain']:
    engine_util.AssertTransparent([outputs[shape]], [outputs['k4']])
