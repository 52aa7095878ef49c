"""GPipeSequentialLayer.FromPipeliningLayer and the drop-in PipeliningLayer."""

import collections
import os
import re
from unittest import mock

from absl import logging
import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import cluster_factory
from lingvo.core import gpipe
from lingvo.core import layers
from lingvo.core import layers_with_gpipe
from lingvo.core import py_utils

from lingvo_gpipe import GPipeSequentialLayer
from lingvo_gpipe import from_lingvo
from lingvo_gpipe import stacks
import engine_util

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X = np.random.RandomState(0).randn(8, 4).astype(np.float32)


def _FC(name, seed=None):
  return layers.FCLayer.Params().Set(name=name, input_dim=4, output_dim=4,
                                     random_seed=seed)


def _LingvoPipeline(cls=gpipe.PipeliningLayer, **kwargs):
  """Lingvo cells: 2 FCs (prefixed), 1 FC, and an FC that is a cell itself."""
  cells = [
      gpipe.FeatureExtractionLayer.Params().Set(
          name='c0', sub=[_FC('fc0'), _FC('fc1')], variable_name_prefix='a_',
          random_seed=3),
      gpipe.FeatureExtractionLayer.Params().Set(name='c1', sub=[_FC('fc2')]),
      _FC('fc3'),
  ]
  return cls.Params().Set(name='pipe', cell_tpl=cells, num_micro_batches=2,
                          **kwargs)


def testPipeliningLayerConverts():
  conversion = from_lingvo.Convert(_LingvoPipeline(batch_dim=0),
                                   GPipeSequentialLayer.Params())
  p = conversion.params
  assert p.cls is GPipeSequentialLayer
  assert [c.name for c in p.cell_tpl] == ['a_fc0', 'a_fc1', 'fc2', 'fc3']
  assert (p.name, p.partition, p.num_stages, p.num_micro_batches,
          p.micro_batch_size, p.batch_dim) == ('pipe', [2, 1, 1], 3, 2, None, 0)
  # The cell's base params reach its layers, as Lingvo's CreateChild does.
  assert [c.random_seed for c in p.cell_tpl] == [3, 3, None, None]
  assert conversion.lingvo_scopes == {
      'a_fc0': 'c0/a_fc0', 'a_fc1': 'c0/a_fc1', 'fc2': 'c1/fc2', 'fc3': 'fc3'}
  assert GPipeSequentialLayer.FromPipeliningLayer(
      _LingvoPipeline()).ToText() == p.ToText()


def testStackCellsAreTheOnesItsInitBuilds():
  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
      name='stack', model_dim=4, num_encoder_layers=2, num_decoder_layers=1,
      splits=[1, 3], num_micro_batches=4)
  p.softmax_tpl.Set(input_dim=4, num_classes=6)
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.Set(source_dim=4).tr_atten_tpl.num_attention_heads = 1
  p.emb_tpl.token_emb.Set(vocab_size=6, embedding_dim=4)
  p.emb_tpl.position_emb.embedding_dim = 4
  ours = GPipeSequentialLayer.FromPipeliningLayer(p)
  assert [c.name for c in ours.cell_tpl] == [
      'emb', 'encoder_0', 'encoder_1', 'decoder_0', 'softmax']
  assert (ours.partition, ours.num_micro_batches, ours.batch_dim) == (
      [2, 3], 4, 1)
  # Built by the stack's __init__: deterministic dropout for M > 1.
  assert ours.cell_tpl[0].dropout_tpl.cls is layers.DeterministicDropoutLayer


def testOutputsGradientsAndNamesAgainstLingvo():
  """Ours from FromPipeliningLayer equals Lingvo's PipeliningLayer (K=3)."""
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4)
  graph = tf.Graph()
  with graph.as_default(), cluster:
    py_utils.GetOrCreateGlobalStepVar()
    lingvo = _LingvoPipeline().Instantiate()
    ours = GPipeSequentialLayer.FromPipeliningLayer(
        _LingvoPipeline()).Instantiate()
    # Lingvo creates its cells in its parent's scope, ours under 'pipe'.
    scopes = from_lingvo.Convert(_LingvoPipeline(),
                                 GPipeSequentialLayer.Params()).lingvo_scopes
    lingvo_vars = {v.name: v for v in lingvo.vars.Flatten()}
    ours_vars = ours.vars.Flatten()
    names = []
    for v in ours_vars:
      pipe, layer, rest = v.name.split('/', 2)
      assert pipe == 'pipe'
      names.append(f'{scopes[layer]}/{rest}')
    assert sorted(names) == sorted(lingvo_vars)
    copy = [v.assign(lingvo_vars[n]) for v, n in zip(ours_vars, names)]
    lingvo_vars = [lingvo_vars[n] for n in names]
    fetches = []
    for layer, variables in ((ours, ours_vars), (lingvo, lingvo_vars)):
      y = layer.FProp(layer.theta, tf.constant(X))
      fetches.append([y] + tf.gradients(tf.reduce_sum(y * y), variables))
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(copy)
      actual, expected = sess.run(fetches)
  engine_util.AssertTransparent(actual, expected)


class _AddLayer(base_layer.BaseLayer):
  """x + a: takes a fetched activation as its second input."""

  def FProp(self, theta, x, a):
    del theta
    return x + a

  @classmethod
  def FPropMeta(cls, p, x, a):
    del a
    return py_utils.NestedMap(flops=0, out_shapes=(x,))


def _Fetch(name):
  return layers.FetchLayer.Params().Set(name=name)


def _FetchingPipeline(cls=gpipe.PipeliningLayer, **kwargs):
  """Lingvo cells that fetch two activations, use one and return the other.

  c0 fetches f0 (after fc0); c1 passes f0 on (num_act_inputs=1) and fetches
  f1; c2 passes f1 on and gets f0 as its first layer's second input:
  y = fc3(add(fc2(fc1(fc0(x))), fc0(x))), and FProp returns (y, fc2(...)).

  Args:
    cls: Lingvo's PipeliningLayer or our drop-in.
    **kwargs: More PipeliningLayer params.

  Returns:
    The params.
  """
  fel = gpipe.FeatureExtractionLayer.Params
  cells = [
      fel().Set(name='c0', sub=[_FC('fc0'), _Fetch('f0')],
                act_fetch_layers=['f0'], num_act_outputs=1),
      fel().Set(name='c1', sub=[_FC('fc1'), _FC('fc2'), _Fetch('f1')],
                act_fetch_layers=['f1'], num_act_inputs=1, num_act_outputs=2),
      fel().Set(name='c2', sub=[_AddLayer.Params().Set(name='add'),
                                _FC('fc3')],
                num_act_inputs=1, num_act_outputs=1),
  ]
  return cls.Params().Set(name='pipe', cell_tpl=cells, num_micro_batches=2,
                          **kwargs)


def testFetchedActivationsBecomeSkips():
  p = GPipeSequentialLayer.FromPipeliningLayer(_FetchingPipeline())
  assert [c.name for c in p.cell_tpl] == [
      'fc0', 'f0', 'fc1', 'fc2', 'f1', 'add', 'fc3']
  assert p.partition == [2, 3, 2]
  # f0 goes to c2's first layer (c2 passes on only the last one), f1 out.
  assert p.skips == [('f0', 'add'), ('f1', None)]
  assert [c.cls for c in p.cell_tpl if c.name in ('f0', 'f1')] == [
      from_lingvo.ActivationFetchLayer] * 2


def testFetchedActivationsPassThroughEmptyAndPlainCells():
  p = _FetchingPipeline()
  fel = gpipe.FeatureExtractionLayer.Params
  # An empty cell passes everything on; a plain layer takes it all.
  p.cell_tpl.insert(2, fel().Set(name='e', num_act_inputs=2,
                                 num_act_outputs=2))
  p.cell_tpl.append(_AddLayer.Params().Set(name='plain'))
  with mock.patch.object(logging, 'warning'):
    ours = GPipeSequentialLayer.FromPipeliningLayer(p)
  assert ours.skips == [('f0', 'add'), ('f1', 'plain')]
  assert ours.partition == [2, 3, 2, 1]


def _CheckFetchingAgainstLingvo(ours_params, lingvo_params, num_outputs=2):
  """Outputs and gradients of ours equal Lingvo's PipeliningLayer's.

  Args:
    ours_params: Params of our layer (GPipeSequentialLayer or the drop-in)
      named 'pipe', with Lingvo's layer names.
    lingvo_params: Params of Lingvo's PipeliningLayer.
    num_outputs: How many tensors FProp returns.
  """
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4)
  graph = tf.Graph()
  with graph.as_default(), cluster:
    py_utils.GetOrCreateGlobalStepVar()
    lingvo = lingvo_params.Instantiate()
    ours = ours_params.Instantiate()
    scopes = from_lingvo.Convert(lingvo_params,
                                 GPipeSequentialLayer.Params()).lingvo_scopes
    lingvo_vars = {v.name: v for v in lingvo.vars.Flatten()}
    ours_vars = ours.vars.Flatten()
    names = [f'{scopes[v.name.split("/")[1]]}/{v.name.split("/", 2)[2]}'
             for v in ours_vars]
    assert sorted(names) == sorted(lingvo_vars)
    copy = [v.assign(lingvo_vars[n]) for v, n in zip(ours_vars, names)]
    lingvo_vars = [lingvo_vars[n] for n in names]
    fetches = []
    for layer, variables in ((ours, ours_vars), (lingvo, lingvo_vars)):
      x = tf.constant(X)
      ys = layer.FProp(layer.theta, x)
      ys = list(ys) if isinstance(ys, tuple) else [ys]
      assert len(ys) == num_outputs
      loss = sum(tf.reduce_sum(y * y * (i + 1)) for i, y in enumerate(ys))
      fetches.append(ys + tf.gradients(loss, variables + [x]))
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      sess.run(copy)
      actual, expected = sess.run(fetches)
  engine_util.AssertTransparent(actual, expected)


def testFetchedActivationsAgainstLingvo(engine):
  """The drop-in with act fetch (K=3) equals Lingvo's, outputs and grads."""
  p = _FetchingPipeline(stacks.PipeliningLayer)
  p.pipeline_tpl.engine = engine
  _CheckFetchingAgainstLingvo(p, _FetchingPipeline())


@pytest.mark.parametrize('remat', ['never', 'except_last'])
def testFetchedActivationsAgainstLingvoWithoutRecompute(remat):
  p = GPipeSequentialLayer.FromPipeliningLayer(_FetchingPipeline())
  p.Set(remat=remat, engine='unrolled')
  _CheckFetchingAgainstLingvo(p, _FetchingPipeline())


def testFetchedActivationSkipsTheStagesBetween(engine):
  """K = 4, f0 fetched in c0 and returned: devices 1 and 2 never touch it.

  As in Lingvo's DummyPipelineCnn test, c1..c3 pass the activation on
  (num_act_inputs=1). The fetched tensor is the only one of width 5 outside
  c0; no op placed on CPU:1 or CPU:2 reads or writes one, forward or
  backward (the loop engine's loops lowered so that their ops are graph
  ops). In Lingvo's pipeline it passes through every stage.

  Args:
    engine: The pipeline engine.
  """
  fel = gpipe.FeatureExtractionLayer.Params
  wide = _FC('fc0').Set(output_dim=5)
  cells = [fel().Set(name='c0', sub=[wide, _Fetch('f0'),
                                     _FC('fc0b').Set(input_dim=5)],
                     act_fetch_layers=['f0'], num_act_outputs=1)]
  cells += [fel().Set(name=f'c{k}', sub=[_FC(f'fc{k}')], num_act_inputs=1,
                      num_act_outputs=1) for k in (1, 2, 3)]
  p = stacks.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells,
                                          num_micro_batches=4)
  p.pipeline_tpl.Set(devices=engine_util.CPUS, engine=engine)
  with tf.Graph().as_default() as graph, engine_util.ObservableLoops(engine):
    py_utils.GetOrCreateGlobalStepVar()
    layer = p.Instantiate()
    y, fetched = layer.FProp(layer.theta, tf.constant(X))
    assert fetched.shape.as_list() == [8, 5]
    tf.gradients(tf.reduce_sum(y * y) + tf.reduce_sum(fetched * fetched),
                 layer.vars.Flatten())
  touched = collections.defaultdict(int)
  for op in graph.get_operations():
    for t in list(op.inputs) + list(op.outputs):
      if t.shape.rank == 2 and t.shape[-1] == 5 and t.shape[0] != 4:
        touched[op.device.split(':')[-1]] += 1
  assert touched['0']  # Fetched there; merged where the outputs are.
  assert not touched['1'] and not touched['2'], dict(touched)


class _SplitLayer(base_layer.BaseLayer):
  """x -> (x, 2 x)."""

  def FProp(self, theta, x):
    del theta
    return x, 2 * x


def testMultiTensorFetchRaises():
  p = _FetchingPipeline()
  p.cell_tpl[0].sub = [_FC('fc0'), _Fetch('f0')]
  p.cell_tpl[0].sub.insert(1, _SplitLayer.Params().Set(name='split'))
  with tf.Graph().as_default():
    py_utils.GetOrCreateGlobalStepVar()
    layer = GPipeSequentialLayer.FromPipeliningLayer(p).Instantiate()
    with pytest.raises(ValueError, match=(
        r'a FetchLayer named in act_fetch_layers gets 2 tensors; Lingvo '
        'fetches only the first')):
      layer.FProp(layer.theta, tf.constant(X))


def testMicroBatchSizeAndNumMicroBatchesCarryOver():
  p = GPipeSequentialLayer.FromPipeliningLayer(
      _LingvoPipeline(micro_batch_size=4))
  assert (p.num_micro_batches, p.micro_batch_size) == (2, 4)
  layer_p = _LingvoPipeline(stacks.PipeliningLayer, micro_batch_size=2)
  with tf.Graph().as_default():
    py_utils.GetOrCreateGlobalStepVar()
    layer = layer_p.Instantiate()
    with pytest.raises(ValueError, match=(
        'num_micro_batches=2 and micro_batch_size=2 are both set, but their '
        'product is not the batch size 8')):
      layer.FProp(layer.theta, tf.constant(X))


def testOurPipeliningLayerTakesOurKnobsFromPipelineTpl():
  p = _LingvoPipeline(stacks.PipeliningLayer)
  p.pipeline_tpl.remat = 'never'
  with tf.Graph().as_default():
    layer = p.Instantiate()
  assert layer.pipeline.params.remat == 'never'
  assert layer.pipeline.partition == [2, 1, 1]
  assert layer.variable_scope_name == 'pipe'
  assert sorted(v.name for v in layer.vars.Flatten())[0] == (
      'pipe/a_fc0/b/var:0')


def testEmptyCellIsLeftOutWithAWarning():
  p = _LingvoPipeline()
  p.cell_tpl.insert(1, gpipe.FeatureExtractionLayer.Params().Set(name='e'))
  with mock.patch.object(logging, 'warning') as warning:
    ours = GPipeSequentialLayer.FromPipeliningLayer(p)
  assert ours.partition == [2, 1, 1]
  (message, *args), _ = warning.call_args
  assert message % tuple(args) == (
      "pipe: cell_tpl[1] ('e') has no layers; its stage is left out (3 "
      'stages instead of 4).')


def _SetCell(index, **kwargs):
  def Change(p):
    p.cell_tpl[index].Set(**kwargs)
    return p
  return Change


@pytest.mark.parametrize('change,message', [
    (lambda p: p.Set(before_tpl=[_FC('pre')]),
     r"before_tpl=\['pre'\] is not supported.*before_tpl must be \[\]"),
    (_SetCell(0, num_act_inputs=1, num_act_outputs=1),
     r"cell_tpl\[0\] \('c0'\) has num_act_inputs=1 but only 0 fetched "
     r'activation\(s\) \[\] reach it: it would pass the last pipeline inputs '
     'through untouched'),
    (_SetCell(1, num_act_inputs=1, num_act_outputs=1),
     r"cell_tpl\[1\] \('c1'\) has num_act_inputs=1 but only 0 .* pass "
     'outputs of the layers of the cells before it through'),
    (_SetCell(1, act_fetch_layers=['fc2']),
     r"cell_tpl\[1\] \('c1'\) has num_act_outputs=0, num_act_inputs=0 and "
     r"act_fetch_layers=\['fc2'\]; Lingvo requires num_act_outputs == "
     r'num_act_inputs \+ len\(act_fetch_layers\) = 1'),
    (_SetCell(1, act_fetch_layers=['fc2'], num_act_outputs=1),
     r"act_fetch_layers=\['fc2'\]: 'fc2' is a FCLayer; only "
     'lingvo.core.layers.FetchLayer caches an activation'),
    (_SetCell(1, act_fetch_layers=['fetch'], num_act_outputs=1),
     r"act_fetch_layers=\['fetch'\]: 'fetch' is not one of its layers "
     r"\['fc2'\]"),
    (lambda p: _SetCell(1, act_fetch_layers=['f'], num_act_outputs=1, sub=[
        layers.FetchLayer.Params().Set(name='f')])(p.Set(
            nested_map_fprop=True)),
     r"act_fetch_layers=\['f'\] and num_act_inputs=0 with "
     'nested_map_fprop=True'),
    (_SetCell(1, sub=[_FC('fc0')], variable_name_prefix='a_'),
     r"cell_tpl has two layers named 'a_fc0' \(Lingvo scopes 'c0/a_fc0' and "
     r"'c1/a_fc0'\); GPipeSequentialLayer needs unique layer names"),
    (lambda p: p.Set(cls=layers.FCLayer),
     r'p.cls=.*FCLayer.* is not a Lingvo gpipe.PipeliningLayer'),
])
def testWhatCannotCarryOverRaises(change, message):
  p = _LingvoPipeline()
  change(p)
  with pytest.raises(ValueError, match=message):
    GPipeSequentialLayer.FromPipeliningLayer(p)


def testPipelineTplCannotOverrideTheLingvoParams():
  p = _LingvoPipeline(stacks.PipeliningLayer)
  p.pipeline_tpl.num_micro_batches = 4
  with pytest.raises(ValueError, match=(
      r"pipeline_tpl.num_micro_batches=4: this field comes from the layer's "
      r'Lingvo params .* set it there and leave '
      r'pipeline_tpl.num_micro_batches=1.')):
    with tf.Graph().as_default():
      p.Instantiate()


def testDocsFetchedActivationExampleRuns(capsys):
  """docs/from_lingvo.md's act_fetch_layers example runs as written."""
  with open(os.path.join(ROOT, 'docs', 'from_lingvo.md')) as f:
    text = f.read()
  section = text[text.index('### Fetched activations'):]
  code = re.findall(r'```python\n(.*?)```', section, re.S)[0]
  namespace = {}
  exec(code, namespace)  # pylint: disable=exec-used
  assert capsys.readouterr().out == "[('fetch', None)]\n"
  assert namespace['fetched'].shape.as_list() == [16, 8, 8, 1]
  assert namespace['logits'].shape.as_list() == [16, 8, 8, 1]
