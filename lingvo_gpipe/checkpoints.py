"""Checkpoints between Lingvo's GPipe variable names and ours.

Lingvo's PipeliningLayer (and its stacks) create each cell's layers in the
parent's scope, under the cell: `<parent>/cell_<k>/<layer>/...`, so the names
depend on the split. The same model on `lingvo_gpipe.stacks` names them
`<parent>/<name>/<layer>/...` for every split. `ConvertCheckpoint` renames a
checkpoint one way or the other, for a model built with `lingvo_gpipe.stacks`.
Lingvo's pipeline of two cells saves a checkpoint, which ours then reads:

    >>> import shutil, tempfile
    >>> from lingvo.core import gpipe, layers
    >>> def Params(cls):
    ...   fc = [layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=4,
    ...                                     output_dim=4) for i in range(3)]
    ...   return cls.Params().Set(name='pipe', cell_tpl=[
    ...       gpipe.FeatureExtractionLayer.Params().Set(name='cell_0',
    ...                                                 sub=fc[:2]),
    ...       gpipe.FeatureExtractionLayer.Params().Set(name='cell_1',
    ...                                                 sub=fc[2:])])
    >>> tmp = tempfile.mkdtemp()
    >>> with tf.Graph().as_default():
    ...   _ = Params(gpipe.PipeliningLayer).Instantiate()
    ...   with tf.Session() as session:
    ...     session.run(tf.global_variables_initializer())
    ...     lingvo_ckpt = tf.train.Saver().save(
    ...         session, os.path.join(tmp, 'lingvo', 'ckpt-0'))
    >>> with tf.Graph().as_default():
    ...   model = Params(stacks.PipeliningLayer).Instantiate()  # Names only.
    ...   renames = ConvertCheckpoint(model, lingvo_ckpt,
    ...                               os.path.join(tmp, 'ours', 'ckpt-0'),
    ...                               to='ours')
    >>> renames['cell_0/fc1/w/var'], renames['cell_1/fc2/w/var']
    ('pipe/fc1/w/var', 'pipe/fc2/w/var')
    >>> shutil.rmtree(tmp)

Rules:

* only a pipeline layer's own variables move, with everything named after
  them (optimizer slots such as `.../var/Adam`); other keys (global_step,
  beta1_power, other layers) are copied unchanged;
* to='ours' reads from the checkpoint which Lingvo cell held each layer, so a
  checkpoint of any split converts; to='lingvo' writes the split of the
  model's params (Lingvo's `splits` or `cell_tpl`);
* a key inside a pipeline's names that no layer of the model explains, or a
  variable of the model that the checkpoint lacks, raises a ValueError naming
  them, before anything is written; so does an existing output.

Name-based checkpoints only (tf.compat.v1 Saver, as Lingvo's trainers write).
"""

import collections
import os
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Sequence

from lingvo import compat as tf
from lingvo.core import py_utils

from lingvo_gpipe import stacks

DIRECTIONS = ('ours', 'lingvo')
_MAX_LISTED = 10


class _Pipeline(NamedTuple):
  """One pipeline of a model, as names.

  Attributes:
    parent: The parent's variable scope, ending in '/' ('' at the top).
    scope: Our scope of its layers, '<parent><name>/'.
    lingvo_scopes: {layer: its Lingvo scope relative to the parent} for the
      split of the model's params.
    cell_names: The Lingvo cells its layers may be in, for any split.
  """
  parent: str
  scope: str
  lingvo_scopes: Dict[str, str]
  cell_names: FrozenSet[str]


def _VariableName(v) -> str:
  return v.name[:-2] if v.name.endswith(':0') else v.name


def _Pipelines(model) -> List[_Pipeline]:
  """The `stacks.PipeliningLayer`s under `model` (a built Lingvo layer)."""
  found, todo = [], [model]
  while todo:
    layer = todo.pop()
    todo.extend(py_utils.Flatten(layer.children))
    if not isinstance(layer, stacks.PipeliningLayer):
      continue
    head, _, _ = layer.variable_scope_name.rpartition('/')
    parent = head + '/' if head else ''
    lingvo_scopes = layer.lingvo_scopes
    cells = {s.split('/')[0] for s in lingvo_scopes.values() if '/' in s}
    # A stack names its cells cell_<k> after its split, which may differ
    # from the split that wrote a Lingvo checkpoint.
    cells |= {f'cell_{k}' for k in range(len(lingvo_scopes))}
    found.append(
        _Pipeline(parent, layer.variable_scope_name + '/', lingvo_scopes,
                  frozenset(cells)))
  return found


def _Listed(names: Iterable[str]) -> str:
  names = sorted(names)
  more = len(names) - _MAX_LISTED
  return ', '.join(names[:_MAX_LISTED]) + (f' and {more} more' if more > 0
                                           else '')


def _LingvoScopes(pipe: _Pipeline, keys: Sequence[str]) -> Dict[str, str]:
  """{layer: its Lingvo scope} as the checkpoint with `keys` has them.

  Args:
    pipe: The pipeline.
    keys: The keys of a checkpoint in Lingvo's names.

  Returns:
    The Lingvo scope (relative to the parent) of each layer with variables.

  Raises:
    ValueError: if a layer's variables are in more than one Lingvo cell.
  """
  cells_of = collections.defaultdict(set)  # Layer -> cells holding it.
  for key in keys:
    if key.startswith(pipe.parent):
      parts = key[len(pipe.parent):].split('/')
      if len(parts) > 2 and parts[0] in pipe.cell_names:
        cells_of[parts[1]].add(parts[0])
  scopes = {}
  for layer, scope in pipe.lingvo_scopes.items():
    cells = cells_of[layer]
    if '/' not in scope or not cells:  # A cell of its own, or no variables.
      scopes[layer] = scope
    elif len(cells) == 1:
      scopes[layer] = f'{cells.pop()}/{layer}'
    else:
      raise ValueError(
          f'layer {layer!r} of {pipe.scope[:-1]!r} has variables in Lingvo '
          f'cells {sorted(cells)} of the checkpoint; expected one.')
  return scopes


def _Rename(name: str, rules: Dict[str, str]) -> str:
  """`name` with its prefix replaced by the first rule that matches."""
  for source, target in rules.items():
    if name.startswith(source):
      return target + name[len(source):]
  return name


def Renames(model, keys: Sequence[str], to: str) -> Dict[str, str]:
  """{checkpoint key: new key} for every key, converting towards `to`.

  Args:
    model: A built Lingvo layer (model, task or stack) whose pipelines are
      `lingvo_gpipe.stacks` layers.
    keys: The variable names in the checkpoint.
    to: 'ours' (the checkpoint has Lingvo's names) or 'lingvo'.

  Returns:
    A dict with one entry per key.

  Raises:
    ValueError: for an unknown direction, a model without pipelines, keys
      inside a pipeline that no layer explains, model variables the
      checkpoint lacks, or two keys that would get the same name.
  """
  if to not in DIRECTIONS:
    raise ValueError(f'to={to!r} must be one of {list(DIRECTIONS)}.')
  pipelines = _Pipelines(model)
  if not pipelines:
    raise ValueError(
        f'{model.params.name!r} has no lingvo_gpipe.stacks pipeline; build '
        'the model with lingvo_gpipe.stacks (the one-import change).')
  to_ours = {}  # Lingvo prefix -> our prefix.
  namespaces = []  # Source prefixes that only these rules may explain.
  for pipe in pipelines:
    lingvo = _LingvoScopes(pipe, keys) if to == 'ours' else pipe.lingvo_scopes
    for layer, scope in lingvo.items():
      to_ours[f'{pipe.parent}{scope}/'] = f'{pipe.scope}{layer}/'
    if to == 'lingvo':
      namespaces.append(pipe.scope)
    else:
      cells = {s.split('/')[0] for s in lingvo.values()} | pipe.cell_names
      namespaces += [f'{pipe.parent}{c}/' for c in cells]
  to_lingvo = {ours: lingvo for lingvo, ours in to_ours.items()}
  rules, inverse = (to_ours, to_lingvo) if to == 'ours' else (to_lingvo,
                                                              to_ours)
  renames = {key: _Rename(key, rules) for key in keys}
  unexplained = [
      key for key, new in renames.items()
      if new == key and any(key.startswith(n) for n in namespaces)
  ]
  if unexplained:
    raise ValueError(
        f'{len(unexplained)} checkpoint variables are inside a pipeline of the '
        f'model but belong to none of its layers: {_Listed(unexplained)}.')
  # Each variable of the model, in the checkpoint's naming.
  expected = {
      _Rename(_VariableName(v), inverse) for v in model.vars.Flatten()
  }
  missing = expected - set(keys)
  if missing:
    raise ValueError(
        f"the checkpoint lacks {len(missing)} of the model's variables: "
        f'{_Listed(missing)}; is it a checkpoint of this model, in the naming '
        f'that to={to!r} converts from?')
  targets = {}
  for key, new in renames.items():
    if new in targets:
      raise ValueError(f'checkpoint variables {targets[new]!r} and {key!r} '
                       f'would both be named {new!r}.')
    targets[new] = key
  return renames


def _CheckOutput(input_prefix: str, output_prefix: str) -> None:
  """Raises ValueError if writing `output_prefix` could touch the input."""
  if os.path.abspath(output_prefix) == os.path.abspath(input_prefix):
    raise ValueError(f'output {output_prefix!r} is the input checkpoint; '
                     'give another prefix.')
  existing = tf.io.gfile.glob(output_prefix + '.*')
  if existing:
    raise ValueError(f'output {output_prefix!r} exists ({_Listed(existing)}); '
                     'give a new prefix or remove it.')


def _Save(tensors: Dict[str, object], output_prefix: str) -> None:
  """Writes {name: numpy value} as a name-based checkpoint."""
  names = sorted(tensors)
  with tf.Graph().as_default() as graph:
    feeds = [
        tf.compat.v1.placeholder(tf.as_dtype(tensors[n].dtype))
        for n in names
    ]
    save = tf.raw_ops.SaveV2(prefix=output_prefix, tensor_names=names,
                             shape_and_slices=[''] * len(names),
                             tensors=feeds)
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(save, dict(zip(feeds, (tensors[n] for n in names))))


def ConvertCheckpoint(model, input_prefix: str, output_prefix: str,
                      to: str) -> Dict[str, str]:
  """Writes the checkpoint `input_prefix` renamed towards `to`.

  Args:
    model: A built Lingvo layer whose pipelines are `lingvo_gpipe.stacks`
      layers (see `Renames`).
    input_prefix: The checkpoint to read (e.g. '.../train/ckpt-00001000').
    output_prefix: The checkpoint to write; must not exist. If it is in
      another directory than the input, that directory's `checkpoint` file
      is pointed at it, so that Lingvo's trainer restores from it.
    to: 'ours' or 'lingvo'.

  Returns:
    {old name: new name} of every variable.

  Raises:
    ValueError: see `Renames`; also if the output exists or is the input.
  """
  _CheckOutput(input_prefix, output_prefix)
  reader = tf.train.load_checkpoint(input_prefix)
  renames = Renames(model, list(reader.get_variable_to_shape_map()), to)
  output_dir = os.path.dirname(os.path.abspath(output_prefix))
  tf.io.gfile.makedirs(output_dir)
  _Save({new: reader.get_tensor(old) for old, new in renames.items()},
        output_prefix)
  if output_dir != os.path.dirname(os.path.abspath(input_prefix)):
    tf.compat.v1.train.update_checkpoint_state(output_dir, output_prefix)
  return renames
