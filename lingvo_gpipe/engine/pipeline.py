"""The GPipe engine: K stage functions run over M micro-batches on K devices.

Knows TensorFlow, not Lingvo. A stage function maps
`(theta, inputs, state, micro_batch_id)` to `(outputs, state)` (see
`stage.py`). The engine splits the inputs into micro-batches, calls stage k on
micro-batch m under `tf.device(devices[k])` in the order of the GPipe
schedule (`planning.schedule`), optionally re-materializes each call in the
backward pass, and concatenates the last stage's outputs back in order.
Gradients of the M micro-batches add up to the gradient of the mini-batch, so
the step is the same as without the pipeline. It builds in TF1 graph mode,
inside `tf.function` and under XLA (`jit_compile=True`).

Two engines build the same step: 'unrolled' (`unrolled.py`, K x M calls in
the graph) and 'loop' (`loop.py`, while loops over clock ticks: the graph
does not grow with M).

    pipe = Pipeline([stage0_fn, stage1_fn], devices=['/cpu:0', '/cpu:1'],
                    num_micro_batches=4, remat='always', engine='loop')
    outputs, states = pipe([theta0, theta1], [x], step=global_step)
"""

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from lingvo_gpipe.engine import loop
from lingvo_gpipe.engine import microbatch
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.engine import unrolled
from lingvo_gpipe.planning import checks
from lingvo_gpipe.planning import schedule

# The engines by name (`schedule.ENGINES`): the same step, built two ways.
_ENGINES = {'unrolled': unrolled.Run, 'loop': loop.Run}
assert tuple(_ENGINES) == schedule.ENGINES


def RematModes(engine: str) -> Tuple[str, ...]:
  """The remat modes `engine` supports."""
  return (schedule.LOOP_REMAT_MODES if engine == 'loop' else
          schedule.REMAT_MODES)


class Pipeline:
  """Runs stage functions as a GPipe pipeline.

  Attributes:
    num_stages: K.
    num_micro_batches: M.
    devices: The K device strings ('' leaves placement to TensorFlow).
    batch_dim: The dimension inputs are split along and outputs merged along.
    remat: 'always', 'except_last' or 'never'.
    engine: 'unrolled' or 'loop'.
  """

  def __init__(self,
               stage_fns: Sequence[stage_lib.StageFn],
               devices: Sequence[str],
               num_micro_batches: int,
               batch_dim: int = 0,
               remat: str = 'always',
               engine: str = 'unrolled',
               name: str = 'gpipe'):
    """Checks the configuration; builds nothing yet.

    Args:
      stage_fns: K stage functions, see `stage.py`.
      devices: K device strings, one per stage.
      num_micro_batches: M >= 1.
      batch_dim: The batch dimension of every input and output.
      remat: Which calls recompute their forward pass in the backward pass:
        'always', 'except_last' (all but the last micro-batch) or 'never'.
      engine: 'unrolled' or 'loop' (which supports remat 'always' and
        'never').
      name: Name scope of the pipeline's ops.

    Raises:
      ValueError: on an empty stage list, a device list of another length, a
        non-positive M, a negative batch_dim, an unknown remat mode or
        engine, or a remat mode the engine does not support.
    """
    if not stage_fns:
      raise ValueError('stage_fns is empty; a pipeline needs at least 1 stage.')
    if len(devices) != len(stage_fns):
      raise ValueError(f'devices has {len(devices)} entries {list(devices)} '
                       f'but there are {len(stage_fns)} stages; give one '
                       'device per stage.')
    checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
    checks.CheckBatchDim(batch_dim)
    if engine == 'auto':
      raise ValueError("engine='auto' is the layer's choice; give the engine "
                       f'{list(schedule.ENGINES)} (schedule.ChooseEngine).')
    schedule.CheckEngine(engine, remat)
    self._stage_fns = list(stage_fns)
    self.num_stages = len(stage_fns)
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
               training: bool = True
              ) -> Tuple[List[Optional[tf.Tensor]], List[Any]]:
    """Builds one pipelined pass.

    Args:
      thetas: K nests of weights (tensors or variables), one per stage.
      inputs: The mini-batch inputs, tensors or None.
      states: K nests of initial stage states (default: empty).
      step: Integer scalar; micro-batch m of this call gets the id
        step * M + m (default step 0).
      training: If False, nothing is set up for recompute.

    Returns:
      (outputs, states): the last stage's outputs merged along batch_dim, and
      each stage's state after the last micro-batch.

    Raises:
      ValueError: if thetas or states do not have K entries, or the batch does
        not split into M micro-batches.
    """
    num_stages, num_micro = self.num_stages, self.num_micro_batches
    if len(thetas) != num_stages:
      raise ValueError(f'thetas has {len(thetas)} entries, expected '
                       f'{num_stages}.')
    states = list(states) if states is not None else [()] * num_stages
    if len(states) != num_stages:
      raise ValueError(f'states has {len(states)} entries, expected '
                       f'{num_stages}.')
    batch = microbatch.StaticBatchSize(inputs, self.batch_dim)
    if batch is not None:
      microbatch.MicroBatchSize(batch, num_micro)

    with tf.name_scope(self._name):
      with tf.device(self.devices[0]):
        first_id = (tf.constant(0, tf.int64) if step is None else
                    tf.cast(step, tf.int64) * num_micro)
      # The unrolled engine's forward calls are inlined into this graph.
      stages = [
          stage_lib.Stage(fn, f'stage {k}', device,
                          pin_forward=self.engine == 'unrolled')
          for k, (fn, device) in enumerate(zip(self._stage_fns, self.devices))
      ]
      return _ENGINES[self.engine](
          stages, thetas, inputs, states, num_micro_batches=num_micro,
          batch_dim=self.batch_dim, remat=self.remat, first_id=first_id,
          training=training)
