"""Lingvo cells as the engine's stage functions.

A stage of `GPipeSequentialLayer` is a run of Lingvo cells. `StageFunction`
turns it into the engine's contract `(theta, inputs, state, micro_batch_id) ->
(outputs, state)`: the cells' accumulators travel in `state`, so that each
micro-batch adds to them once (recomputes trace the function again and their
state is dropped), and Lingvo's stateless random ops are seeded per
micro-batch (`MicroBatchSeeds`), so that a recompute draws the same dropout
masks as the forward pass. The same micro-batch id draws the same mask:

    >>> from lingvo.core import layers
    >>> fc = layers.FCLayer.Params().Set(
    ...     name='fc', input_dim=4, output_dim=4, activation='NONE')
    >>> dropout = layers.DeterministicDropoutLayer.Params().Set(
    ...     name='dropout', keep_prob=0.5)
    >>> cells = [fc.Instantiate(), dropout.Instantiate()]
    >>> fn = StageFunction(cells)
    >>> theta = py_utils.NestedMap({c.params.name: c.theta for c in cells})
    >>> state = py_utils.NestedMap(
    ...     {c.params.name: c.GetAccumulatorValues() for c in cells})
    >>> def Call(micro_batch_id):
    ...   (y,), _ = fn(theta, (tf.ones([2, 4]),), state,
    ...                tf.constant(micro_batch_id, tf.int64))
    ...   return y
    >>> bool(tf.reduce_all(Call(0) == Call(0)))
    True
    >>> bool(tf.reduce_all(Call(0) == Call(1)))
    False
"""

import contextlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils

from lingvo_gpipe.planning import config


def _ToTuple(x):
  return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _AccumulatorRestorer(cell):
  """A function that puts the cell's accumulators back as they are now.

  Unset accumulators become unset again: `GetValue` of an unset one makes a
  default tensor in the current graph, which must not outlive it.

  Args:
    cell: A Lingvo layer.

  Returns:
    A function of no arguments.
  """
  accumulators = cell.accumulators.Flatten()
  values = [acc._value for acc in accumulators]  # pylint: disable=protected-access

  def Restore():
    for acc, value in zip(accumulators, values):
      if value is None:
        acc.Reset()
      else:
        acc.SetValue(value)

  return Restore


@contextlib.contextmanager
def MicroBatchSeeds(micro_batch_id):
  """Seeds Lingvo's stateless random ops from the micro-batch id.

  Inside this context `py_utils.GenerateStepSeedPair` returns
  [micro_batch_id, step seed] (plus the layer's random_seed and op seed)
  instead of [global step, step seed], so every micro-batch of every step draws
  its own masks and a recompute that replays the same trace draws the same.

  Args:
    micro_batch_id: int64 scalar tensor, global_step * M + micro-batch index.

  Yields:
    Nothing.
  """
  original = py_utils.GenerateStepSeedPair

  def GenerateStepSeedPair(p, op_seed=None):
    if p.is_inference and p.random_seed is None:
      return original(p, op_seed)
    seed_dtype = tf.int32 if py_utils.use_tpu() else tf.int64
    seeds = tf.stack([
        tf.cast(micro_batch_id, seed_dtype),
        tf.cast(py_utils.GetIncStepSeed(), seed_dtype)
    ])
    if p.random_seed is not None:
      seeds += p.random_seed
    if op_seed is not None:
      seeds += tf.cast(op_seed, seed_dtype)
    return seeds

  py_utils.GenerateStepSeedPair = GenerateStepSeedPair
  try:
    yield
  finally:
    py_utils.GenerateStepSeedPair = original


class StageBoundaries:
  """The NestedMap structure at each stage boundary (nested_map_fprop).

  The engine passes flat tensor tuples between stages; with nested_map_fprop
  the cells take and return one NestedMap. Entry 0 is the layer input's
  structure; entry k + 1 is filled in when stage k is traced.
  """

  def __init__(self, num_stages: int, first: py_utils.NestedMap):
    self.structs: List[Optional[py_utils.NestedMap]] = [None] * (num_stages +
                                                                 1)
    self.structs[0] = first

  @property
  def last(self) -> py_utils.NestedMap:
    """The structure of the last stage's output."""
    return self.structs[-1]


class SkipValues:
  """The structures of the skips that cross chunks (filled when traced).

  The engine passes a skip's tensors as a flat tuple; its source's outputs
  may be a tuple with None or a NestedMap. The source chunk records each
  skip's structure here when it is traced, before its target is.

  Attributes:
    skips: The layer's `config.Skips`.
    structs: {skip index: the structure of its source's outputs}.
  """

  def __init__(self, skips: config.Skips):
    self.skips = skips
    self.structs = {}

  def Incoming(self, chunk: int) -> List[int]:
    """The skips into `chunk` from another chunk, in the engine's order."""
    return [s for s in self._Crossing() if self.skips.chunk_skips[
        self.skips.crossing[s]][1] == chunk]

  def Outgoing(self, chunk: int) -> List[int]:
    """The skips that leave `chunk`, in the engine's order."""
    return [s for s in self._Crossing() if self.skips.chunk_skips[
        self.skips.crossing[s]][0] == chunk]

  def ToOutput(self) -> List[int]:
    """The skips into the pipeline's output, in the engine's order."""
    return [s for s in self._Crossing()
            if self.skips.chunk_skips[self.skips.crossing[s]][1] is None]

  def Pack(self, s: int, flat: Sequence[Any]) -> Any:
    """Skip s's tensors, back in its source's output structure."""
    return tf.nest.pack_sequence_as(self.structs[s], list(flat))

  def _Crossing(self) -> List[int]:
    return sorted((s for s, c in enumerate(self.skips.crossing)
                   if c is not None), key=lambda s: self.skips.crossing[s])


def StageFunction(cells: Sequence[base_layer.BaseLayer],
                  boundaries: Optional[StageBoundaries] = None,
                  stage: int = 0,
                  first_cell: int = 0,
                  skips: Optional[SkipValues] = None
                 ) -> Callable[..., Tuple[Any, Any]]:
  """The engine's stage function for a run of Lingvo cells.

  Args:
    cells: The stage's cells, in order; cell i's outputs are cell i + 1's
      inputs (followed by the outputs of the cells that skip to it).
    boundaries: With nested_map_fprop, the boundary structures (the stage
      reads entry `stage` and fills entry `stage + 1`); None for positional
      FProp arguments.
    stage: The chunk index.
    first_cell: The index of the chunk's first cell among all cells.
    skips: The layer's skip connections, or None.

  Returns:
    A function (theta, inputs, state, micro_batch_id) -> (outputs, state):
    theta and state are NestedMaps keyed by cell name; inputs and outputs are
    flat tuples, followed by one tuple per skip into or out of the chunk.
  """
  incoming = skips.Incoming(stage) if skips else []
  outgoing = skips.Outgoing(stage) if skips else []
  skip_cells = skips.skips.cells if skips else []

  def StageFn(theta, inputs, state, micro_batch_id):
    inputs = tuple(inputs)
    main = inputs[:len(inputs) - len(incoming)]
    values = {s: skips.Pack(s, flat)
              for s, flat in zip(incoming, inputs[len(main):])}
    if boundaries is None:
      args = main
    else:
      args = (boundaries.structs[stage].Pack(list(main)),)
    new_state = py_utils.NestedMap()
    with MicroBatchSeeds(micro_batch_id):
      for i, cell in enumerate(cells, first_cell):
        name = cell.params.name
        args += tuple(y for s, (_, target) in enumerate(skip_cells)
                      if target == i for y in values[s])
        # Accumulators hold tensors of this trace only while it runs; the
        # values outside (set after the pipeline, or unset) must survive
        # later traces, such as the backward pass's recompute.
        restore = _AccumulatorRestorer(cell)
        cell.SetAccumulatorValues(state[name])
        py_utils.ResetStepSeed(py_utils.GenerateSeedFromName(cell.path))
        args = _ToTuple(cell.FProp(theta[name], *args))
        new_state[name] = cell.GetAccumulatorValues()
        restore()
        for s, (source, _) in enumerate(skip_cells):
          if source == i:
            values[s] = args
    sent = []
    for s in outgoing:
      skips.structs[s] = values[s]
      sent.append(tuple(tf.nest.flatten(values[s])))
    if boundaries is not None:
      boundaries.structs[stage + 1] = args[0]
      return tuple(args[0].Flatten()) + tuple(sent), new_state
    return args + tuple(sent), new_state

  return StageFn
