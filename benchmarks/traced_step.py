"""A real training step of a small pipeline, traced: who ran what, when.

`TraceStep` builds GPipeSequentialLayer over Lingvo FC cells, K stages on K
logical CPU devices (TF1 session), runs warm-up steps and one step with
FULL_TRACE, and reads from the kernels' step stats which chunk ran which
micro-batch and phase (forward, recompute, backward) when
(`lingvo_gpipe.engine.trace`). The loop engine is traced with its loops
lowered (`loop.LOWER_CONTROL_FLOW`), the only way step stats show the
kernels inside them. It then feeds the measured mean call times of each
chunk to the schedule simulator (lockstep ticks for the loop engine), which
assumes one free core per device, so that the measured step can be compared
with the simulated one.

    timeline = TraceStep(num_stages=4, num_micro=8, remat='always',
                         cells_per_stage=2, dim=256, micro_batch_size=16,
                         warmup_steps=2, engine='unrolled', virtual_stages=1)
    timeline.occupancy.bubble_fraction

TensorFlow and Lingvo are imported when a step is recorded.
"""

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

from benchmarks import models
from lingvo_gpipe.engine import trace
from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate


def RecordStep(num_stages: int, num_micro: int, remat: str,
               cells_per_stage: int, dim: int, micro_batch_size: int,
               warmup_steps: int, engine: str, virtual_stages: int,
               intra_op_threads: int = 0) -> Tuple[Any, Any]:
  """Runs training steps of FC cells as a pipeline; traces the last one.

  Args:
    num_stages: K; stage k runs on logical CPU device k.
    num_micro: M.
    remat: The remat mode.
    cells_per_stage: Lingvo FCLayers per chunk.
    dim: Their input and output size.
    micro_batch_size: Examples per micro-batch.
    warmup_steps: Untraced steps before the traced one.
    engine: 'unrolled' or 'loop' ('auto' is not resolved here).
    virtual_stages: v, chunks per device.
    intra_op_threads: Threads per op (0: TensorFlow's default); 1 makes each
      logical CPU device act as one core.

  Returns:
    (step_stats, table): the traced step's `RunMetadata.step_stats` and the
    schedule table it ran.
  """
  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils
  import numpy as np
  import tensorflow as tf
  from lingvo_gpipe import layers as gpipe_layers
  from lingvo_gpipe.engine import loop
  # pylint: enable=g-import-not-at-top
  if intra_op_threads:  # Before the session creates its thread pools.
    tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(2 * num_stages)
  devices = [f'/job:localhost/replica:0/task:0/device:CPU:{k}'
             for k in range(num_stages)]
  cells = models.FcCells(num_stages * virtual_stages * cells_per_stage, dim,
                         he_init=False)
  graph = tf.Graph()
  with graph.as_default(), loop.ObservableLoops():
    py_utils.GetOrCreateGlobalStepVar()
    layer = gpipe_layers.GPipeSequentialLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_stages=num_stages,
        virtual_stages=virtual_stages, num_micro_batches=num_micro,
        remat=remat, devices=devices, engine=engine).Instantiate()
    inputs = np.random.RandomState(0).standard_normal(
        [num_micro * micro_batch_size, dim]).astype(np.float32)
    outputs = layer.FProp(layer.theta, tf.constant(inputs))
    loss = tf.reduce_mean(tf.square(outputs))
    variables = layer.vars.Flatten()
    grads = tf.compat.v1.gradients(loss, variables,
                                   colocate_gradients_with_ops=True)
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.01)
    train_op = optimizer.apply_gradients(zip(grads, variables))
    table = schedule.BuildTable(layer.params.schedule, num_stages, num_micro,
                                virtual_stages)
    config = tf.compat.v1.ConfigProto(
        device_count={'CPU': num_stages},
        intra_op_parallelism_threads=intra_op_threads,
        inter_op_parallelism_threads=2 * num_stages if intra_op_threads else 0)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for _ in range(warmup_steps):
        sess.run(train_op)
      run_metadata = tf.compat.v1.RunMetadata()
      sess.run(train_op,
               options=tf.compat.v1.RunOptions(
                   trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
               run_metadata=run_metadata)
  return run_metadata.step_stats, table


@dataclasses.dataclass
class TracedStep:
  """One traced step, read as pipeline calls, and its simulation.

  Attributes:
    events: One `simulate.Event` per chunk call and phase, in seconds.
    devices: {stage: the devices its calls' kernels ran on}.
    occupancy: Step time, bubble fraction and utilization of the events.
    mean_durations: {phase: mean call time of each chunk (0.0: no call)}.
    simulated: The simulator fed with the mean forward and recompute +
      backward times (a recompute is timed as part of its backward call).
    table: The schedule table the step ran.
  """
  events: List[simulate.Event]
  devices: Dict[int, List[str]]
  occupancy: simulate.Occupancy
  mean_durations: Dict[str, List[float]]
  simulated: simulate.Simulation
  table: schedule.Table


def _MeanDuration(events: Sequence[simulate.Event], chunk: int,
                  phase: str) -> float:
  """Mean duration of the chunk's calls of one phase (0.0 if none)."""
  times = [e.end - e.start for e in events
           if e.chunk == chunk and e.phase == phase]
  return sum(times) / len(times) if times else 0.0


def TraceStep(num_stages: int, num_micro: int, remat: str,
              cells_per_stage: int, dim: int, micro_batch_size: int,
              warmup_steps: int, engine: str = 'unrolled',
              virtual_stages: int = 1,
              intra_op_threads: int = 0) -> TracedStep:
  """Records a step (see `RecordStep` for the arguments) and reads it.

  Returns:
    The TracedStep.

  Raises:
    ValueError: if the trace cannot be mapped to the pipeline's calls.
  """
  step_stats, table = RecordStep(num_stages, num_micro, remat,
                                 cells_per_stage, dim, micro_batch_size,
                                 warmup_steps, engine, virtual_stages,
                                 intra_op_threads)
  events, devices = trace.StepEvents(
      trace.StepKernels(step_stats), table, remat, engine)
  means = {phase: [_MeanDuration(events, c, phase)
                   for c in range(table.num_chunks)]
           for phase in schedule.PHASES}
  # The simulator assumes one free core per device; here K logical devices
  # share the host's cores. A recompute is timed as part of its backward call
  # (measured, it is not just another forward).
  simulated = simulate.Simulate(
      table, means['forward'],
      [r + b for r, b in zip(means['recompute'], means['backward'])],
      'never', lockstep=engine == 'loop')
  return TracedStep(events, devices,
                    simulate.StageOccupancy(events, num_stages), means,
                    simulated, table)
