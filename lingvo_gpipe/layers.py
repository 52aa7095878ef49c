"""GPipeSequentialLayer: a Lingvo layer that runs its cells as a GPipe pipeline.

    >>> from lingvo.core import layers
    >>> fc = [layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=8,
    ...                                   output_dim=8) for i in range(4)]
    >>> p = GPipeSequentialLayer.Params().Set(
    ...     name='pipe', cell_tpl=fc, num_stages=2, num_micro_batches=4)
    >>> layer = p.Instantiate()
    >>> y = layer.FProp(layer.theta, tf.ones([8, 8]))
    >>> y.shape, layer.partition, layer.BubbleFraction(8)
    (TensorShape([8, 8]), [2, 2], 0.2)
    >>> [v.name for v in layer.vars.fc0.Flatten()]
    ['pipe/fc0/b/var:0', 'pipe/fc0/w/var:0']

The cells are created exactly as `builder_layers.SequentialLayer` would create
them (same variable names, `theta[cell_name]`), so checkpoints move freely
between pipeline shapes and the plain sequential model. The pipeline shape
(stages, devices, micro-batches, recompute) only changes how FProp runs.
"""

import functools

from absl import logging
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import bn_layers
from lingvo.core import py_utils

from lingvo_gpipe import batchnorm
from lingvo_gpipe import cells as cells_lib
from lingvo_gpipe import costs as costs_lib
from lingvo_gpipe import from_lingvo
from lingvo_gpipe.engine import call as call_lib
from lingvo_gpipe.engine import placement
from lingvo_gpipe.engine import tpu
from lingvo_gpipe.planning import config
from lingvo_gpipe.planning import schedule


def _LogPlan(plan):
  """Logs a partition plan at INFO, as a record of this module."""
  logging.info('%s', plan)


class GPipeSequentialLayer(base_layer.BaseLayer):
  """Runs a sequence of cells as a K-stage, M-micro-batch GPipe pipeline."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'cell_tpl', [], 'Params of the cells, in order. Each needs a unique '
        'name; the output of cell i is the input of cell i + 1.')
    p.Define(
        'num_stages', None, 'K, the number of pipeline stages (devices); '
        'None for one stage per cell. At most the number of cells.')
    p.Define(
        'partition', 'uniform', "How cells are grouped into stages: 'uniform' "
        "(equal cell counts); 'params', 'flops' (Lingvo FPropMeta) or "
        "'profile' (measured forward + backward time on one micro-batch): "
        'the contiguous split into K * v chunks minimizing the most '
        'expensive one; or an explicit list of cells per chunk (K * v '
        "counts). 'flops' and 'profile' are computed at the first FProp, "
        'from the micro-batch shapes.')
    p.Define(
        'num_micro_batches', 1, 'M, the number of micro-batches each '
        'mini-batch is split into. Must divide the batch size.')
    p.Define(
        'micro_batch_size', None, 'Alternative to num_micro_batches: the '
        'size of one micro-batch; M = batch size / micro_batch_size.')
    p.Define('batch_dim', 0, 'The batch dimension of every input and output.')
    p.Define(
        'remat', 'always', "Re-materialization: 'always' (keep each stage's "
        "micro-batch inputs, recompute the rest in the backward pass), "
        "'except_last' (not for the last micro-batch) or 'never'.")
    p.Define(
        'devices', None, 'K device strings, one per stage. None: the first '
        "K devices of the Lingvo cluster's model split if it has at least K "
        "(stage k on the split's device k, as Lingvo's PipeliningLayer), "
        'else K local devices of one type, else the default device.')
    p.Define(
        'nested_map_fprop', False, 'If True, cells take and return one '
        'NestedMap instead of positional tensors.')
    p.Define(
        'engine', 'auto', "How the step is built: 'unrolled' (every chunk "
        "call is a graph node: the fastest steady step, but the graph, its "
        "trace and XLA compile grow with K v x M; GPipe and circular "
        "schedules), 'loop' (while loops over the schedule table's ticks: "
        "the graph does not grow with M; every schedule) or 'auto' ('loop' "
        'for a schedule with the loss inside and when XLA compiles the step, '
        'under jit_compile=True or on TPU (engine.xla); else the engine that '
        'costs less over a training run, schedule.ChooseEngine).')
    p.Define(
        'virtual_stages', 1, 'v, the chunks of cells per device: the cells '
        'are cut into K * v chunks and chunk c runs on device c mod K, so a '
        'micro-batch passes the devices v times (circular pipeline). The '
        'bubble falls to (K - 1) / (M v + K - 1) when K divides M.')
    p.Define(
        'skips', [], 'Skip connections: (from_cell, to_cell) cell names; the '
        "outputs of from_cell are appended to to_cell's inputs (after the "
        'outputs of the cell before it, in the order of this list), or, with '
        "to_cell None, to the layer's outputs. The tensors go from "
        "from_cell's device to to_cell's directly.")
    p.Define(
        'schedule', 'gpipe', "The order of the step: 'gpipe' (all forwards, "
        "the loss after the pipeline, all backwards), '1f1b' (the last "
        'cell returns the loss of its micro-batch, a float scalar, and '
        'optionally more scalars as metrics; each backward runs as soon as '
        'its forward reaches the loss, so stage k holds at most K - k '
        'micro-batches; FProp returns the mean of each output over the '
        "micro-batches; interleaved when virtual_stages > 1; engine 'loop'), "
        "'zb1p' (zero bubble ZB-H1: 1F1B with each backward split into "
        'input gradients and weight gradients, the latter deferred into the '
        "bubbles; virtual_stages=1) or 'zbv' (zero bubble ZB-V: "
        'virtual_stages=2, chunks c and 2K - 1 - c on device c, the backward '
        "split); the zero bubble ones take the loss as '1f1b' does.")
    return p

  @classmethod
  def FromPipeliningLayer(cls, p):
    """The GPipeSequentialLayer params of a Lingvo GPipe pipeline.

    Lingvo's two cells of one and two layers become three cells in two
    stages; this layer's own knobs stay free to set:

        >>> from lingvo.core import gpipe, layers
        >>> fc = [layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=8,
        ...                                   output_dim=8) for i in range(3)]
        >>> lingvo_p = gpipe.PipeliningLayer.Params().Set(
        ...     name='pipe', num_micro_batches=2, cell_tpl=[
        ...         gpipe.FeatureExtractionLayer.Params().Set(
        ...             name='cell_0', sub=fc[:1]),
        ...         gpipe.FeatureExtractionLayer.Params().Set(
        ...             name='cell_1', sub=fc[1:])])
        >>> p = GPipeSequentialLayer.FromPipeliningLayer(lingvo_p)
        >>> [c.name for c in p.cell_tpl], p.partition, p.num_micro_batches
        (['fc0', 'fc1', 'fc2'], [1, 2], 2)
        >>> p.remat = 'except_last'

    See `from_lingvo` for what carries over and what raises.

    Args:
      p: Params of Lingvo's `gpipe.PipeliningLayer`, or of a subclass such as
        the stacks of `layers_with_gpipe` (whose cells their `__init__`
        builds).

    Returns:
      GPipeSequentialLayer params: the cells' layers in order, partition =
      layers per Lingvo cell, the same micro-batching and batch_dim.

    Raises:
      ValueError: for what has no equivalent, naming the parameter.
    """
    return from_lingvo.Convert(from_lingvo.BuiltParams(p), cls.Params()).params

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    shape = self._CheckParams()
    for cell_p in p.cell_tpl:
      self.CreateChild(cell_p.name, cell_p)
    self._cells = [self.children[cell_p.name] for cell_p in p.cell_tpl]
    self._FindBatchNorms()
    # M, the partition and the engine, decided as for every front end.
    self._pipelined_call = call_lib.PipelinedCall(
        p.name, [c.params.name for c in self._cells], shape,
        partition=p.partition, num_micro_batches=p.num_micro_batches,
        micro_batch_size=p.micro_batch_size, batch_dim=p.batch_dim,
        remat=p.remat, engine=p.engine, schedule=p.schedule,
        memory=lambda: costs_lib.CellMemory(self._cells),
        log_plan=_LogPlan)
    self._pipelined_call.Plan(
        lambda: costs_lib.CellCosts(self._cells, 'params'))

  def _FindBatchNorms(self):
    """Tells our BatchNormLayers they are micro-batched; warns about Lingvo's.

    Each `batchnorm.BatchNormLayer` inside the cells accumulates whole
    mini-batch moments; each plain Lingvo BatchNormLayer gets one warning.
    """
    stack = list(self._cells)
    while stack:
      layer = stack.pop()
      if isinstance(layer, batchnorm.BatchNormLayer):
        layer.MarkMicroBatched()
      elif isinstance(layer, bn_layers.BatchNormLayer):
        logging.warning(
            '%s: %s is a Lingvo BatchNormLayer; inside the pipeline its moving '
            'statistics are updated per micro-batch (and again by recomputes),'
            " outside the trainer's bn_updates. Use "
            'lingvo_gpipe.BatchNormLayer instead.', self.params.name,
            layer.path)
      stack.extend(py_utils.Flatten(layer.children))

  def _CheckParams(self):
    """Validates the params (`planning.config.CheckShape`).

    Returns:
      The `config.Shape`; its counts are None until costs are known.

    Raises:
      ValueError: naming the parameter, its value and what would be valid.
    """
    p = self.params
    if not p.cell_tpl:
      raise ValueError('cell_tpl is empty; give at least one cell Params.')
    shape = config.CheckShape(
        [c.name for c in p.cell_tpl], p.num_stages, p.virtual_stages,
        p.partition, p.num_micro_batches, p.micro_batch_size, p.batch_dim,
        p.remat, p.engine, p.schedule, p.skips)
    placement.CheckDevices(p.devices, shape.num_stages)
    return shape

  @property
  def partition(self):
    """Cells per chunk (K v positive ints; the devices: `CellDevices`).

    With v = 1, the cells per stage. None before a first FProp decides a
    'flops' or 'profile' partition.
    """
    return self._pipelined_call.partition

  @property
  def num_stages(self):
    return self._pipelined_call.num_stages

  @property
  def num_chunks(self):
    """K v."""
    return self._pipelined_call.num_chunks

  @property
  def loss_inside(self):
    """Whether the schedule computes the loss in the last cell (e.g. 1F1B).

    FProp then returns the mean over micro-batches of each of the last
    cell's scalar outputs, and only the first (the loss) has a gradient.
    """
    return schedule.CheckSchedule(self.params.schedule).loss_inside

  def _MicroBatchCosts(self, flat_inputs, num_micro):
    """Per-cell 'flops' or 'profile' costs of one micro-batch of the inputs.

    Args:
      flat_inputs: The first FProp's flat inputs.
      num_micro: M.

    Returns:
      One cost per cell (`costs.CellCosts`).

    Raises:
      ValueError: with nested_map_fprop, or inputs of unknown shape.
    """
    p = self.params
    if p.nested_map_fprop:
      raise ValueError(f'partition={p.partition!r} does not support '
                       "nested_map_fprop=True; use 'params', 'uniform' or a "
                       'list.')
    shapes = []
    for x in flat_inputs:
      if x is None:
        shapes.append(None)
        continue
      if not x.shape.is_fully_defined():
        raise ValueError(f'partition={p.partition!r} needs static input '
                         f'shapes, got {x.shape}.')
      shape = x.shape.as_list()
      shape[p.batch_dim] //= num_micro
      shapes.append(shape)
    return costs_lib.CellCosts(self._cells, p.partition, input_shapes=shapes)

  def NumMicroBatches(self, batch_size):
    """M for a mini-batch of `batch_size` (`PipelinedCall.NumMicroBatches`)."""
    return self._pipelined_call.NumMicroBatches(batch_size)

  def StageDevices(self):
    """The device of every stage (see `placement.StageDevices`).

    With devices=None in a Lingvo cluster whose model split has at least K
    devices, stage k runs on the split's device k, where Lingvo's
    PipeliningLayer puts its cell k. The first call (and any call that
    resolves differently, e.g. another replica's split) logs the placement.

    Returns:
      K device strings; '' is the default device.
    """
    num_stages = self.num_stages
    if self.params.devices is None and py_utils.use_tpu():
      # Each replica's logical core k, whatever host devices Lingvo's (eager)
      # TPU cluster lists; in graph mode its model split says the same.
      return tpu.TpuStageDevices(num_stages)
    cluster = self.cluster
    model_split = [
        cluster.WorkerDeviceInModelSplit(k)
        for k in range(cluster.num_devices_per_split)
    ]
    devices = placement.StageDevices(num_stages, self.params.devices,
                                     model_split)
    placement_log = (f'{self.params.name}: stage devices {devices} for '
                     f'partition {self.partition} (model split of '
                     f'{len(model_split)} devices)')
    # A string: tf.Module would wrap a list attribute for tracking.
    if placement_log != getattr(self, '_placement_log', None):
      self._placement_log = placement_log
      logging.info(placement_log)
    return devices

  def CellDevices(self):
    """The device of every cell, in order: the stage device of its chunk.

    Chunk c runs on stage `Schedule.placement`[c] (c mod K; 'zbv': the V).
    A cluster that keeps each stage's weights on its device creates cell
    i's variables under `tf.device(CellDevices()[i])`.

    Returns:
      One device string per cell ('' is the default device).

    Raises:
      ValueError: if the partition is decided at the first FProp ('flops',
        'profile') and no FProp ran yet.
    """
    p = self.params
    if self.partition is None:
      raise ValueError(
          f'{p.name}: partition={p.partition!r} is decided at the first '
          'FProp; CellDevices() is known after it (or give a partition such '
          "as 'params' or a list of cells per chunk).")
    stage_devices = self.StageDevices()
    chunk_stages = schedule.CheckSchedule(p.schedule).placement(
        self.num_stages, p.virtual_stages)
    return [stage_devices[chunk_stages[c]]
            for c, count in enumerate(self.partition) for _ in range(count)]

  def Engine(self, num_micro_batches):
    """The engine that builds a step with M micro-batches: unrolled or loop.

    'loop' for engine='auto' when XLA compiles the step (`engine.xla`: under
    `jit_compile=True`, in TPU replication, on TPU stage devices).
    """
    return self._pipelined_call.Engine(num_micro_batches, self.StageDevices())

  def BubbleFraction(self, batch_size):
    """The idle fraction (K - 1) / (M v + K - 1) of a step with this batch.

    That of a GPipe step of equal chunks (`schedule.BubbleFraction`): exact
    when v = 1 or K divides M.
    """
    return schedule.BubbleFraction(self.num_stages,
                                   self.NumMicroBatches(batch_size),
                                   self.params.virtual_stages)

  # AutoGraph has nothing to convert here (the step is built in Python); left
  # to convert it inside a user's tf.function, it mixed up this layer's
  # StageDevices with placement.StageDevices in some test orders.
  @tf.autograph.experimental.do_not_convert
  def FProp(self, theta, *args):
    """Runs the cells as a pipeline.

    Args:
      theta: A NestedMap with one entry per cell (`theta[cell_name]`).
      *args: The first cell's inputs (tensors or None), or one NestedMap if
        nested_map_fprop.

    Returns:
      The last cell's outputs, merged back into the mini-batch: a tensor or a
      tuple, or a NestedMap if nested_map_fprop.

    Raises:
      ValueError: if the batch does not split into micro-batches as configured.
    """
    p = self.params
    if p.nested_map_fprop:
      if len(args) != 1 or not isinstance(args[0], py_utils.NestedMap):
        raise ValueError('nested_map_fprop=True: FProp takes one NestedMap, '
                         f'got {args!r}.')
      flat_inputs = args[0].Flatten()
    else:
      flat_inputs = list(args)
    training = not self.do_eval
    num_micro = self._pipelined_call.Prepare(
        flat_inputs, training,
        functools.partial(self._MicroBatchCosts, flat_inputs))
    partition = self._pipelined_call.partition
    stage_cells = config.ChunkCells(self._cells, partition)
    boundaries = (cells_lib.StageBoundaries(self.num_chunks, args[0])
                  if p.nested_map_fprop else None)
    skips = cells_lib.SkipValues(config.ChunkSkips(
        config.CheckSkips([c.params.name for c in self._cells], p.skips),
        partition))
    firsts = [sum(partition[:k]) for k in range(self.num_chunks)]
    stage_fns = [
        cells_lib.StageFunction(cells, boundaries, k, first, skips)
        for k, (cells, first) in enumerate(zip(stage_cells, firsts))
    ]
    thetas = [
        py_utils.NestedMap({c.params.name: theta[c.params.name] for c in cells})
        for cells in stage_cells
    ]
    states = [
        py_utils.NestedMap(
            {c.params.name: c.GetAccumulatorValues() for c in cells})
        for cells in stage_cells
    ]
    outputs, states = self._pipelined_call.Run(
        stage_fns, self.StageDevices(), thetas, flat_inputs, states,
        num_micro, training, step=py_utils.GetGlobalStep(),
        skips=skips.skips.chunk_skips)
    if training:
      # Eval accumulates nothing; its state stays inside this trace (Lingvo's
      # eager evaler traces its eval function twice).
      for cells, state in zip(stage_cells, states):
        for cell in cells:
          cell.SetAccumulatorValues(state[cell.params.name])
    extra = []  # The skips into the output, each as its cell returned it.
    for s in reversed(skips.ToOutput()):
      size = len(tf.nest.flatten(skips.structs[s]))
      extra.insert(0, skips.Pack(s, outputs[len(outputs) - size:]))
      outputs = outputs[:len(outputs) - size]
    if p.nested_map_fprop:
      outputs = [boundaries.last.Pack(outputs)]
    outputs = list(outputs) + [y for value in extra for y in value]
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
