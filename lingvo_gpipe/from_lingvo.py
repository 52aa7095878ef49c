"""Lingvo's GPipe params as GPipeSequentialLayer params.

Lingvo's `gpipe.PipeliningLayer` runs `cell_tpl`, one cell per device of the
model split. A cell is usually a `FeatureExtractionLayer` whose `sub` is a run
of layers; the stacks of `layers_with_gpipe` (`GPipeTransformerStack`,
`GPipeBatchMajorTransformerStack`, `GPipeEvolvedTransformerStack`) build such
cells, named `cell_<k>`, in their `__init__` from `splits`. `Convert` returns
the same pipeline as GPipeSequentialLayer params (users call it as
`GPipeSequentialLayer.FromPipeliningLayer`). A tiny batch-major stack:

    >>> from lingvo.core import layers_with_gpipe
    >>> from lingvo_gpipe import GPipeSequentialLayer
    >>> Stack = layers_with_gpipe.GPipeBatchMajorTransformerStack
    >>> lingvo_p = Stack.Params().Set(
    ...     name='stack', model_dim=4, num_encoder_layers=2,
    ...     num_decoder_layers=2, splits=[1, 4], num_micro_batches=4)
    >>> emb, softmax = lingvo_p.emb_tpl, lingvo_p.softmax_tpl
    >>> emb.token_emb.vocab_size, softmax.num_classes = 8, 8
    >>> emb.token_emb.embedding_dim = emb.position_emb.embedding_dim = 4
    >>> softmax.input_dim = 4
    >>> for tpl in (lingvo_p.encoder_tpl, lingvo_p.decoder_tpl):
    ...   tpl.input_dim, tpl.tr_atten_tpl.num_heads = 4, 1
    >>> p = GPipeSequentialLayer.FromPipeliningLayer(lingvo_p)
    >>> [c.name for c in p.cell_tpl]
    ['emb', 'encoder_0', 'encoder_1', 'decoder_0', 'decoder_1', 'softmax']
    >>> p.partition, p.num_micro_batches, p.batch_dim
    ([2, 4], 4, 0)
    >>> p.remat = 'except_last'  # Our knobs are free to set.

What carries over:

* the layers of each `FeatureExtractionLayer`, in order, named as Lingvo names
  them (`variable_name_prefix` + name), with the cell's base-layer params
  (dtype, random_seed, ...) copied onto them as Lingvo's CreateChild does; a
  cell of any other class is one layer;
* the split: `partition` lists the layers of each Lingvo cell (an empty
  `FeatureExtractionLayer` would be an empty stage: it is left out with a
  warning, one stage fewer);
* `num_micro_batches` and `micro_batch_size` (both set: their product must
  be the batch size, as in Lingvo), `batch_dim`, `nested_map_fprop` and the
  base-layer params;
* devices: with `devices=None` stage k runs on the model split's device k,
  as Lingvo's cell k does;
* fetched activations (`act_fetch_layers`, `num_act_outputs`,
  `num_act_inputs`): as `skips` (see below).

Fetched activations. A `FeatureExtractionLayer` appends the activation its
`act_fetch_layers` (`layers.FetchLayer`s) cached to its outputs, after the
last `num_act_inputs` of its inputs, which it passes through untouched; the
next cell's sub-layers see only the inputs before its own last
`num_act_inputs`. So each fetched activation rides along the cells' trailing
outputs until a cell takes fewer `num_act_inputs` than arrive (the first
ones become ordinary inputs of its first layer) or the pipeline ends (Lingvo
returns it after the main outputs). `Convert` follows each one and makes it
a skip: (the FetchLayer, the first layer of the cell that consumes it) or
(the FetchLayer, None) for the pipeline's output, in Lingvo's order. The
tensor then goes from the fetching stage's device to the consuming one's
directly, instead of through every stage in between. A fetched FetchLayer
becomes an `ActivationFetchLayer` (the same layer, which raises if it is
given more than one tensor: Lingvo fetches only the first of several, a skip
carries them all).

What does not carry over, with a ValueError: `SeqLayer.before_tpl` (Lingvo
runs those layers on the whole batch before splitting it), two layers of the
same name in different cells, and the activation passing that is no skip:
`num_act_inputs` in the first cell (pipeline inputs passed through) or
larger than the number of fetched activations that arrive (layer outputs
passed through), `act_fetch_layers` naming anything but a
`layers.FetchLayer` of the cell, `num_act_outputs != num_act_inputs +
len(act_fetch_layers)` (Lingvo asserts it) and fetched activations with
`nested_map_fprop` (Lingvo's pipeline passes only the NestedMap between its
cells). `state_dtype` is not needed: every tensor keeps its own dtype.
Lingvo lowers M to the batch size when M is larger (and micro_batch_size is
not set); a GPipeSequentialLayer raises instead.

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

from typing import Dict, List, NamedTuple, Optional, Tuple

from absl import logging
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import gpipe
from lingvo.core import hyperparams
from lingvo.core import layers as lingvo_layers

# GPipeSequentialLayer params that `Convert` sets from Lingvo's params.
CONVERTED_PARAMS = ('name', 'cell_tpl', 'num_stages', 'partition',
                    'num_micro_batches', 'micro_batch_size', 'batch_dim',
                    'nested_map_fprop', 'skips')


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


class ActivationFetchLayer(lingvo_layers.FetchLayer):
  """Lingvo's FetchLayer, fetched by its cell: one tensor in, the same out.

  `Convert` gives a FetchLayer named in `act_fetch_layers` this class: its
  output is the skip that carries the activation on, and Lingvo fetches only
  the first of several inputs, where a skip would carry them all.
  """

  def FProp(self, theta, *args):
    if len(args) != 1:
      raise ValueError(
          f'{self.path}: a FetchLayer named in act_fetch_layers gets '
          f'{len(args)} tensors; Lingvo fetches only the first, which has no '
          'equivalent. Give it one tensor (put it after a layer with one '
          'output).')
    return super().FProp(theta, *args)


def _IsFeatureExtraction(cell) -> bool:
  return cell.cls is gpipe.FeatureExtractionLayer


def _CellLayers(cell) -> List[Tuple[hyperparams.Params, str]]:
  """(layer params, Lingvo scope) of each layer of a Lingvo cell.

  Args:
    cell: The cell's params.

  Returns:
    A list of (params, scope relative to the PipeliningLayer's parent).
  """
  if not _IsFeatureExtraction(cell):
    return [(cell.Copy(), cell.name)]
  layers = []
  for sub in cell.sub:
    layer = base_layer.BaseLayer.CopyBaseParams(cell, sub.Copy())
    layer.name = cell.variable_name_prefix + sub.name
    layers.append((layer, f'{cell.name}/{layer.name}'))
  return layers


def _CheckActivationParams(k: int, cell, layer_names: List[str],
                           nested_map_fprop: bool) -> None:
  """Raises ValueError for act fields of cell k that cannot become skips.

  Args:
    k: The cell's index in cell_tpl.
    cell: Params of a FeatureExtractionLayer.
    layer_names: The names of its layers (variable_name_prefix included, as
      `act_fetch_layers` names them).
    nested_map_fprop: The pipeline's nested_map_fprop.
  """
  fetch = list(cell.act_fetch_layers or [])
  where = f'cell_tpl[{k}] ({cell.name!r})'
  for name, value in (('num_act_inputs', cell.num_act_inputs),
                      ('num_act_outputs', cell.num_act_outputs)):
    if not isinstance(value, int) or value < 0:
      raise ValueError(f'{where} has {name}={value!r}; use an int >= 0.')
  if cell.num_act_outputs != cell.num_act_inputs + len(fetch):
    raise ValueError(
        f'{where} has num_act_outputs={cell.num_act_outputs}, '
        f'num_act_inputs={cell.num_act_inputs} and act_fetch_layers={fetch}; '
        'Lingvo requires num_act_outputs == num_act_inputs + '
        f'len(act_fetch_layers) = {cell.num_act_inputs + len(fetch)}.')
  if nested_map_fprop and (fetch or cell.num_act_inputs):
    raise ValueError(
        f'{where} has act_fetch_layers={fetch} and num_act_inputs='
        f'{cell.num_act_inputs} with nested_map_fprop=True: the cells pass '
        'one NestedMap, with no place for fetched activations (Lingvo\'s '
        'PipeliningLayer cannot run them either). Put the activation into '
        'the NestedMap, or use act_fetch_layers=[] and num_act_inputs=0.')
  by_name = {cell.variable_name_prefix + sub.name: sub for sub in cell.sub}
  for name in fetch:
    if name not in by_name:
      raise ValueError(
          f'{where} has act_fetch_layers={fetch}: {name!r} is not one of its '
          f'layers {layer_names}.')
    if by_name[name].cls is not lingvo_layers.FetchLayer:
      raise ValueError(
          f'{where} has act_fetch_layers={fetch}: {name!r} is a '
          f'{by_name[name].cls.__name__}; only lingvo.core.layers.FetchLayer '
          'caches an activation to fetch.')


def _ActivationSkips(cells, cell_layers: List[List[str]],
                     nested_map_fprop: bool
                    ) -> List[Tuple[str, Optional[str]]]:
  """The skips that carry the fetched activations of Lingvo's cells.

  Each fetched activation rides along the cells' trailing outputs (see the
  module docstring) until a cell takes fewer num_act_inputs than arrive or
  the pipeline ends.

  Args:
    cells: `cell_tpl` of the PipeliningLayer.
    cell_layers: The names of each cell's layers, in order.
    nested_map_fprop: The pipeline's nested_map_fprop.

  Returns:
    (FetchLayer name, name of the layer that receives it or None for the
    output) pairs, in the order the receivers take them.

  Raises:
    ValueError: naming the cell and field that has no equivalent.
  """
  riding = []  # FetchLayers whose activations trail the current outputs.
  skips = []
  for k, (cell, names) in enumerate(zip(cells, cell_layers)):
    if not _IsFeatureExtraction(cell):
      # A plain layer takes every output of the cell before as its input.
      skips += [(fetch, names[0]) for fetch in riding]
      riding = []
      continue
    _CheckActivationParams(k, cell, names, nested_map_fprop)
    passed = cell.num_act_inputs
    if passed > len(riding):
      if k == 0 or not any(cell_layers[:k]):
        source = 'the last pipeline inputs'
      else:
        source = 'outputs of the layers of the cells before it'
      raise ValueError(
          f'cell_tpl[{k}] ({cell.name!r}) has num_act_inputs={passed} but '
          f'only {len(riding)} fetched activation(s) {riding} reach it: it '
          f'would pass {source} through untouched, which is no skip from a '
          'layer. Lower num_act_inputs, or fetch those tensors with a '
          'FetchLayer in act_fetch_layers.')
    if not names:  # An empty cell passes everything through.
      continue
    consumed, riding = riding[:len(riding) - passed], riding[len(riding) -
                                                             passed:]
    skips += [(fetch, names[0]) for fetch in consumed]
    riding += list(cell.act_fetch_layers or [])
  return skips + [(fetch, None) for fetch in riding]


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
  cells, partition, scopes, cell_layers = [], [], {}, []
  for k, cell in enumerate(p.cell_tpl):
    layers = _CellLayers(cell)
    cell_layers.append([layer.name for layer, _ in layers])
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
  skips = _ActivationSkips(p.cell_tpl, cell_layers, p.nested_map_fprop)
  fetched = {source for source, _ in skips}
  for layer in cells:
    if layer.name in fetched:
      layer.cls = ActivationFetchLayer
  out = base_layer.BaseLayer.CopyBaseParams(p, sequential_params.Copy())
  out.Set(name=p.name, cell_tpl=cells, num_stages=len(partition),
          partition=partition, num_micro_batches=p.num_micro_batches,
          micro_batch_size=p.micro_batch_size, batch_dim=p.batch_dim,
          nested_map_fprop=p.nested_map_fprop, skips=skips)
  return Conversion(out, scopes)
