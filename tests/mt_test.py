"""params/mt.py trains through tools/train.py; its checkpoint converts.

The registered model is Lingvo's GPipeTransformerStack through
lingvo_gpipe.stacks. tools/convert_checkpoint.py (run as a user would) moves
its checkpoint to Lingvo's names, which Lingvo's own stack restores at two
splits, and Lingvo's names (at a third split) back to ours unchanged; bad
input is one line.
"""

import re

import numpy as np
import pytest
from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import layers_with_gpipe

from lingvo_gpipe import checkpoints
import params  # pylint: disable=unused-import  # Registers the models.
import tool_util

MODEL = 'mt.ReverseTransformerTiny'
STEPS = 10
TRAINED = 'trained/train/ckpt-{:08d}'.format(STEPS)
_CONVERTED = re.compile(
    r'^converted (\S+) -> (\S+) \(to=(\w+)\): (\d+) variables renamed, '
    r'(\d+) unchanged$', re.M)


def _ToLingvoInProcess(tmp, splits):
  """The trained checkpoint in Lingvo's names at `splits`, by the library."""
  cfg = model_registry.GetParams(MODEL, 'Train')
  cfg.task.stack.splits = splits
  with tf.Graph().as_default():
    model = cfg.Instantiate()
  checkpoints.ConvertCheckpoint(model, f'{tmp}/{TRAINED}',
                                f'{tmp}/in_process/ckpt', to='lingvo')


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp('mt'))
  results = tool_util.RunToolInParallel('train.py', {
      'train': [f'--model={MODEL}', '--num_devices=2', '--log_every=1',
                f'--max_steps={STEPS}', '--logdir={tmp}/trained'],
  }, tmp, timeout=600)
  _ToLingvoInProcess(tmp, [0, 1, 2])
  convert = [f'--model={MODEL}']
  results.update(tool_util.RunToolInParallel('convert_checkpoint.py', {
      'to_lingvo': convert + ['--to=lingvo', '--input={tmp}/trained/train',
                              '--output={tmp}/lingvo/ckpt'],
      'to_lingvo_split': convert + [
          '--to=lingvo', f'--input={{tmp}}/{TRAINED}',
          '--output={tmp}/lingvo_split/ckpt',
          '--model_params_override=task.stack.splits: [0, 2]'],
      'back': convert + ['--to=ours', '--input={tmp}/in_process',
                         '--output={tmp}/back/ckpt'],
      'not_lingvo': convert + ['--to=ours', '--input={tmp}/trained/train',
                               '--output={tmp}/bad/ckpt'],
      'over_input': convert + ['--to=lingvo', f'--input={{tmp}}/{TRAINED}',
                               f'--output={{tmp}}/{TRAINED}'],
  }, tmp, timeout=300))
  return results


def _Converted(runs, name):
  code, stdout, stderr = runs[name]
  assert code == 0, stderr[-3000:]
  (match,) = _CONVERTED.findall(stdout)
  return match


def _Read(prefix):
  reader = tf.train.load_checkpoint(prefix)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


@pytest.mark.slow
def testTrainsThroughTheLauncherOnTwoStages(runs):
  code, stdout, stderr = runs['train']
  assert code == 0, stderr[-3000:]
  losses = [float(l) for l in re.findall(r'^step +\d+ +loss ([\d.]+)', stdout,
                                         re.M)]
  assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5
  with open(f'{runs["tmp"]}/trained/train_log.txt') as f:
    (placement,) = re.findall(r'stack: stage devices (.*)$', f.read(), re.M)
  assert placement.startswith(str(
      [f'/job:localhost/replica:0/task:0/device:CPU:{k}' for k in (0, 1)]))


def _LingvoModelRestores(prefix, splits):
  """Lingvo's own stack, in the same task, restores `prefix`; its values.

  Args:
    prefix: A checkpoint in Lingvo's names.
    splits: The Lingvo stack's splits.

  Returns:
    {our variable name: value} of every variable of Lingvo's model.
  """
  cfg = model_registry.GetParams(MODEL, 'Train')
  lingvo = layers_with_gpipe.GPipeTransformerStack.Params()
  for name, value in cfg.task.stack.IterParams():
    if name not in ('cls', 'pipeline_tpl'):
      lingvo.Set(**{name: value})
  cfg.task.stack = lingvo.Set(splits=splits)
  with tf.Graph().as_default() as graph:
    variables = cfg.Instantiate().vars.Flatten()
    with tf.compat.v1.Session(graph=graph) as sess:
      tf.compat.v1.train.Saver(variables).restore(sess, prefix)
      values = sess.run(variables)
  return {
      re.sub(r'^reverse/cell_\d+/', 'reverse/stack/', v.op.name): value
      for v, value in zip(variables, values)
  }


@pytest.mark.parametrize('name,splits,cells', [
    ('to_lingvo', [1, 2], {'cell_0/emb', 'cell_0/encoder_0',
                           'cell_1/decoder_0', 'cell_1/softmax'}),
    ('to_lingvo_split', [0, 2], {'cell_0/emb', 'cell_1/encoder_0',
                                 'cell_1/decoder_0', 'cell_1/softmax'}),
])
@pytest.mark.slow
def testLingvoStackRestoresTheConvertedCheckpoint(runs, name, splits, cells):
  source, output, to, renamed, unchanged = _Converted(runs, name)
  assert (source, to) == (f'{runs["tmp"]}/{TRAINED}', 'lingvo')
  # 43 weights with 2 Adam slots each; global_step, beta1/2_power stay.
  assert (int(renamed), int(unchanged)) == (129, 3)
  converted = _Read(output)
  assert {'/'.join(k.split('/')[1:3]) for k in converted
          if '/cell_' in k} == cells
  original = _Read(source)
  restored = _LingvoModelRestores(output, splits)
  assert len(restored) == 43
  for key, value in restored.items():
    assert np.array_equal(value, original[key]), key


@pytest.mark.slow
def testBackToOursIsTheOriginal(runs):
  source, output, to, _, _ = _Converted(runs, 'back')
  assert (source, to) == (f'{runs["tmp"]}/in_process/ckpt', 'ours')
  original, back = _Read(f'{runs["tmp"]}/{TRAINED}'), _Read(output)
  assert sorted(back) == sorted(original)
  assert all(np.array_equal(back[k], original[k]) for k in original)


@pytest.mark.parametrize('name,message', [
    ('not_lingvo', r"the checkpoint lacks 43 of the model's variables: "
                   r'reverse/cell_0/emb/src_token_emb/wm/var, .* and 33 more; '
                   r'is it a checkpoint of this model, in the naming that '
                   r"to='ours' converts from\?"),
    ('over_input', r"output '.*/ckpt-00000010' is the input checkpoint; "
                   r'give another prefix'),
])
@pytest.mark.slow
def testBadInputIsOneLine(runs, name, message):
  code, stdout, stderr = runs[name]
  assert code == 2
  errors = [l for l in stderr.splitlines()
            if l.startswith('convert_checkpoint.py: error')]
  assert len(errors) == 1 and re.search(message, errors[0]), stderr[-2000:]
  assert 'Traceback' not in stderr and not stdout
