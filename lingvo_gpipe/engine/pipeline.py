"""The pipeline engine: C chunk functions run over M micro-batches on K devices.

Knows TensorFlow, not Lingvo. A stage (chunk) function maps
`(theta, inputs, state, micro_batch_id)` to `(outputs, state)` (see
`stage.py`). The engine splits the inputs into micro-batches, runs chunk c on
micro-batch m under `tf.device(devices[k])`, k = table.Device(c), in the order of a schedule
table (`planning.schedule`: GPipe or 1F1B, circular or interleaved when there
are v > 1 chunks per device), re-materializes calls in the backward pass as
the remat mode says, and concatenates the last chunk's outputs back in order.
Gradients of the M micro-batches add up to the gradient of the mini-batch, so
the step is the same as without the pipeline. It builds in TF1 graph mode,
inside `tf.function` and under XLA (`jit_compile=True`).

Two engines build the same step from the same table: 'unrolled'
(`unrolled.py`, C x M calls in the graph) and 'loop' (`loop.py`, while loops
over the table's ticks: the graph does not grow with M). Four chunks on two
devices (v = 2), four micro-batches:

    >>> def Chunk(theta, inputs, state, micro_batch_id):
    ...   (x,) = inputs
    ...   return (tf.tanh(tf.matmul(x, theta)),), state
    >>> pipe = Pipeline([Chunk] * 4, devices=['/cpu:0', '/cpu:1'],
    ...                 num_micro_batches=4, remat='always', engine='loop',
    ...                 virtual_stages=2)
    >>> print(pipe.table)
    gpipe: K=2 v=2 M=4, 18 ticks
    device 0: F0.0 F0.1 F2.0 F2.1 F0.2 F0.3 F2.2 F2.3 ... B0.1 B0.0
    device 1:    - F1.0 F1.1 F3.0 F3.1 F1.2 F1.3 F3.2 ... B1.1 B1.0    -
    >>> thetas = [tf.eye(8) * 0.5 for _ in range(4)]
    >>> @tf.function
    ... def Step(x):
    ...   with tf.GradientTape() as tape:
    ...     tape.watch(thetas)
    ...     (y,), _ = pipe(thetas, [x], step=tf.constant(0))
    ...   return y, tape.gradient(tf.reduce_sum(y), thetas)
    >>> y, grads = Step(tf.ones([16, 8]))
    >>> y.shape, len(grads)
    (TensorShape([16, 8]), 4)
"""

from typing import Any, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from lingvo_gpipe.engine import loop
from lingvo_gpipe.engine import microbatch
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.engine import unrolled
from lingvo_gpipe.engine import watched
from lingvo_gpipe.planning import checks
from lingvo_gpipe.planning import schedule as schedule_lib

# The engines by name (`schedule.ENGINES`): the same step, built two ways.
_ENGINES = {'unrolled': unrolled.Run, 'loop': loop.Run}
assert tuple(_ENGINES) == schedule_lib.ENGINES


class Pipeline:
  """Runs chunk functions over micro-batches in the order of a schedule table.

  Attributes:
    num_stages: K.
    num_micro_batches: M.
    devices: The K device strings ('' leaves placement to TensorFlow).
    batch_dim: The dimension inputs are split along and outputs merged along.
    remat: 'always', 'except_last' or 'never'.
    engine: 'unrolled' or 'loop'.
    table: The schedule table of a training step (`planning.schedule`).
    loss_inside: Whether the last chunk computes the loss (the schedule's).
  """

  def __init__(self,
               stage_fns: Sequence[stage_lib.StageFn],
               devices: Sequence[str],
               num_micro_batches: int,
               batch_dim: int = 0,
               remat: str = 'always',
               engine: str = 'unrolled',
               schedule: Union[str, schedule_lib.Table] = 'gpipe',
               virtual_stages: int = 1,
               skips: Sequence[Tuple[int, Optional[int]]] = (),
               executor: str = 'auto',
               name: str = 'gpipe'):
    """Checks the configuration and builds the schedule table; no graph yet.

    Args:
      stage_fns: C = K v chunk functions, see `stage.py`; chunk c runs on
        devices[table.Device(c)] (c mod K unless the table says otherwise).
      devices: K device strings.
      num_micro_batches: M >= 1.
      batch_dim: The batch dimension of every input and output.
      remat: Which calls recompute their forward pass in the backward pass:
        'always', 'except_last' or 'never' (`planning.schedule.RecomputedCalls`).
      engine: 'unrolled' or 'loop' (which alone runs schedules with the loss
        inside).
      schedule: A key of `planning.schedule.SCHEDULES`, or a table
        (`planning.schedule.Table`: any valid table of K = len(devices), M
        and v, placing its chunks on devices as it says).
      virtual_stages: v, the chunks per device.
      skips: Skip connections, (source chunk, target chunk) pairs with source
        < target, or (source chunk, None) into the pipeline's outputs. A
        chunk returns, after its main outputs, one tuple of tensors per skip
        it is the source of (in the order of `skips`); a target chunk
        receives, after its main inputs, one such tuple per skip into it.
        The tensors go from the source's device to the target's directly.
      executor: How the loop engine runs its loops (`loop.EXECUTORS`;
        'auto': `loop.ChooseExecutor`); only 'auto' with engine='unrolled'.
      name: Name scope of the pipeline's ops.

    Raises:
      ValueError: on an empty stage list, a number of stage functions other
        than K v, a non-positive M or v, a negative batch_dim, an unknown
        remat mode, engine or schedule, or a remat mode or schedule the
        engine does not support.
    """
    if not stage_fns:
      raise ValueError('stage_fns is empty; a pipeline needs at least 1 stage.')
    checks.CheckPositiveInt('virtual_stages', virtual_stages)
    if len(stage_fns) % virtual_stages:
      raise ValueError(
          f'{len(stage_fns)} stage functions are not a multiple of '
          f'virtual_stages={virtual_stages}; give K * {virtual_stages}.')
    if len(devices) * virtual_stages != len(stage_fns):
      raise ValueError(
          f'devices has {len(devices)} entries {list(devices)} but '
          f'{len(stage_fns)} stage functions with virtual_stages='
          f'{virtual_stages} need {len(stage_fns) // virtual_stages} devices.')
    checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
    checks.CheckBatchDim(batch_dim)
    if engine == 'auto':
      raise ValueError("engine='auto' is the layer's choice; give the engine "
                       f'{list(schedule_lib.ENGINES)} (schedule.ChooseEngine).')
    if isinstance(schedule, schedule_lib.Table):
      self.table = _CheckTable(schedule, len(devices), num_micro_batches,
                               virtual_stages)
      schedule_lib.CheckEngine(engine, remat)
      if engine == 'unrolled' and not self.table.loss_outside:
        raise ValueError(
            f'schedule={self.table.schedule!r} (a table with the loss '
            "inside) needs engine='loop'.")
    else:
      schedule_lib.CheckEngine(engine, remat, schedule)
      self.table = schedule_lib.BuildTable(schedule, len(devices),
                                           num_micro_batches, virtual_stages)
    self.loss_inside = not self.table.loss_outside
    if engine == 'unrolled':
      unrolled.CheckTable(self.table)
    if executor not in loop.EXECUTORS or (engine != 'loop' and
                                          executor != 'auto'):
      raise ValueError(
          f'executor={executor!r} is not supported with engine={engine!r}; '
          f"use one of {list(loop.EXECUTORS)} with engine='loop', 'auto' "
          'otherwise.')
    self.executor = executor
    self.skips = _CheckSkips(skips, len(stage_fns))
    self._stage_fns = list(stage_fns)
    self.num_stages = len(devices)
    self.devices = list(devices)
    self.num_micro_batches = num_micro_batches
    self.batch_dim = batch_dim
    self.remat = remat
    self.engine = engine
    self._name = name

  def __call__(self,
               thetas: Sequence[Any],
               inputs: Sequence[Optional[tf.Tensor]],
               states: Optional[Sequence[Any]] = None,
               step: Optional[tf.Tensor] = None,
               training: bool = True,
               input_gradients: Optional[Sequence[bool]] = None
              ) -> Tuple[List[Optional[tf.Tensor]], List[Any]]:
    """Builds one pipelined pass.

    Args:
      thetas: C nests of weights (tensors or variables), one per chunk.
      inputs: The mini-batch inputs, tensors or None.
      states: C nests of initial chunk states (default: empty).
      step: Integer scalar; micro-batch m of this call gets the id
        step * M + m (default step 0).
      training: If False, nothing is set up for recompute.
      input_gradients: Per input, whether the backward computes its gradient
        (the others get None). Default: with the loss outside, every
        floating-point input (TensorFlow computes those asked for); with the
        loss inside, where the backward runs in the forward pass, those a
        gradient can be asked for (`watched.WatchedInputs`).

    Returns:
      (outputs, states): the last chunk's outputs merged along batch_dim,
      then the tensors of each skip into the output, and each chunk's state
      after its last micro-batch.

    Raises:
      ValueError: if thetas or states do not have C entries, input_gradients
        not one bool per input, or the batch does not split into M
        micro-batches.
    """
    num_chunks, num_micro = len(self._stage_fns), self.num_micro_batches
    if len(thetas) != num_chunks:
      raise ValueError(f'thetas has {len(thetas)} entries, expected '
                       f'{num_chunks}.')
    states = list(states) if states is not None else [()] * num_chunks
    if len(states) != num_chunks:
      raise ValueError(f'states has {len(states)} entries, expected '
                       f'{num_chunks}.')
    if input_gradients is None:
      input_gradients = (watched.WatchedInputs(inputs) if self.loss_inside
                         else [True] * len(inputs))
    elif (len(input_gradients) != len(inputs) or
          not all(isinstance(d, bool) for d in input_gradients)):
      raise ValueError(f'input_gradients={list(input_gradients)!r} must be '
                       f'{len(inputs)} bools, one per input.')
    input_gradients = [d and x is not None and stage_lib.IsDifferentiable(x)
                       for x, d in zip(inputs, input_gradients)]
    batch = microbatch.StaticBatchSize(inputs, self.batch_dim)
    if batch is not None:
      microbatch.MicroBatchSize(batch, num_micro)
    table = self.table  # Eval runs its forward actions alone.

    with tf.name_scope(self._name):
      with tf.device(self.devices[0]):
        first_id = (tf.constant(0, tf.int64) if step is None else
                    tf.cast(step, tf.int64) * num_micro)
      # The unrolled engine's forward calls are inlined into this graph.
      chunks = [
          stage_lib.Stage(fn, f'stage {c}', self.devices[table.Device(c)],
                          pin_forward=self.engine == 'unrolled')
          for c, fn in enumerate(self._stage_fns)
      ]
      options = {'executor': self.executor} if self.engine == 'loop' else {}
      return _ENGINES[self.engine](
          chunks, thetas, inputs, states, table=table,
          batch_dim=self.batch_dim, remat=self.remat, first_id=first_id,
          training=training, input_gradients=input_gradients,
          loss_inside=self.loss_inside, skips=self.skips, **options)


def _CheckTable(table: schedule_lib.Table, num_devices: int,
                num_micro_batches: int,
                virtual_stages: int) -> schedule_lib.Table:
  """Validates a given table and checks it has the pipeline's K, M and v."""
  schedule_lib.Validate(table)
  given = (table.num_devices, table.num_micro_batches, table.virtual_stages)
  if given != (num_devices, num_micro_batches, virtual_stages):
    raise ValueError(
        f'schedule: the table {table.schedule!r} has (K, M, v) = {given}; '
        f'the pipeline has ({num_devices}, {num_micro_batches}, '
        f'{virtual_stages}).')
  return table


def _CheckSkips(skips: Sequence[Tuple[int, Optional[int]]],
                num_chunks: int) -> List[Tuple[int, Optional[int]]]:
  """Raises ValueError unless every skip goes from a chunk to a later one."""
  checked = []
  for skip in skips:
    if (not isinstance(skip, (tuple, list)) or len(skip) != 2 or
        not isinstance(skip[0], int) or
        not (skip[1] is None or isinstance(skip[1], int))):
      raise ValueError(f'skips={list(skips)}: {skip!r} is not a (source '
                       'chunk, target chunk or None) pair.')
    source, target = skip
    if not 0 <= source < num_chunks or (
        target is not None and not source < target < num_chunks):
      raise ValueError(f'skips={list(skips)}: {skip!r} must go from a chunk '
                       f'in [0, {num_chunks}) to a later chunk or None (the '
                       'output).')
    checked.append((source, target))
  return checked
