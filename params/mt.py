r"""A GPipe Transformer encoder-decoder that learns to reverse sequences.

Built the way a Lingvo GPipe model is: a `GPipeTransformerStack` with
embeddings, encoder and decoder layers, softmax and label smoothing; the only
change from Lingvo is the import of the stack (`lingvo_gpipe.stacks` instead
of `lingvo.core.layers_with_gpipe`). The stack's `splits` cut it into K
stages, its `num_micro_batches` sets M, and `pipeline_tpl` holds our
pipeline's own knobs (re-materialization).

The data needs no files: each example is a random sequence of tokens of
random length, and its target is the same tokens in reverse order, drawn by
a stateless generator from (seed, global step), so a restarted run sees the
same batches. Train and dev use different seeds.

    python tools/train.py --model=mt.ReverseTransformer --num_devices=2 \
        --logdir=/tmp/reverse
"""

from lingvo import compat as tf
from lingvo import model_registry
from lingvo.core import base_input_generator
from lingvo.core import base_model_params
from lingvo.core import layers
from lingvo.core import py_utils

from lingvo_gpipe import stacks
from params import pipelined_task

PAD, BOS = 0, 1
FIRST_TOKEN = 2  # Tokens to reverse are FIRST_TOKEN .. vocab_size - 1.


class ReverseInput(base_input_generator.BaseInputGenerator):
  """Random token sequences and their reversal, time-major for the stack.

  Every example has between min_len and seq_len tokens, padded to seq_len.
  The decoder reads BOS and the reversed tokens shifted right, and predicts
  the reversed tokens.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 16, 'Token ids, PAD and BOS included.')
    p.Define('seq_len', 10, 'The longest sequence (and the padded length).')
    p.Define('min_len', 4, 'The shortest sequence.')
    p.Define('data_seed', 1, 'Seed of the sequences; train and dev differ.')
    return p

  def _InputBatch(self):
    p = self.params
    batch_size = self.InfeedBatchSize()  # All of Lingvo's towers.
    step = tf.cast(py_utils.GetGlobalStep(), tf.int32)
    lengths = tf.random.stateless_uniform(
        [batch_size], seed=tf.stack([p.data_seed, step]), minval=p.min_len,
        maxval=p.seq_len + 1, dtype=tf.int32)
    tokens = tf.random.stateless_uniform(
        [batch_size, p.seq_len], seed=tf.stack([p.data_seed + 1, step]),
        minval=FIRST_TOKEN, maxval=p.vocab_size, dtype=tf.int32)
    inside = tf.sequence_mask(lengths, p.seq_len)
    source = tf.where(inside, tokens, tf.fill([batch_size, p.seq_len], PAD))
    labels = tf.reverse_sequence(source, lengths, seq_axis=1, batch_axis=0)
    target = tf.concat([tf.fill([batch_size, 1], BOS), labels[:, :-1]], 1)
    paddings = 1.0 - tf.cast(inside, tf.float32)
    return py_utils.NestedMap(source=source, target=target, labels=labels,
                              paddings=paddings)


class ReverseTask(pipelined_task.PipelinedTask):
  """Sequence-to-sequence: `stack` is a (time-major) GPipeTransformerStack."""

  def ComputePredictions(self, theta, input_batch):
    paddings = tf.transpose(input_batch.paddings)
    xent, logits = self.stack.FProp(
        theta.stack,
        tf.transpose(input_batch.source), paddings,
        tf.transpose(input_batch.target), paddings,
        labels=tf.transpose(input_batch.labels), label_weights=1.0 - paddings)
    return py_utils.NestedMap(xent=xent, logits=logits)

  def ComputeLoss(self, theta, predictions, input_batch):
    """The stack's cross-entropy (label-smoothed), log perplexity, accuracy.

    Args:
      theta: The task's variables.
      predictions: ComputePredictions' NestedMap.
      input_batch: The input NestedMap.

    Returns:
      (metrics, per_example): Lingvo's {name: (value, weight)} and {}.
    """
    weights = 1.0 - tf.transpose(input_batch.paddings)
    log_pplx, accuracy, count = pipelined_task.SoftmaxMetrics(
        predictions.logits, tf.transpose(input_batch.labels), weights)
    batch_metrics = {
        'loss': (tf.reduce_sum(predictions.xent * weights) / count, count),
        'log_pplx': (log_pplx, count),
        'token_accuracy': (accuracy, count),
    }
    batch_metrics.update(self.PipelineMetrics(input_batch.source.shape[0]))
    return batch_metrics, {}


@model_registry.RegisterSingleTaskModel
class ReverseTransformer(base_model_params.SingleTaskModelParams):
  """2 + 2 layers of dim 32, 2 stages, 4 micro-batches of 8 sequences."""

  DIM = 32
  NUM_HEADS = 4
  HIDDEN_DIM = 64
  NUM_ENCODER_LAYERS = 2
  NUM_DECODER_LAYERS = 2
  SPLITS = [2, 4]  # Stage 0: emb, encoders; stage 1: decoders, softmax.
  NUM_MICRO_BATCHES = 4
  VOCAB_SIZE = 16
  SEQ_LEN = 10
  BATCH_SIZE = 32
  MAX_STEPS = 1000
  LEARNING_RATE = 3e-3
  RANDOM_SEED = 1234  # Same initial weights in every run.

  def _Input(self, data_seed):
    return ReverseInput.Params().Set(
        vocab_size=self.VOCAB_SIZE, seq_len=self.SEQ_LEN,
        batch_size=self.BATCH_SIZE, data_seed=data_seed)

  def Train(self):
    return self._Input(data_seed=1)

  def Dev(self):
    return self._Input(data_seed=1001)

  def Task(self):
    p = ReverseTask.Params().Set(name='reverse', random_seed=self.RANDOM_SEED)
    stack = stacks.GPipeTransformerStack.Params().Set(
        name='stack', model_dim=self.DIM,
        num_encoder_layers=self.NUM_ENCODER_LAYERS,
        num_decoder_layers=self.NUM_DECODER_LAYERS, splits=self.SPLITS,
        num_micro_batches=self.NUM_MICRO_BATCHES)
    for tpl in (stack.encoder_tpl, stack.decoder_tpl):
      tpl.source_dim = self.DIM
      tpl.tr_atten_tpl.num_attention_heads = self.NUM_HEADS
      tpl.tr_fflayer_tpl.hidden_dim = self.HIDDEN_DIM
    stack.emb_tpl.token_emb.Set(vocab_size=self.VOCAB_SIZE,
                                embedding_dim=self.DIM, scale_sqrt_depth=True)
    stack.emb_tpl.position_emb.embedding_dim = self.DIM
    stack.softmax_tpl.Set(input_dim=self.DIM, num_classes=self.VOCAB_SIZE)
    stack.label_smoothing = layers.UniformLabelSmoother.Params().Set(
        num_classes=self.VOCAB_SIZE, uncertainty=0.1)
    stack.pipeline_tpl.remat = 'except_last'
    p.stack = stack
    pipelined_task.SetTrainSchedule(p.train, self.LEARNING_RATE,
                                    self.MAX_STEPS, final_value=0.1,
                                    save_interval_steps=100)
    p.train.clip_gradient_norm_to_value = 1.0
    p.eval.samples_per_summary = 8 * self.BATCH_SIZE
    return p


@model_registry.RegisterSingleTaskModel
class ReverseTransformerTiny(ReverseTransformer):
  """A seconds-per-run variant for tests: 1 + 1 layers of dim 16."""

  DIM = 16
  NUM_HEADS = 2
  HIDDEN_DIM = 32
  NUM_ENCODER_LAYERS = 1
  NUM_DECODER_LAYERS = 1
  SPLITS = [1, 2]
  NUM_MICRO_BATCHES = 2
  SEQ_LEN = 6
  BATCH_SIZE = 8
  MAX_STEPS = 20
  LEARNING_RATE = 1e-2

  def Task(self):
    p = super().Task()
    p.train.save_interval_steps = 5
    return p
