"""One pipelined call, whichever front end makes it.

A front end (the Lingvo layer in `layers.py`, the Keras layer in
`keras/layer.py`) owns its cells: their parameters, variables, seeds, batch
norm and accumulators, and how they become chunk functions. What a call
decides beyond its cells is the same for every front end and is decided here,
by `PipelinedCall`, once for all of them:

* the partition: given (uniform, a list), decided before the first call from
  per-cell costs ('params'), or at the first call from costs on one
  micro-batch ('flops', 'profile'); each plan is logged once
  (`planning.report`);
* M for a batch (`planning.config.NumMicroBatches`); eval on one stage runs
  the whole batch at once, as there is no backward pass to overlap;
* the engine (`planning.schedule.ChooseEngine`, under XLA as `xla.py` says);
* the run (`pipeline.Pipeline`), for eval (training=False) without backward
  work: no recompute, the training table's forward actions, nothing kept.

Four cells of a matmul each, cut by their parameters into two stages:

    >>> names = ['fc0', 'fc1', 'fc2', 'fc3']
    >>> shape = config.CheckShape(names, num_stages=2, partition='params')
    >>> call = PipelinedCall('pipe', names, shape, partition='params',
    ...                      num_micro_batches=4, micro_batch_size=None,
    ...                      batch_dim=0, remat='always', engine='auto',
    ...                      schedule='gpipe', memory=None)
    >>> call.Plan(lambda: [16.0, 48.0, 32.0, 32.0])  # Decided and logged.
    >>> call.partition
    [2, 2]
    >>> x = tf.ones([8, 2])
    >>> m = call.Prepare([x], training=True)
    >>> m, call.Engine(m, ['/cpu:0', '/cpu:1'])
    (4, 'unrolled')
    >>> def Chunk(theta, inputs, state, micro_batch_id):
    ...   (y,) = inputs
    ...   for w in theta:  # One weight per cell of the chunk.
    ...     y = tf.matmul(y, w)
    ...   return (y,), state
    >>> thetas = [[tf.eye(2), tf.eye(2)], [tf.eye(2), 2.0 * tf.eye(2)]]
    >>> (y,), states = call.Run([Chunk, Chunk], ['/cpu:0', '/cpu:1'], thetas,
    ...                         [x], [(), ()], m, training=True)
    >>> y.numpy()[0].tolist(), states
    ([2.0, 2.0], [(), ()])
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from absl import logging
import tensorflow as tf

from lingvo_gpipe.engine import microbatch
from lingvo_gpipe.engine import pipeline
from lingvo_gpipe.engine import xla
from lingvo_gpipe.planning import config
from lingvo_gpipe.planning import partition as partition_lib
from lingvo_gpipe.planning import report
from lingvo_gpipe.planning import schedule as schedule_lib

# Per-cell figures (costs, memory), computed by the front end when needed.
CellFigures = Callable[[], Sequence[float]]
# Per-cell costs of one micro-batch, given M: for 'flops' and 'profile'.
MicroBatchCosts = Callable[[int], Sequence[float]]


def _LogPlan(plan: str) -> None:
  """Logs a plan at INFO (the default of `PipelinedCall`'s log_plan)."""
  logging.info('%s', plan)


class PipelinedCall:
  """The decisions of a front end's pipelined call, made at the first call.

  A front end calls `Plan` once its cells exist, then per call `Prepare` and
  `Run` (the module docstring has a whole call). On one stage, eval runs the
  batch as one micro-batch:

      >>> call = PipelinedCall(
      ...     'eval', ['fc0', 'fc1'],
      ...     config.CheckShape(['fc0', 'fc1'], num_stages=1),
      ...     partition='uniform', num_micro_batches=4, micro_batch_size=None,
      ...     batch_dim=0, remat='always', engine='auto', schedule='gpipe',
      ...     memory=None)
      >>> batch = [tf.ones([8, 2])]
      >>> [call.Prepare(batch, training) for training in (True, False)]
      [4, 1]

  Attributes:
    name: The front end's layer name, first in the plan log.
    num_stages: K.
    virtual_stages: v.
    batch_dim: The batch dimension of every input and output.
    remat: 'always', 'except_last' or 'never'.
    engine: 'auto', 'unrolled' or 'loop', as the user asked.
    schedule: A key of `planning.schedule.SCHEDULES`.
  """

  def __init__(self, name: str, cell_names: Sequence[str],
               shape: config.Shape, *, partition: Union[str, Sequence[int]],
               num_micro_batches: int, micro_batch_size: Optional[int],
               batch_dim: int, remat: str, engine: str, schedule: str,
               memory: Optional[CellFigures],
               log_plan: Callable[[str], None] = _LogPlan):
    """Holds parameters a front end has checked; decides nothing yet.

    Every parameter but log_plan is required: each front end passes its own
    values (and so its own defaults), the same it gave
    `planning.config.CheckShape`.

    Args:
      name: The front end's layer name.
      cell_names: The cells' names, in order (the plan's rows).
      shape: From `planning.config.CheckShape` of these parameters: K, v and
        the cells per chunk, None until costs decide them.
      partition: The partition parameter as the user gave it (the plan log
        repeats it; 'params' is decided by `Plan`).
      num_micro_batches: M, as asked.
      micro_batch_size: The micro-batch size, as asked, or None.
      batch_dim: The batch dimension.
      remat: The remat mode.
      engine: 'auto', 'unrolled' or 'loop'.
      schedule: The schedule.
      memory: Memory per cell (e.g. variable bytes), for the partition's
        tie-break and the plan's memory column; None for neither.
      log_plan: Logs a plan's text; a front end may pass its own, so that
        the record comes from its module.
    """
    self.name = name
    self._cell_names = list(cell_names)
    self.num_stages = shape.num_stages
    self.virtual_stages = shape.virtual_stages
    self._counts = None if shape.counts is None else list(shape.counts)
    self._partition_arg = partition
    self._num_micro_batches = num_micro_batches
    self._micro_batch_size = micro_batch_size
    self.batch_dim = batch_dim
    self.remat = remat
    self.engine = engine
    self.schedule = schedule
    self._memory = memory
    self._log_plan = log_plan

  @property
  def num_chunks(self) -> int:
    """K v."""
    return self.num_stages * self.virtual_stages

  @property
  def partition(self) -> Optional[List[int]]:
    """Cells per chunk (K v ints), or None until costs decide them."""
    return None if self._counts is None else list(self._counts)

  def Plan(self, param_costs: CellFigures) -> None:
    """Before the first call: decides a 'params' partition, logs a given one.

    A front end calls it once its cells exist (Lingvo: at construction;
    Keras: at build). A 'flops' or 'profile' partition waits for `Prepare`.

    Args:
      param_costs: Per-cell parameter counts; called only when a plan is
        decided or logged now.
    """
    if self._partition_arg == 'params':
      self._Partition(param_costs())
    elif self._counts is not None:
      self._LogPlanOf(param_costs(), self._Memory())

  def _Memory(self) -> Optional[Sequence[float]]:
    return None if self._memory is None else self._memory()

  def _Partition(self, cell_costs: Sequence[float]) -> None:
    """Sets the cheapest partition for `cell_costs` and logs the plan."""
    memory = self._Memory()
    self._counts = partition_lib.PartitionCosts(cell_costs, self.num_chunks,
                                                memory)
    self._LogPlanOf(cell_costs, memory)

  def _LogPlanOf(self, cell_costs: Sequence[float],
                 memory: Optional[Sequence[float]]) -> None:
    """Logs each chunk's cells, cost (`cell_costs`), share and memory."""
    self._log_plan(
        f'{self.name}: partition={self._partition_arg!r}\n' +
        report.PartitionReport(cell_costs, self._counts, memory=memory,
                               names=self._cell_names))

  def NumMicroBatches(self, batch_size: Optional[int]) -> int:
    """M for a mini-batch of `batch_size` (None if unknown statically).

    Args:
      batch_size: The static batch size, or None.

    Returns:
      M.

    Raises:
      ValueError: if the batch does not split into M (or micro_batch_size)
        micro-batches, or both are set and their product is not the batch.
    """
    return config.NumMicroBatches(batch_size, self._num_micro_batches,
                                  self._micro_batch_size)

  def Prepare(self,
              inputs: Sequence[Optional[tf.Tensor]],
              training: bool,
              micro_batch_costs: Optional[MicroBatchCosts] = None) -> int:
    """What a call decides before its chunks are built; M for this call.

    At the first call of a 'flops' or 'profile' partition, decides the
    partition from `micro_batch_costs` (one chunk needs no costs).

    Args:
      inputs: The call's flat inputs, tensors or None.
      training: Whether the call is followed by a backward pass. Eval on
        one stage runs as one micro-batch: without a backward pass there is
        nothing to overlap.
      micro_batch_costs: Per-cell costs of one micro-batch, given M; needed
        while the partition is undecided.

    Returns:
      M for this call.

    Raises:
      ValueError: if the batch does not split into micro-batches as
        configured, or whatever `micro_batch_costs` raises.
    """
    num_micro = self.NumMicroBatches(
        microbatch.StaticBatchSize(inputs, self.batch_dim))
    if self._counts is None:
      if self.num_chunks == 1:
        self._counts = [len(self._cell_names)]
      else:
        self._Partition(micro_batch_costs(num_micro))
    if not training and self.num_stages == 1:
      num_micro = 1
    return num_micro

  def Engine(self, num_micro_batches: int, devices: Sequence[str]) -> str:
    """The engine that builds a call with M micro-batches on these devices.

    Args:
      num_micro_batches: M.
      devices: The K stage devices (a TPU device means XLA compiles).

    Returns:
      'unrolled' or 'loop'.
    """
    return schedule_lib.ChooseEngine(
        self.engine, self.num_stages, num_micro_batches, self.remat,
        compiled_by_xla=xla.CompiledByXla(devices), schedule=self.schedule,
        virtual_stages=self.virtual_stages)

  def Run(self,
          stage_fns: Sequence[Any],
          devices: Sequence[str],
          thetas: Sequence[Any],
          inputs: Sequence[Optional[tf.Tensor]],
          states: Sequence[Any],
          num_micro_batches: int,
          training: bool,
          step: Optional[tf.Tensor] = None,
          skips: Sequence[Tuple[int, Optional[int]]] = ()
         ) -> Tuple[List[Optional[tf.Tensor]], List[Any]]:
    """Builds the pipelined pass of one call on the chosen engine.

    Args:
      stage_fns: K v chunk functions (`stage.py`) of the partition.
      devices: K stage devices.
      thetas: K v nests of weights, one per chunk.
      inputs: The call's flat inputs.
      states: K v nests of initial chunk states.
      num_micro_batches: M, from `Prepare`.
      training: If False, no backward work: nothing is set up for recompute.
      step: Integer scalar for micro-batch ids (default 0).
      skips: (source chunk, target chunk or None) pairs (`pipeline.py`).

    Returns:
      (outputs, states), see `pipeline.Pipeline.__call__`.

    Raises:
      ValueError: see `pipeline.Pipeline`.
    """
    pipe = pipeline.Pipeline(
        stage_fns,
        devices,
        num_micro_batches,
        batch_dim=self.batch_dim,
        remat=self.remat,
        engine=self.Engine(num_micro_batches, devices),
        schedule=self.schedule,
        virtual_stages=self.virtual_stages,
        skips=skips,
        name='gpipe')
    return pipe(thetas, inputs, states, step=step, training=training)
