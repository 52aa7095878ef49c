"""A character-level GPipe Transformer language model on Python's docstrings.

The model is one `GPipeSequentialLayer` of cells (embedding, N causal
Transformer layers, softmax) cut into K stages. The corpus ships in
params/data/python_docstrings.txt (docstrings of Python 3.11 standard-library
modules); the last 10% of it is held out for Lingvo's eval and decode jobs.

    python tools/train.py --model=lm.GPipeCharLm --num_devices=4 \
        --logdir=/tmp/lm
"""

import math
import os

from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import base_input_generator
from lingvo.core import base_layer
from lingvo.core import base_model_params
from lingvo.core import layers
from lingvo.core import layers_with_attention
from lingvo.core import metrics
from lingvo.core import py_utils
import numpy as np

from lingvo_gpipe import GPipeSequentialLayer
from params import pipelined_task

CORPUS = os.path.join(os.path.dirname(__file__), 'data',
                      'python_docstrings.txt')
VOCAB_SIZE = 256  # Bytes.


def ReadCorpus(path, split, dev_fraction):
  """The bytes of one split of a text file.

  Args:
    path: The text file.
    split: 'train' (the head) or 'dev' (the last `dev_fraction`).
    dev_fraction: Held-out share of the file, in (0, 1).

  Returns:
    A uint8 numpy array.

  Raises:
    ValueError: for an unknown split or a fraction outside (0, 1).
  """
  if split not in ('train', 'dev'):
    raise ValueError(f"split={split!r} must be 'train' or 'dev'.")
  if not 0 < dev_fraction < 1:
    raise ValueError(f'dev_fraction={dev_fraction} must be in (0, 1).')
  with open(path, 'rb') as f:
    data = np.frombuffer(f.read(), dtype=np.uint8)
  cut = int(len(data) * (1 - dev_fraction))
  return data[:cut] if split == 'train' else data[cut:]


class CharLmInput(base_input_generator.BaseInputGenerator):
  """Random windows of a byte corpus: ids, next-byte labels and paddings.

  The window offsets of a step come from a stateless random function of
  (window_seed, global step), so a run that restarts from a checkpoint sees
  the very batches the uninterrupted run would have seen.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('corpus', CORPUS, 'Text file to model, read as bytes.')
    p.Define('split', 'train', "'train' or 'dev' (the held-out tail).")
    p.Define('dev_fraction', 0.1, 'Share of the corpus held out for dev.')
    p.Define('seq_len', 64, 'Bytes per example.')
    p.Define('window_seed', 1234, 'Seed of the window offsets.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._text = ReadCorpus(p.corpus, p.split, p.dev_fraction)
    if len(self._text) <= p.seq_len + 1:
      raise ValueError(f'seq_len={p.seq_len} must be shorter than the '
                       f'{p.split} split ({len(self._text)} bytes).')

  def _InputBatch(self):
    p = self.params
    text = tf.constant(self._text.astype(np.int32))
    step = tf.cast(py_utils.GetGlobalStep(), tf.int32)
    batch_size = self.InfeedBatchSize()  # All of Lingvo's towers.
    offsets = tf.random.stateless_uniform(
        [batch_size], seed=tf.stack([p.window_seed, step]),
        maxval=len(self._text) - p.seq_len - 1, dtype=tf.int32)
    positions = offsets[:, tf.newaxis] + tf.range(p.seq_len + 1)
    windows = tf.gather(text, positions)
    return py_utils.NestedMap(
        ids=windows[:, :-1],
        labels=windows[:, 1:],
        paddings=tf.zeros([batch_size, p.seq_len], tf.float32))


class ByteCell(base_layer.BaseLayer):
  """Params shared by the cells that map bytes to vectors and back."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', VOCAB_SIZE, 'Number of distinct ids.')
    p.Define('dim', 64, 'Model dimension.')
    return p


class CharEmbeddingCell(ByteCell):
  """First cell: byte ids [T, B] -> scaled embeddings + positions [T, B, D]."""

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateChild(
        'emb', layers.SimpleEmbeddingLayer.Params().Set(
            vocab_size=p.vocab_size, embedding_dim=p.dim))
    self.CreateChild('pos',
                     layers.PositionalEmbeddingLayer.Params().Set(
                         embedding_dim=p.dim))

  def FProp(self, theta, ids, paddings, *passed):
    """Embeds ids.

    Args:
      theta: This cell's variables.
      ids: int32 [T, B].
      paddings: float [T, B], 1 at padded positions.
      *passed: Tensors passed on unchanged (the labels, for a loss cell).

    Returns:
      (vecs [T, B, D], paddings, *passed).
    """
    vecs = self.emb.EmbLookup(theta.emb, ids) * math.sqrt(self.params.dim)
    vecs += self.pos.FProp(theta.pos, tf.shape(ids)[0])[:, tf.newaxis, :]
    return (vecs, paddings) + passed


class TransformerCell(base_layer.BaseLayer):
  """A Transformer layer that passes its paddings on, so cells can chain."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 64, 'Model dimension.')
    p.Define('num_heads', 4, 'Attention heads.')
    p.Define('hidden_dim', 256, 'Feed-forward hidden dimension.')
    p.Define('causal', True, 'Masked self-attention: position t attends to '
             'positions <= t only (what a language model needs).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    tp = layers_with_attention.TransformerLayer.Params().Set(
        source_dim=p.dim, mask_self_atten=p.causal)
    tp.tr_atten_tpl.num_attention_heads = p.num_heads
    tp.tr_fflayer_tpl.hidden_dim = p.hidden_dim
    self.CreateChild('transformer', tp)

  def FProp(self, theta, vecs, paddings, *passed):
    """(vecs [T, B, D], paddings, *passed) after one Transformer layer."""
    vecs, _ = self.transformer.FProp(theta.transformer, vecs, paddings)
    return (vecs, paddings) + passed


class CharSoftmaxCell(ByteCell):
  """Last cell: layer norm and projection to next-byte logits [T, B, V]."""

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateChild('ln', layers.LayerNorm.Params().Set(input_dim=p.dim))
    self.CreateChild(
        'proj', layers.FCLayer.Params().Set(
            input_dim=p.dim, output_dim=p.vocab_size, activation='NONE'))

  def FProp(self, theta, vecs, paddings):
    """Returns (logits [T, B, V], paddings)."""
    return self.Logits(theta, vecs), paddings

  def Logits(self, theta, vecs):
    """Next-byte logits [T, B, V] of vecs [T, B, D]."""
    return self.proj.FProp(theta.proj, self.ln.FProp(theta.ln, vecs))


class CharLossCell(CharSoftmaxCell):
  """Last cell with the loss inside the pipeline (schedule='1f1b').

  The same variables as CharSoftmaxCell (checkpoints move between the two);
  FProp returns the micro-batch's mean cross entropy and next-byte accuracy.
  """

  def FProp(self, theta, vecs, paddings, labels):
    """(loss, accuracy): scalars over the non-padded bytes of vecs [T, B, D].

    Args:
      theta: This cell's variables.
      vecs: float [T, B, D].
      paddings: float [T, B].
      labels: int32 [T, B], the next bytes.

    Returns:
      (loss, accuracy), float scalars.
    """
    loss, accuracy, _ = pipelined_task.SoftmaxMetrics(
        self.Logits(theta, vecs), labels, 1.0 - paddings)
    return loss, accuracy


def CharLmCells(num_layers, dim, num_heads, hidden_dim, loss_inside=False):
  """The cells of the pipeline: embedding, Transformer layers, softmax.

  Args:
    num_layers: Transformer layers.
    dim: Model dimension.
    num_heads: Attention heads.
    hidden_dim: Feed-forward hidden dimension.
    loss_inside: If True the last cell computes the loss (`CharLossCell`,
      for schedule='1f1b'), and the pipeline takes ids, paddings and labels.

  Returns:
    The cells' Params.
  """
  last = CharLossCell if loss_inside else CharSoftmaxCell
  return ([CharEmbeddingCell.Params().Set(name='embedding', dim=dim)] + [
      TransformerCell.Params().Set(
          name=f'layer{i}', dim=dim, num_heads=num_heads,
          hidden_dim=hidden_dim) for i in range(num_layers)
  ] + [last.Params().Set(name='softmax', dim=dim)])


class CharLmTask(pipelined_task.PipelinedTask):
  """Next-byte prediction; `stack` maps ids, paddings [T, B] to logits.

  With a schedule that computes the loss inside the pipeline (schedule=
  '1f1b', cells from `CharLmCells(..., loss_inside=True)`), `stack` maps ids,
  paddings and labels to the loss and accuracy.
  """

  def ComputePredictions(self, theta, input_batch):
    ids = tf.transpose(input_batch.ids)
    paddings = tf.transpose(input_batch.paddings)
    if self.stack.loss_inside:
      loss, accuracy = self.stack.FProp(theta.stack, ids, paddings,
                                        tf.transpose(input_batch.labels))
      return py_utils.NestedMap(loss=loss, accuracy=accuracy)
    logits, _ = self.stack.FProp(theta.stack, ids, paddings)
    return py_utils.NestedMap(logits=logits)

  def ComputeLoss(self, theta, predictions, input_batch):
    """Per-byte cross entropy, accuracy and the pipeline's bubble fraction.

    Args:
      theta: The task's variables.
      predictions: ComputePredictions' NestedMap.
      input_batch: The input NestedMap.

    Returns:
      (metrics, per_example): Lingvo's {name: (value, weight)} and {}.
    """
    if self.stack.loss_inside:
      loss, accuracy = predictions.loss, predictions.accuracy
      count = tf.reduce_sum(1.0 - input_batch.paddings)
    else:
      loss, accuracy, count = pipelined_task.SoftmaxMetrics(
          predictions.logits, tf.transpose(input_batch.labels),
          1.0 - tf.transpose(input_batch.paddings))
    batch_metrics = {
        'loss': (loss, count),
        'log_pplx': (loss, count),
        'fraction_of_correct_next_step_preds': (accuracy, count),
    }
    batch_metrics.update(self.PipelineMetrics(input_batch.ids.shape[0]))
    return batch_metrics, {}

  def Decode(self, input_batch):
    """Greedy next-byte predictions of a held-out batch (teacher forced)."""
    if self.stack.loss_inside:
      raise ValueError(
          'Decoding needs the logits, and this pipeline ends in its loss '
          f'(schedule={self.params.stack.schedule!r}); decode the same '
          'checkpoint with the model that has a softmax cell (e.g. '
          'lm.GPipeCharLm for lm.GPipeCharLm1F1B).')
    predictions = self.ComputePredictions(self.theta, input_batch)
    return py_utils.NestedMap(
        ids=input_batch.ids,
        labels=input_batch.labels,
        predicted=tf.transpose(
            tf.argmax(predictions.logits, -1, output_type=tf.int32)))

  def CreateDecoderMetrics(self):
    return {
        'fraction_of_correct_next_step_preds': metrics.AverageMetric(),
        'num_samples_in_batch': metrics.AverageMetric(),
    }

  def PostProcessDecodeOut(self, decode_out_dict, decode_metrics_dict):
    """Scores the predictions and returns (text, prediction) pairs."""
    labels = decode_out_dict['labels']
    predicted = decode_out_dict['predicted']
    decode_metrics_dict['fraction_of_correct_next_step_preds'].Update(
        float(np.mean(labels == predicted)), labels.size)
    decode_metrics_dict['num_samples_in_batch'].Update(len(labels))
    return [(bytes(t.astype(np.uint8)).decode('latin-1'),
             bytes(p.astype(np.uint8)).decode('latin-1'))
            for t, p in zip(labels, predicted)]


@model_registry.RegisterSingleTaskModel
class GPipeCharLm(base_model_params.SingleTaskModelParams):
  """4 Transformer layers, dim 64, 4 stages, 4 micro-batches of 8 windows."""

  NUM_LAYERS = 4
  DIM = 64
  NUM_HEADS = 4
  HIDDEN_DIM = 256
  SEQ_LEN = 64
  BATCH_SIZE = 32
  NUM_STAGES = 4
  NUM_MICRO_BATCHES = 4
  MAX_STEPS = 300
  LEARNING_RATE = 3e-3
  RANDOM_SEED = 1234  # Same initial weights in every run.
  SCHEDULE = 'gpipe'
  LOSS_IN_PIPELINE = False  # The last cell computes the loss (for 1F1B).

  def Train(self):
    return CharLmInput.Params().Set(
        split='train', seq_len=self.SEQ_LEN, batch_size=self.BATCH_SIZE)

  def Dev(self):
    return CharLmInput.Params().Set(
        split='dev', seq_len=self.SEQ_LEN, batch_size=self.BATCH_SIZE)

  def Task(self):
    p = CharLmTask.Params().Set(name='lm', random_seed=self.RANDOM_SEED)
    p.stack = GPipeSequentialLayer.Params().Set(
        name='stack',
        cell_tpl=CharLmCells(self.NUM_LAYERS, self.DIM, self.NUM_HEADS,
                             self.HIDDEN_DIM, self.LOSS_IN_PIPELINE),
        num_stages=self.NUM_STAGES,
        num_micro_batches=self.NUM_MICRO_BATCHES,
        partition='params',
        batch_dim=1,
        schedule=self.SCHEDULE)
    pipelined_task.SetTrainSchedule(p.train, self.LEARNING_RATE,
                                    self.MAX_STEPS, final_value=0.1,
                                    save_interval_steps=50)
    p.train.clip_gradient_norm_to_value = 1.0
    p.eval.samples_per_summary = 8 * self.BATCH_SIZE
    p.eval.decoder_samples_per_summary = 2 * self.BATCH_SIZE
    return p


@model_registry.RegisterSingleTaskModel
class GPipeCharLmTiny(GPipeCharLm):
  """A seconds-per-run variant for tests: 2 layers of dim 16, 4 stages."""

  NUM_LAYERS = 2
  DIM = 16
  NUM_HEADS = 2
  HIDDEN_DIM = 32
  SEQ_LEN = 16
  BATCH_SIZE = 8
  NUM_MICRO_BATCHES = 2
  MAX_STEPS = 20
  LEARNING_RATE = 1e-2

  def Task(self):
    p = super().Task()
    p.train.save_interval_steps = 5
    return p


@model_registry.RegisterSingleTaskModel
class GPipeCharLm1F1B(GPipeCharLm):
  """GPipeCharLm with its loss in the last cell, run by the 1F1B schedule.

  Same variables, data and seeds: the same losses as GPipeCharLm, with each
  stage holding at most K - k micro-batches in flight.
  """

  SCHEDULE = '1f1b'
  LOSS_IN_PIPELINE = True


@model_registry.RegisterSingleTaskModel
class GPipeCharLmTiny1F1B(GPipeCharLmTiny):
  """GPipeCharLmTiny with its loss in the last cell, run by 1F1B."""

  SCHEDULE = '1f1b'
  LOSS_IN_PIPELINE = True
