"""Checkpoint names between Lingvo's PipeliningLayer and lingvo_gpipe.stacks."""

import os

import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import builder_layers
from lingvo.core import gpipe
from lingvo.core import layers

from lingvo_gpipe import checkpoints
from lingvo_gpipe import stacks

# Lingvo: cells c0 = [a_fc0, a_fc1] (prefix 'a_'), c1 = [fc2], and fc3 as a
# cell of its own, in the scope of their parent 'task'.
LINGVO_LAYERS = {'a_fc0': 'c0/a_fc0', 'a_fc1': 'c0/a_fc1', 'fc2': 'c1/fc2',
                 'fc3': 'fc3'}
OTHER = ['global_step', 'beta1_power', 'task/head/w/var', 'task/head/b/var']


def _FC(name):
  return layers.FCLayer.Params().Set(name=name, input_dim=4, output_dim=4)


def _Task(pipeline_cls):
  """A parent 'task' with the pipeline 'pipe' and another layer 'head'."""
  cells = [
      gpipe.FeatureExtractionLayer.Params().Set(
          name='c0', sub=[_FC('fc0'), _FC('fc1')], variable_name_prefix='a_'),
      gpipe.FeatureExtractionLayer.Params().Set(name='c1', sub=[_FC('fc2')]),
      _FC('fc3'),
  ]
  return builder_layers.SequentialLayer.Params().Set(
      name='task', sub=[
          pipeline_cls.Params().Set(name='pipe', cell_tpl=cells),
          _FC('head')
      ])


@pytest.fixture(scope='module', name='model')
def fixture_model():
  with tf.Graph().as_default():
    return _Task(stacks.PipeliningLayer).Instantiate()


def _Keys(scopes, prefix):
  """Checkpoint keys of the FC layers at `scopes`, with Adam slots."""
  keys = list(OTHER)
  for scope in scopes:
    for var in ('w', 'b'):
      name = f'{prefix}{scope}/{var}/var'
      keys += [name, f'{name}/Adam', f'{name}/Adam_1']
  return keys


LINGVO_KEYS = _Keys(LINGVO_LAYERS.values(), 'task/')
OUR_KEYS = _Keys(LINGVO_LAYERS, 'task/pipe/')


def testRenamesBothWays(model):
  to_ours = checkpoints.Renames(model, LINGVO_KEYS, to='ours')
  assert to_ours == dict(zip(LINGVO_KEYS, OUR_KEYS))
  assert to_ours['task/c0/a_fc1/w/var/Adam'] == 'task/pipe/a_fc1/w/var/Adam'
  assert to_ours['task/fc3/b/var'] == 'task/pipe/fc3/b/var'
  assert checkpoints.Renames(model, OUR_KEYS, to='lingvo') == dict(
      zip(OUR_KEYS, LINGVO_KEYS))


def testLingvoCellsAreReadFromTheCheckpoint(model):
  """A checkpoint of another Lingvo split (a_fc1 in c1) converts too."""
  keys = [k.replace('c0/a_fc1', 'c1/a_fc1') for k in LINGVO_KEYS]
  assert checkpoints.Renames(model, keys, to='ours') == dict(
      zip(keys, OUR_KEYS))


@pytest.mark.parametrize('keys,to,message', [
    (LINGVO_KEYS + ['task/c1/extra/var'], 'ours',
     r'1 checkpoint variables are inside a pipeline of the model but belong '
     r'to none of its layers: task/c1/extra/var\.'),
    (OUR_KEYS + ['task/pipe/fc9/w/var'], 'lingvo',
     r'belong to none of its layers: task/pipe/fc9/w/var\.'),
    (LINGVO_KEYS[:-3], 'ours',
     r"the checkpoint lacks 1 of the model's variables: task/fc3/b/var; is "
     r"it a checkpoint of this model, in the naming that to='ours' converts "
     r'from\?'),
    # Already converted: its pipeline variables are not in Lingvo's names.
    (OUR_KEYS, 'ours',
     r"lacks 8 of the model's variables: task/c0/a_fc0/b/var, .*, "
     r'task/fc3/w/var;'),
    (LINGVO_KEYS + ['task/c1/a_fc0/w/var'], 'ours',
     r"layer 'a_fc0' of 'task/pipe' has variables in Lingvo cells "
     r"\['c0', 'c1'\] of the checkpoint; expected one"),
    (OUR_KEYS + ['task/c1/fc2/w/var'], 'lingvo',
     r"checkpoint variables 'task/pipe/fc2/w/var' and 'task/c1/fc2/w/var' "
     r"would both be named 'task/c1/fc2/w/var'"),
    (OUR_KEYS, 'both', r"to='both' must be one of \['ours', 'lingvo'\]"),
])
def testUnmappableCheckpointsAreRefused(model, keys, to, message):
  with pytest.raises(ValueError, match=message):
    checkpoints.Renames(model, keys, to)


def testModelWithoutOurPipelineIsRefused():
  with tf.Graph().as_default():
    lingvo = _Task(gpipe.PipeliningLayer).Instantiate()
  with pytest.raises(ValueError, match=(
      r"'task' has no lingvo_gpipe.stacks pipeline; build the model with "
      r'lingvo_gpipe.stacks')):
    checkpoints.Renames(lingvo, LINGVO_KEYS, to='ours')


def _SaveLingvoTask(prefix):
  """Saves Lingvo's task (random weights); returns {name: value}."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    _Task(gpipe.PipeliningLayer).Instantiate()
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      tf.compat.v1.train.Saver().save(sess, prefix)
      return {v.op.name: v.eval() for v in tf.compat.v1.global_variables()}


def _Read(prefix):
  reader = tf.train.load_checkpoint(prefix)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


def testConvertCheckpointRoundTripAndNeverOverwrites(model, tmp_path):
  lingvo = str(tmp_path / 'lingvo' / 'ckpt-0')
  ours, back = str(tmp_path / 'ours' / 'ckpt-0'), str(tmp_path / 'ckpt-0')
  saved = _SaveLingvoTask(lingvo)
  renames = checkpoints.ConvertCheckpoint(model, lingvo, ours, to='ours')
  converted = _Read(ours)
  assert sorted(converted) == sorted(renames.values())
  assert all(np.array_equal(converted[renames[k]], v) for k, v in saved.items())
  # The output directory's checkpoint state names it (for Lingvo's trainer).
  assert tf.train.latest_checkpoint(os.path.dirname(ours)) == ours
  checkpoints.ConvertCheckpoint(model, ours, back, to='lingvo')
  restored = _Read(back)
  assert sorted(restored) == sorted(saved)
  assert all(np.array_equal(restored[k], v) for k, v in saved.items())

  before = sorted(os.listdir(tmp_path / 'ours'))
  with pytest.raises(ValueError, match=r"output '.*ours/ckpt-0' exists"):
    checkpoints.ConvertCheckpoint(model, lingvo, ours, to='ours')
  with pytest.raises(ValueError, match='is the input checkpoint'):
    checkpoints.ConvertCheckpoint(model, ours, ours, to='lingvo')
  assert sorted(os.listdir(tmp_path / 'ours')) == before
