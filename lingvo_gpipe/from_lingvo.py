"""Lingvo's GPipe params as GPipeSequentialLayer params.

Lingvo's `gpipe.PipeliningLayer` runs `cell_tpl`, one cell per device of the
model split. A cell is usually a `FeatureExtractionLayer` whose `sub` is a run
of layers; the stacks of `layers_with_gpipe` (`GPipeTransformerStack`,
`GPipeBatchMajorTransformerStack`, `GPipeEvolvedTransformerStack`) build such
cells, named `cell_<k>`, in their `__init__` from `splits`. `Convert` returns
the same pipeline as GPipeSequentialLayer params (users call it as
`GPipeSequentialLayer.FromPipeliningLayer`):

    lingvo_p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
        name='stack', num_encoder_layers=2, num_decoder_layers=2,
        splits=[1, 4], num_micro_batches=4, ...)
    p = GPipeSequentialLayer.FromPipeliningLayer(lingvo_p)
    # p.cell_tpl: emb, encoder_0, encoder_1, decoder_0, decoder_1, softmax
    # p.partition == [2, 4], p.num_micro_batches == 4, p.batch_dim == 1
    p.remat = 'except_last'  # Our knobs are free to set.

What carries over:

* the layers of each `FeatureExtractionLayer`, in order, named as Lingvo names
  them (`variable_name_prefix` + name), with the cell's base-layer params
  (dtype, random_seed, ...) copied onto them as Lingvo's CreateChild does; a
  cell of any other class is one layer;
* the split: `partition` lists the layers of each Lingvo cell (an empty
  `FeatureExtractionLayer` would be an empty stage: it is left out with a
  warning, one stage fewer);
* `num_micro_batches` or `micro_batch_size`, `batch_dim`, `nested_map_fprop`
  and the base-layer params;
* devices: with `devices=None` stage k runs on the model split's device k,
  as Lingvo's cell k does.

What does not, with a ValueError: `SeqLayer.before_tpl` (Lingvo runs those
layers on the whole batch before splitting it), a `FeatureExtractionLayer`'s
activation side channels (`num_act_inputs`, `num_act_outputs`,
`act_fetch_layers`), both `micro_batch_size` and `num_micro_batches` > 1
(GPipeSequentialLayer takes one), and two layers of the same name in
different cells. `state_dtype` is not needed: every tensor keeps its own
dtype. Lingvo lowers M to the batch size when M is larger; a
GPipeSequentialLayer raises instead.

A stack's FProp does more than its pipeline: the batch-major stack computes
segment masks before it, and both compute the softmax cross-entropy (with
label smoothing) after it. `Convert` gives the pipeline alone;
`lingvo_gpipe.stacks` has the stacks whole.

Variable names: Lingvo creates its cells in the PipeliningLayer's parent
scope (`<parent>/<cell name>/<layer>/...`), a GPipeSequentialLayer under its
own name (`<parent>/<name>/<layer>/...`, whatever the split).
`Conversion.lingvo_scopes` maps each layer to its Lingvo scope relative to the
parent; `lingvo_gpipe.checkpoints` renames checkpoints with it.
"""

from typing import Dict, List, NamedTuple, Tuple

from absl import logging
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import gpipe
from lingvo.core import hyperparams

# GPipeSequentialLayer params that `Convert` sets from Lingvo's params.
CONVERTED_PARAMS = ('name', 'cell_tpl', 'num_stages', 'partition',
                    'num_micro_batches', 'micro_batch_size', 'batch_dim',
                    'nested_map_fprop')


class Conversion(NamedTuple):
  """A Lingvo pipeline as GPipeSequentialLayer params.

  Attributes:
    params: The GPipeSequentialLayer params.
    lingvo_scopes: {layer name: the layer's variable scope in Lingvo, relative
      to the PipeliningLayer's parent scope}, e.g. {'emb': 'cell_0/emb'}.
  """
  params: hyperparams.InstantiableParams
  lingvo_scopes: Dict[str, str]


def _CheckPipelineParams(p):
  """Raises ValueError for pipeline-wide params that cannot carry over.

  Args:
    p: Params of a gpipe.PipeliningLayer (cell_tpl need not be filled in).
  """
  cls = getattr(p, 'cls', None)
  if not (isinstance(cls, type) and issubclass(cls, gpipe.PipeliningLayer)):
    raise ValueError(
        f'p.cls={cls!r} is not a Lingvo gpipe.PipeliningLayer; give the params '
        'of a PipeliningLayer or of a stack of layers_with_gpipe.')
  if p.before_tpl:
    raise ValueError(
        f'before_tpl={[b.name for b in p.before_tpl]} is not supported: '
        'Lingvo runs those layers on the whole batch before the pipeline. '
        'Run them before this layer, or make them the first layers of '
        'cell_tpl[0] to run them per micro-batch; before_tpl must be [].')
  if p.micro_batch_size is not None and p.num_micro_batches != 1:
    raise ValueError(
        f'micro_batch_size={p.micro_batch_size} and num_micro_batches='
        f'{p.num_micro_batches} are both set: GPipeSequentialLayer takes one '
        '(Lingvo requires their product to be the batch size). Keep '
        'num_micro_batches and set micro_batch_size=None.')


def BuiltParams(p: hyperparams.InstantiableParams
               ) -> hyperparams.InstantiableParams:
  """The params a PipeliningLayer runs with, `cell_tpl` filled in.

  A PipeliningLayer runs `p.cell_tpl`; a subclass such as a stack of
  `layers_with_gpipe` builds its cells in `__init__`. Subclasses are built in
  a throwaway graph (their variables are never initialized) and their final
  params read back, so that whatever their `__init__` does is what converts.

  Args:
    p: Params of a gpipe.PipeliningLayer or a subclass.

  Returns:
    Params with `cell_tpl` as the layer runs it.

  Raises:
    ValueError: before building anything, if `p` are not params of a
      PipeliningLayer or have pipeline-wide params that cannot carry over.
  """
  _CheckPipelineParams(p)
  if p.cls is gpipe.PipeliningLayer:
    return p.Copy()
  with tf.Graph().as_default():
    return p.Instantiate().params.Copy()


def _CellLayers(k: int, cell) -> List[Tuple[hyperparams.Params, str]]:
  """(layer params, Lingvo scope) of each layer of Lingvo cell k.

  Args:
    k: The cell's index in cell_tpl (for messages).
    cell: The cell's params.

  Returns:
    A list of (params, scope relative to the PipeliningLayer's parent).

  Raises:
    ValueError: for activation side channels, which have no equivalent.
  """
  if cell.cls is not gpipe.FeatureExtractionLayer:
    return [(cell.Copy(), cell.name)]
  for name, unsupported in (('num_act_inputs', cell.num_act_inputs),
                            ('num_act_outputs', cell.num_act_outputs),
                            ('act_fetch_layers', cell.act_fetch_layers)):
    if unsupported:
      raise ValueError(
          f'cell_tpl[{k}] ({cell.name!r}) has {name}={unsupported!r}: '
          'activation inputs and fetched activations between cells are not '
          'supported; only 0 and [] are. Return such tensors as outputs of '
          'the layers instead.')
  layers = []
  for sub in cell.sub:
    layer = base_layer.BaseLayer.CopyBaseParams(cell, sub.Copy())
    layer.name = cell.variable_name_prefix + sub.name
    layers.append((layer, f'{cell.name}/{layer.name}'))
  return layers


def Convert(p: hyperparams.InstantiableParams,
            sequential_params: hyperparams.InstantiableParams) -> Conversion:
  """Lingvo PipeliningLayer params as GPipeSequentialLayer params.

  Args:
    p: Params of a gpipe.PipeliningLayer whose `cell_tpl` is filled in (see
      `BuiltParams` for the stacks, which build it in `__init__`).
    sequential_params: GPipeSequentialLayer params to fill in; its fields
      other than CONVERTED_PARAMS (remat, devices, ...) are kept.

  Returns:
    A Conversion: the filled-in params and the Lingvo scope of each layer.

  Raises:
    ValueError: naming the parameter and value that cannot carry over.
  """
  _CheckPipelineParams(p)
  cells, partition, scopes = [], [], {}
  for k, cell in enumerate(p.cell_tpl):
    layers = _CellLayers(k, cell)
    if not layers:
      logging.warning(
          '%s: cell_tpl[%d] (%r) has no layers; its stage is left out (%d '
          'stages instead of %d).', p.name, k, cell.name,
          len(p.cell_tpl) - 1, len(p.cell_tpl))
      continue
    partition.append(len(layers))
    for layer, scope in layers:
      if layer.name in scopes:
        raise ValueError(
            f'cell_tpl has two layers named {layer.name!r} (Lingvo scopes '
            f'{scopes[layer.name]!r} and {scope!r}); GPipeSequentialLayer '
            'needs unique layer names. Rename one, or give the cells '
            'distinct variable_name_prefix values.')
      cells.append(layer)
      scopes[layer.name] = scope
  if not cells:
    raise ValueError(f'cell_tpl={[c.name for c in p.cell_tpl]} has no '
                     'layers; give at least one.')
  out = base_layer.BaseLayer.CopyBaseParams(p, sequential_params.Copy())
  out.Set(name=p.name, cell_tpl=cells, num_stages=len(partition),
          partition=partition, num_micro_batches=p.num_micro_batches,
          micro_batch_size=p.micro_batch_size, batch_dim=p.batch_dim,
          nested_map_fprop=p.nested_map_fprop)
  return Conversion(out, scopes)
