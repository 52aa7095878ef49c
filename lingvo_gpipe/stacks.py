"""Lingvo's GPipe layers and stacks, run by GPipeSequentialLayer.

A model moves from Lingvo's pipeline to ours by one import (a tiny stack
here; time-major, so inputs are [time, batch]):

    >>> # from lingvo.core.layers_with_gpipe import GPipeTransformerStack
    >>> from lingvo_gpipe.stacks import GPipeTransformerStack
    >>> p = GPipeTransformerStack.Params().Set(  # Lingvo's params, as before.
    ...     name='stack', model_dim=4, num_encoder_layers=1,
    ...     num_decoder_layers=1, splits=[1, 2], num_micro_batches=2)
    >>> emb = p.emb_tpl
    >>> emb.token_emb.vocab_size, emb.token_emb.embedding_dim = 6, 4
    >>> emb.position_emb.embedding_dim = 4
    >>> p.softmax_tpl.input_dim, p.softmax_tpl.num_classes = 4, 6
    >>> for tpl in (p.encoder_tpl, p.decoder_tpl):
    ...   tpl.source_dim, tpl.tr_atten_tpl.num_attention_heads = 4, 1
    >>> p.pipeline_tpl.remat = 'except_last'  # Optional: our pipeline's knobs.
    >>> stack = p.Instantiate()
    >>> ids, paddings = tf.ones([3, 2], tf.int32), tf.zeros([3, 2])
    >>> xent, logits = stack.FProp(stack.theta, ids, paddings, ids, paddings,
    ...                            labels=ids, label_weights=1.0 - paddings)
    >>> logits.shape, stack.pipeline.partition, stack.BubbleFraction(2)
    (TensorShape([3, 2, 6]), [2, 2], 0.3333333333333333)

Each class subclasses Lingvo's own, so its Params are Lingvo's (plus
`pipeline_tpl`), its `__init__` builds the cells exactly as Lingvo's does, and
isinstance checks against Lingvo's classes still hold. Only the pipeline under
them changes: `PipeliningLayer` here stands between Lingvo's stack and
Lingvo's `gpipe.PipeliningLayer` in the method resolution order, so the cells
Lingvo's `__init__` passes up become one GPipeSequentialLayer child
(`from_lingvo.Convert`: the layers in order, partition = Lingvo's split)
instead of Lingvo's `cell_<k>` children, and the pipelined FProp is ours.

Our pipeline's knobs: the Lingvo params that mean the same thing
(`num_micro_batches`, `micro_batch_size`, `batch_dim`, `nested_map_fprop`,
the split, and the cells' fetched activations, which become `skips`) stay
where they are; everything else GPipeSequentialLayer has (`remat`, `devices`,
`engine`, and whatever it gains later) is set on `p.pipeline_tpl`, a
GPipeSequentialLayer.Params() passed through. Setting there what the Lingvo
params already say raises a ValueError.

Fetched activations (`FeatureExtractionLayer.act_fetch_layers` with
`num_act_outputs` / `num_act_inputs`) work as in Lingvo: FProp returns the
main outputs followed by the activations that reach the end, and a cell that
takes fewer `num_act_inputs` than arrive gets the others as inputs of its
first layer. Each goes from its FetchLayer's stage to the stage that uses it
directly (a skip, see `from_lingvo`), not through the stages between.

Differences from Lingvo's classes:

* variable names: `<parent>/<name>/<layer>/...` whatever the split (Lingvo's
  are `<parent>/cell_<k>/<layer>/...`); `lingvo_gpipe.checkpoints` converts;
* theta: `theta.pipeline.<layer>` instead of `theta.cell_<k>.<layer>`;
* `num_micro_batches` larger than the batch raises instead of being lowered;
* with `splits=1` and `num_micro_batches=1` Lingvo's `__init__` keeps the
  stateful DropoutLayer; if dropout is on, set `pipeline_tpl.remat='never'`
  there, as a recompute would draw other masks.
"""

from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import batch_major_attention
from lingvo.core import gpipe
from lingvo.core import layers_with_gpipe
from lingvo.core import py_utils

from lingvo_gpipe import from_lingvo
from lingvo_gpipe.layers import GPipeSequentialLayer


def _PipelineParams(p):
  """`p.pipeline_tpl`, checked to leave the converted params to `p`.

  Args:
    p: Params of a PipeliningLayer here.

  Returns:
    p.pipeline_tpl.

  Raises:
    ValueError: naming a field of pipeline_tpl that the Lingvo params set.
  """
  defaults = GPipeSequentialLayer.Params()
  for name in from_lingvo.CONVERTED_PARAMS:
    value, default = p.pipeline_tpl.Get(name), defaults.Get(name)
    if value != default:
      raise ValueError(
          f"pipeline_tpl.{name}={value!r}: this field comes from the layer's "
          "Lingvo params (name, cell_tpl or a stack's splits, "
          'num_micro_batches, micro_batch_size, batch_dim, nested_map_fprop, '
          "and skips from the cells' act_fetch_layers and num_act_inputs); "
          f'set it there and leave pipeline_tpl.{name}={default!r}.')
  return p.pipeline_tpl


class PipeliningLayer(gpipe.PipeliningLayer):
  """Lingvo's gpipe.PipeliningLayer, run by a GPipeSequentialLayer.

      >>> from lingvo.core import layers
      >>> cells = [gpipe.FeatureExtractionLayer.Params().Set(
      ...     name=f'cell_{k}', sub=[layers.FCLayer.Params().Set(
      ...         name=f'fc{k}', input_dim=8, output_dim=8)])
      ...          for k in range(2)]
      >>> pipe = PipeliningLayer.Params().Set(
      ...     name='pipe', cell_tpl=cells, num_micro_batches=4).Instantiate()
      >>> y = pipe.FProp(pipe.theta, tf.ones([8, 8]))
      >>> y.shape, pipe.pipeline.partition, sorted(pipe.theta.pipeline)
      (TensorShape([8, 8]), [1, 1], ['fc0', 'fc1'])

  Same Params as Lingvo's (plus `pipeline_tpl`), same FProp. The cells'
  layers are the children of `self.pipeline`.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'pipeline_tpl', GPipeSequentialLayer.Params(),
        "GPipeSequentialLayer params for our pipeline's own knobs (remat, "
        'devices, ...). Its cells, partition, micro-batching, batch_dim and '
        'nested_map_fprop come from the Lingvo params above.')
    return p

  def __init__(self, params):
    # BaseLayer's, not gpipe.SeqLayer's, which would create Lingvo's cells.
    # pylint: disable=non-parent-init-called
    base_layer.BaseLayer.__init__(self, params)
    # pylint: enable=non-parent-init-called
    p = self.params
    conversion = from_lingvo.Convert(p, _PipelineParams(p))
    self._lingvo_scopes = conversion.lingvo_scopes
    # Inside __init__ the variable scope is this layer's, <parent>/<name>.
    self._variable_scope_name = tf.get_variable_scope().name
    self.CreateChild('pipeline', conversion.params)

  def _child_variable_scope_override(self):
    # The pipeline is named as this layer and created in the parent's scope:
    # its variables are <parent>/<name>/<layer>/..., as a GPipeSequentialLayer
    # from GPipeSequentialLayer.FromPipeliningLayer(p) has them.
    return {**super()._child_variable_scope_override(), 'pipeline': []}

  @property
  def variable_scope_name(self):
    """The variable scope of the layers: '<parent>/<name>'."""
    return self._variable_scope_name

  @property
  def lingvo_scopes(self):
    """{layer name: its scope under Lingvo's naming, relative to the parent}."""
    return dict(self._lingvo_scopes)

  def BubbleFraction(self, batch_size):
    """The idle fraction (K - 1) / (M v + K - 1) of a step with this batch.

    The pipeline's (`GPipeSequentialLayer.BubbleFraction`).
    """
    return self.pipeline.BubbleFraction(batch_size)

  def FProp(self, theta, *args):
    """Runs the cells as a pipeline (see GPipeSequentialLayer.FProp)."""
    return self.pipeline.FProp(theta.pipeline, *args)


class _TransformerStackMethods:
  """What both Transformer stacks do with the pipeline's layers by name.

  Listed before Lingvo's stack among the bases, so that these methods replace
  Lingvo's, which look the layers up in `cell_<k>` children.
  """

  def _Layer(self, name):
    return self.pipeline.children[name]

  def Logits(self, theta, inputs):
    return self._Layer('softmax').Logits(theta.pipeline.softmax, inputs)

  def GetEncoders(self):
    return [
        self._Layer(f'encoder_{i}')
        for i in range(self.params.num_encoder_layers)
    ]

  def GetDecoders(self):
    return [
        self._Layer(f'decoder_{i}')
        for i in range(self.params.num_decoder_layers)
    ]

  def _CheckInputs(self, target_input, target_paddings, source_segment_id,
                   source_segment_pos):
    """Raises ValueError for a missing input that Lingvo's FProp asserts."""
    p = self.params
    required = {}
    if p.num_decoder_layers > 0:
      required.update(target_input=target_input,
                      target_paddings=target_paddings)
    if p.packed_input:
      required.update(source_segment_id=source_segment_id,
                      source_segment_pos=source_segment_pos)
    missing = [name for name, value in required.items() if value is None]
    if missing:
      raise ValueError(
          f'{p.name}: FProp needs {", ".join(missing)} with '
          f'num_decoder_layers={p.num_decoder_layers} and '
          f'packed_input={p.packed_input}.')

  def _PerExampleXent(self, theta, logits, labels, label_weights,
                      target_paddings):
    """The softmax cross-entropy of Lingvo's stacks' FProp, per position.

    Args:
      theta: The stack's theta.
      logits: [time, batch, classes], or [batch, time, classes] if batch_dim
        is 0.
      labels: int [time, batch] or [batch, time].
      label_weights: float, as labels.
      target_paddings: float, as labels; read by label smoothing.

    Returns:
      (per-position cross-entropy shaped as labels, logits).
    """
    p = self.params
    num_classes = p.softmax_tpl.num_classes
    target_probs = None
    if p.label_smoothing:
      if p.batch_dim:  # Time-major; the smoother takes [batch, time].
        target_probs = tf.transpose(
            self.smoother.FProp(
                theta.smoother, tf.transpose(target_paddings),
                tf.transpose(labels), target_ids=None), [1, 0, 2])
      else:
        target_probs = self.smoother.FProp(
            theta.smoother, target_paddings, labels, target_ids=None)
      target_probs = tf.reshape(target_probs, [-1, num_classes])
    xent, _ = self._Layer('softmax').XentLossFromLogits(
        theta.pipeline.softmax,
        tf.reshape(logits, [-1, num_classes]),
        class_weights=tf.reshape(label_weights, [-1]),
        class_ids=tf.reshape(labels, [-1]),
        class_probabilities=target_probs)
    return tf.reshape(xent, tf.shape(logits)[:2]), logits


class GPipeTransformerStack(_TransformerStackMethods,
                            layers_with_gpipe.GPipeTransformerStack,
                            PipeliningLayer):
  """Lingvo's GPipeTransformerStack (time-major by default) on our pipeline."""

  def EncoderEmbedFPropDefaultTheta(self, source_id, source_task_id=None):
    return self._Layer('emb').GetEncoderEmbeddingsDefaultTheta(
        source_id, source_task_id)

  def DecoderEmbedFPropDefaultTheta(self, tgt_id, tgt_task_id=None, t=None):
    return self._Layer('emb').GetDecoderEmbeddingsDefaultTheta(
        tgt_id, tgt_task_id, t)

  def FProp(self,
            theta,
            source_input,
            source_paddings,
            target_input=None,
            target_paddings=None,
            source_segment_id=None,
            target_segment_id=None,
            labels=None,
            label_weights=None,
            source_segment_pos=None,
            target_segment_pos=None,
            source_task_id=None,
            target_task_id=None):
    """Lingvo's GPipeTransformerStack.FProp: same arguments and returns.

    Args:
      theta: The stack's theta.
      source_input: int ids [time, batch] ([batch, time] if batch_dim is 0).
      source_paddings: float 0/1, as source_input.
      target_input: int ids, needed with decoder layers.
      target_paddings: float 0/1, needed with decoder layers.
      source_segment_id: int, needed with packed_input.
      target_segment_id: int, for packed inputs.
      labels: int label ids, for the loss.
      label_weights: float, for the loss.
      source_segment_pos: int positions, needed with packed_input.
      target_segment_pos: int positions, for packed inputs.
      source_task_id: int task ids, or None.
      target_task_id: int task ids, or None.

    Returns:
      Without softmax_tpl the last layer's output; else (per-position
      cross-entropy shaped as labels, logits [time, batch, classes]).
    """
    self._CheckInputs(target_input, target_paddings, source_segment_id,
                      source_segment_pos)
    logits = self.pipeline.FProp(
        theta.pipeline, source_input, source_paddings, target_input,
        target_paddings, source_segment_id, target_segment_id,
        source_segment_pos, target_segment_pos, source_task_id,
        target_task_id)
    if not self.params.softmax_tpl:
      return logits
    return self._PerExampleXent(theta, logits, labels, label_weights,
                                target_paddings)


class GPipeEvolvedTransformerStack(
    GPipeTransformerStack, layers_with_gpipe.GPipeEvolvedTransformerStack):
  """Lingvo's GPipeEvolvedTransformerStack on our pipeline."""


class GPipeBatchMajorTransformerStack(
    _TransformerStackMethods, layers_with_gpipe.GPipeBatchMajorTransformerStack,
    PipeliningLayer):
  """Lingvo's GPipeBatchMajorTransformerStack on our pipeline."""

  def EncoderEmbedFPropDefaultTheta(self, source_id):
    return self._Layer('emb').GetEncoderEmbeddingsDefaultTheta(source_id)

  def DecoderEmbedFPropDefaultTheta(self, tgt_id, t=None):
    return self._Layer('emb').GetDecoderEmbeddingsDefaultTheta(tgt_id, t)

  def _SegmentMasks(self, source_segment_id, target_segment_id, target_input):
    """The 0/1 attention masks of packed inputs, [batch, 1, time, time].

    Args:
      source_segment_id: int [batch, source time].
      target_segment_id: int [batch, target time], or None.
      target_input: int [batch, target time] (with target_segment_id).

    Returns:
      (encoder self-attention, decoder self-attention with the causal mask,
      decoder cross-attention) masks; the decoder's are None without
      target_segment_id.
    """
    dtype = py_utils.FPropDtype(self.params)

    def Mask(query_ids, key_ids):
      return batch_major_attention.SegmentMask(
          query_ids, key_ids, dtype, apply_dtype_min=False)

    encoder = Mask(source_segment_id, source_segment_id)
    if target_segment_id is None:
      return encoder, None, None
    causal = batch_major_attention.CausalPadding(
        tf.shape(target_input)[1], dtype=dtype)
    decoder = tf.math.maximum(causal[tf.newaxis, tf.newaxis],
                              Mask(target_segment_id, target_segment_id))
    return encoder, decoder, Mask(target_segment_id, source_segment_id)

  def FProp(self,
            theta,
            source_input,
            source_paddings,
            target_input=None,
            target_paddings=None,
            source_segment_id=None,
            target_segment_id=None,
            labels=None,
            label_weights=None,
            source_segment_pos=None,
            target_segment_pos=None):
    """Lingvo's GPipeBatchMajorTransformerStack.FProp: same args and returns.

    Args:
      theta: The stack's theta.
      source_input: int ids [batch, time].
      source_paddings: float 0/1 [batch, time].
      target_input: int ids [batch, time], needed with decoder layers.
      target_paddings: float 0/1 [batch, time], needed with decoder layers.
      source_segment_id: int [batch, time], needed with packed_input.
      target_segment_id: int [batch, time], for packed inputs.
      labels: int label ids [batch, time].
      label_weights: float [batch, time].
      source_segment_pos: int [batch, time], needed with packed_input.
      target_segment_pos: int [batch, time], for packed inputs.

    Returns:
      (per-position cross-entropy [batch, time], logits [batch, time,
      classes]).
    """
    self._CheckInputs(target_input, target_paddings, source_segment_id,
                      source_segment_pos)
    masks = (None, None, None)
    if self.params.packed_input:
      masks = self._SegmentMasks(source_segment_id, target_segment_id,
                                 target_input)
    logits = self.pipeline.FProp(theta.pipeline, source_input,
                                 source_paddings, target_input,
                                 target_paddings, *masks, source_segment_pos,
                                 target_segment_pos)
    return self._PerExampleXent(theta, logits, labels, label_weights,
                                target_paddings)
