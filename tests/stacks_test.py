"""Lingvo's own GPipe stacks, trained, converted and restored into ours.

Lingvo's GPipeTransformerStack (time-major) and GPipeBatchMajorTransformerStack
train a few Adam steps in graph mode with packed inputs, label smoothing and
the softmax loss of their FProp; the checkpoint is converted to our names and
restored into `lingvo_gpipe.stacks` at another K and M, and converted back
into Lingvo's stack at another split: outputs, loss and gradients match. The
evolved stack is checked to build the same variables as Lingvo's.
"""

import os

import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import cluster_factory
from lingvo.core import layers
from lingvo.core import layers_with_gpipe
from lingvo.core import py_utils

from lingvo_gpipe import checkpoints
from lingvo_gpipe import stacks
import engine_util
import test_util

VOCAB, DIM, TIME, BATCH = 12, 8, 6, 4


def _TimeMajorParams(cls, splits, num_micro_batches):
  # Lingvo's recurrent states all have state_dtype (default: the dtype of the
  # first input, int ids); its own tests set float32 and float segment ids.
  p = cls.Params().Set(name='stack', model_dim=DIM, num_encoder_layers=1,
                       num_decoder_layers=1, packed_input=True, splits=splits,
                       num_micro_batches=num_micro_batches, random_seed=1,
                       state_dtype=tf.float32)
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.source_dim = DIM
    tpl.tr_atten_tpl.num_attention_heads = 2
    tpl.tr_fflayer_tpl.hidden_dim = 2 * DIM
  return _Shared(p)


def _BatchMajorParams(cls, splits, num_micro_batches):
  return _Shared(test_util.BatchMajorStackParams(cls, splits,
                                                 num_micro_batches, DIM))


def _Shared(p):
  """Embeddings, softmax and label smoothing of both kinds of stack."""
  p.emb_tpl.token_emb.Set(vocab_size=VOCAB, embedding_dim=DIM)
  p.emb_tpl.position_emb.Set(embedding_dim=DIM)
  p.softmax_tpl.Set(input_dim=DIM, num_classes=VOCAB)
  p.label_smoothing = layers.UniformLabelSmoother.Params().Set(
      num_classes=VOCAB, uncertainty=0.1)
  return p


KINDS = {
    'time_major': (layers_with_gpipe.GPipeTransformerStack,
                   stacks.GPipeTransformerStack, _TimeMajorParams),
    'batch_major': (layers_with_gpipe.GPipeBatchMajorTransformerStack,
                    stacks.GPipeBatchMajorTransformerStack, _BatchMajorParams),
}


def _PackedInputs(time_major):
  """FProp's arguments: two packed sequences per row, some padding.

  Args:
    time_major: [time, batch] if True (float segment ids, as Lingvo's
      recurrent states need), else [batch, time].

  Returns:
    numpy arrays in FProp's order: source ids, paddings, target ids,
    paddings, source and target segment ids, labels, label weights, source
    and target segment positions.
  """
  rng = np.random.RandomState(7)
  ids = rng.randint(1, VOCAB, [BATCH, TIME]).astype(np.int32)
  segments = np.array([[1, 1, 1, 2, 2, 0]] * BATCH,
                      np.float32 if time_major else np.int32)
  positions = np.array([[0, 1, 2, 0, 1, 0]] * BATCH, np.int32)
  paddings = (segments == 0).astype(np.float32)
  targets = rng.randint(1, VOCAB, [BATCH, TIME]).astype(np.int32)
  labels = np.roll(targets, -1, axis=1)
  arrays = [ids, paddings, targets, paddings, segments, segments, labels,
            1.0 - paddings, positions, positions]
  return [a.T.copy() if time_major else a for a in arrays]


def _Run(params, inputs, restore=None, train_steps=0, save=None):
  """Builds a stack on a 4-device split; trains, saves and evaluates it.

  Args:
    params: The stack's params.
    inputs: FProp's numpy arguments.
    restore: Optional fn(stack) -> checkpoint prefix to restore from.
    train_steps: Adam steps on `inputs` before evaluating.
    save: Optional prefix to save every variable to after training.

  Returns:
    (stack, {'xent', 'logits', 'loss'} values after training and the
    'first_loss' before, {variable name: gradient}).
  """
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=4, split_size=4)
  graph = test_util.SeededGraph()  # The same weights in every run.
  with graph.as_default(), cluster:
    global_step = py_utils.GetOrCreateGlobalStepVar()
    stack = params.Instantiate()
    xent, logits = stack.FProp(stack.theta, *map(tf.constant, inputs))
    weights = inputs[7]
    loss = tf.reduce_sum(xent * weights) / weights.sum()
    variables = stack.vars.Flatten()
    grads = [tf.convert_to_tensor(g) for g in tf.gradients(loss, variables)]
    if train_steps:
      train = tf.compat.v1.train.AdamOptimizer(0.01).apply_gradients(
          zip(grads, variables), global_step=global_step)
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      if restore:
        tf.compat.v1.train.Saver(variables).restore(sess, restore(stack))
      first_loss = sess.run(loss)
      for _ in range(train_steps):
        sess.run(train)
      if save:
        tf.io.gfile.makedirs(os.path.dirname(save))
        tf.compat.v1.train.Saver().save(sess, save)
      values, grad_values = sess.run(
          [dict(xent=xent, logits=logits, loss=loss), grads])
  values['first_loss'] = first_loss
  names = [v.name[:-2] for v in variables]
  return stack, values, dict(zip(names, grad_values))


def _AssertSame(actual, expected, renames):
  """Outputs, loss and every gradient match (relative error < 1e-5).

  Args:
    actual: _Run's (values, grads) of one stack.
    expected: _Run's (values, grads) of the other.
    renames: {expected's variable name: actual's}.
  """
  (values, grads), (ref_values, ref_grads) = actual, expected
  assert sorted(renames[n] for n in ref_grads) == sorted(grads)
  names = sorted(ref_grads)
  engine_util.AssertTransparent(
      [values[k] for k in ('xent', 'logits', 'loss')] +
      [grads[renames[n]] for n in names],
      [ref_values[k] for k in ('xent', 'logits', 'loss')] +
      [ref_grads[n] for n in names])


@pytest.mark.slow
@pytest.mark.parametrize('kind', sorted(KINDS))
def testLingvoTrainedCheckpointRestoresIntoOurStackAndBack(kind, tmp_path):
  lingvo_cls, ours_cls, params_fn = KINDS[kind]
  inputs = _PackedInputs(time_major=kind == 'time_major')
  # Lingvo: splits=2, M=2: cell_0 = emb, encoder_0; cell_1 = decoder_0,
  # softmax.
  _, lingvo_values, lingvo_grads = _Run(
      params_fn(lingvo_cls, 2, 2), inputs, train_steps=3,
      save=str(tmp_path / 'lingvo' / 'ckpt-3'))
  assert lingvo_values['loss'] < lingvo_values['first_loss']  # It trained.

  converted = {}

  def ConvertToOurs(stack):
    prefix = str(tmp_path / 'ours' / 'ckpt-3')
    converted.update(checkpoints.ConvertCheckpoint(
        stack, str(tmp_path / 'lingvo' / 'ckpt-3'), prefix, to='ours'))
    return prefix

  # Ours: K=3 (emb | encoder_0 | decoder_0, softmax), M=4.
  ours, values, grads = _Run(params_fn(ours_cls, [0, 1, 2], 4), inputs,
                             restore=ConvertToOurs)
  assert ours.pipeline.partition == [1, 1, 2]
  assert ours.pipeline.NumMicroBatches(BATCH) == 4
  for old, new in converted.items():  # Slots too; global_step stays.
    assert new == (f'stack/{old.split("/", 1)[1]}'
                   if old.startswith('cell_') else old)
  _AssertSame((values, grads), (lingvo_values, lingvo_grads), converted)
  # The same through the loop engine (Lingvo's flat cells: many inputs,
  # None among them, time-major or batch-major).
  loop_params = params_fn(ours_cls, [0, 1, 2], 4)
  loop_params.pipeline_tpl.engine = 'loop'
  _, loop_values, loop_grads = _Run(
      loop_params, inputs, restore=lambda _: str(tmp_path / 'ours' / 'ckpt-3'))
  _AssertSame((loop_values, loop_grads), (lingvo_values, lingvo_grads),
              converted)

  # Back to Lingvo's names at another split, [0, 2]: emb | the rest.
  with tf.Graph().as_default():
    target = params_fn(ours_cls, [0, 2], 1).Instantiate()
  back = checkpoints.ConvertCheckpoint(
      target, str(tmp_path / 'ours' / 'ckpt-3'),
      str(tmp_path / 'back' / 'ckpt-3'), to='lingvo')
  _, back_values, back_grads = _Run(
      params_fn(lingvo_cls, [0, 2], 1), inputs,
      restore=lambda _: str(tmp_path / 'back' / 'ckpt-3'))
  to_back = {name: back[converted[name]] for name in lingvo_grads}
  assert {old.split('/')[1]: new.split('/')[0]
          for old, new in to_back.items()} == {
              'emb': 'cell_0', 'encoder_0': 'cell_1', 'decoder_0': 'cell_1',
              'softmax': 'cell_1'}
  _AssertSame((back_values, back_grads), (lingvo_values, lingvo_grads),
              to_back)


def _EvolvedParams(cls):
  p = cls.Params().Set(name='stack', model_dim=DIM, num_encoder_layers=1,
                       num_decoder_layers=1, splits=2)
  p.encoder_tpl.source_dim = DIM
  p.decoder_tpl.source_dim = DIM
  for atten in (p.encoder_tpl.transformer_tpl.tr_atten_tpl,
                p.decoder_tpl.tr_atten_tpl,
                p.decoder_tpl.tr_double_heads_atten_tpl,
                p.decoder_tpl.transformer_tpl.tr_atten_tpl):
    atten.num_attention_heads = 2
  p.emb_tpl.token_emb.Set(vocab_size=VOCAB, embedding_dim=DIM)
  p.emb_tpl.position_emb.Set(embedding_dim=DIM)
  p.softmax_tpl.Set(input_dim=DIM, num_classes=VOCAB)
  return p


@pytest.mark.slow
def testEvolvedStackHasLingvosLayersUnderOurNames():
  """One Params builds Lingvo's evolved stack and ours, variable by variable.

  Built, not run: the pipeline and loss code is the other stacks'.
  """
  with tf.Graph().as_default():
    lingvo = _EvolvedParams(
        layers_with_gpipe.GPipeEvolvedTransformerStack).Instantiate()
    ours = _EvolvedParams(stacks.GPipeEvolvedTransformerStack).Instantiate()
  assert isinstance(ours, layers_with_gpipe.GPipeEvolvedTransformerStack)
  assert [type(l) for l in ours.GetEncoders() + ours.GetDecoders()] == [
      layers_with_gpipe.GPipeEvolvedTransformerEncoderLayer,
      layers_with_gpipe.GPipeEvolvedTransformerDecoderLayer]
  renames = checkpoints.Renames(
      ours, [v.name[:-2] for v in lingvo.vars.Flatten()], to='ours')
  assert sorted(renames.values()) == sorted(
      v.name[:-2] for v in ours.vars.Flatten())
  assert len(renames) > 50
