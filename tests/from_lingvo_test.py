"""GPipeSequentialLayer.FromPipeliningLayer and the drop-in PipeliningLayer."""

from unittest import mock

from absl import logging
import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import cluster_factory
from lingvo.core import gpipe
from lingvo.core import layers
from lingvo.core import layers_with_gpipe
from lingvo.core import py_utils

from lingvo_gpipe import GPipeSequentialLayer
from lingvo_gpipe import from_lingvo
from lingvo_gpipe import stacks
import engine_util

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
  return Change


@pytest.mark.parametrize('change,message', [
    (lambda p: p.Set(before_tpl=[_FC('pre')]),
     r"before_tpl=\['pre'\] is not supported.*before_tpl must be \[\]"),
    (_SetCell(0, num_act_inputs=1),
     r"cell_tpl\[0\] \('c0'\) has num_act_inputs=1: .*only 0 and \[\] are"),
    (_SetCell(1, act_fetch_layers=['fc2'], num_act_outputs=1),
     r"cell_tpl\[1\] \('c1'\) has num_act_outputs=1"),
    (lambda p: p.Set(micro_batch_size=4),
     'micro_batch_size=4 and num_micro_batches=2 are both set'),
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
