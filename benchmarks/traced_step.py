"""A real training step of a small pipeline, traced: who ran what, when.

`TraceStep` builds GPipeSequentialLayer over Lingvo FC cells with the given
schedule, K stages on K logical CPU devices (TF1 session, as Lingvo's
trainer builds it; with `processes`, stage k in a server process pinned to
a core of its own, `loopback.PinnedCluster`), runs warm-up steps and one
step with FULL_TRACE, and
reads from the kernels' step stats which chunk ran which micro-batch and
phase (forward, recompute, backward) when (`lingvo_gpipe.engine.trace`).
A schedule with the loss inside (`schedule.SCHEDULES[name].loss_inside`,
e.g. '1f1b') gets a last cell that computes the loss, mean(y^2), in the
last chunk; with the loss outside the same loss is computed after the
pipeline. The loop engine's loops are built lowered
(`control_flow.ObservableLoops`), the only way step stats show the kernels
inside them; the executor is the one training runs ('auto': per-device
loops in a TF1 graph), which the trace records. It then feeds the measured
mean call times of each chunk to the schedule simulator, timed as that
executor runs (lockstep ticks, or each device on its own), which assumes one
free core per device, so that the measured step can be compared with the
simulated one.

    timeline = TraceStep(num_stages=4, num_micro=8, remat='always',
                         cells_per_stage=2, dim=256, micro_batch_size=16,
                         warmup_steps=2, engine='unrolled', virtual_stages=1)
    timeline.occupancy.bubble_fraction

TensorFlow and Lingvo are imported when a step is recorded.
"""

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks import loopback
from benchmarks import models
from lingvo_gpipe.engine import trace
from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate


def RecordStep(num_stages: int, num_micro: int, remat: str,
               cells_per_stage: int, dim: int, micro_batch_size: int,
               warmup_steps: int, engine: str, virtual_stages: int,
               intra_op_threads: int = 0,
               schedule_name: str = 'gpipe',
               processes: bool = False
              ) -> Tuple[Any, schedule.Table, float]:
  """Runs training steps of FC cells as a pipeline; traces the last one.

  Args:
    num_stages: K; stage k runs on logical CPU device k.
    num_micro: M.
    remat: The remat mode.
    cells_per_stage: Lingvo FCLayers per chunk (the last chunk also gets
      the loss cell when the schedule has the loss inside).
    dim: Their input and output size.
    micro_batch_size: Examples per micro-batch.
    warmup_steps: Untraced steps before the traced one.
    engine: 'unrolled' or 'loop' ('auto' is not resolved here).
    virtual_stages: v, chunks per device.
    intra_op_threads: Threads per op (0: TensorFlow's default); 1 makes each
      logical CPU device act as one core.
    schedule_name: A key of `schedule.SCHEDULES`.
    processes: Stage k in a server process of its own pinned to one core
      (`loopback.PinnedCluster`) instead of on logical CPU device k.

  Returns:
    (step_stats, table, transfer_s): the traced step's
    `RunMetadata.step_stats`, the schedule table it ran (the layer's
    pipeline builds the same `schedule.BuildTable` of the schedule, K, M and
    v) and, with `processes`, what passing one micro-batch's activations
    from a server to the next costs each of them (`TransferSeconds`; 0.0 on
    logical devices, which share memory).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if intra_op_threads:  # Before the session creates its thread pools.
    tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(2 * num_stages)
  with (loopback.PinnedCluster(num_stages, intra_op_threads) if processes
        else contextlib.nullcontext()) as servers:
    step_stats, table = _RecordStep(
        servers, num_stages, num_micro, remat, cells_per_stage, dim,
        micro_batch_size, warmup_steps, engine, virtual_stages,
        intra_op_threads, schedule_name)
    transfer_s = TransferSeconds(
        servers, [micro_batch_size, dim]) if servers else 0.0
  return step_stats, table, transfer_s


def TransferSeconds(servers: loopback.LoopbackCluster, shape: Sequence[int],
                    repeats: int = 21) -> float:
  """What passing a float32 tensor from task 0 to task 1 costs each task.

  Times (medians of `repeats`, interleaved) a tensor drawn on task 0 and
  summed on task 1 against the same on task 0 alone; the difference is the
  transfer, from the sender's first byte to the receiver's last, and each
  task does about half of it (serializing, parsing), the share
  `simulate.Simulate(transfers_busy=True)` charges each.

  Args:
    servers: At least two tasks.
    shape: The tensor's shape.
    repeats: Runs of each.

  Returns:
    Seconds (at least 0).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  graph = tf.Graph()
  with graph.as_default():
    with tf.device(servers.Device(0)):
      x = tf.random.uniform(shape)
      here = tf.reduce_sum(x)
    with tf.device(servers.Device(1)):
      there = tf.reduce_sum(x)
  times = {here: [], there: []}
  with tf.compat.v1.Session(servers.target, graph=graph) as sess:
    for fetch in (here, there):  # Warm-up.
      sess.run(fetch)
    for _ in range(repeats):
      for fetch in (here, there):
        start = time.perf_counter()
        sess.run(fetch)
        times[fetch].append(time.perf_counter() - start)
  return max(statistics.median(times[there]) -
             statistics.median(times[here]), 0.0) / 2


def _RecordStep(servers, num_stages, num_micro, remat, cells_per_stage, dim,
                micro_batch_size, warmup_steps, engine, virtual_stages,
                intra_op_threads, schedule_name):
  """`RecordStep` on `servers` (a `loopback.LoopbackCluster`), or on logical
  CPU devices of this process (None)."""
  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils
  import numpy as np
  import tensorflow as tf
  from lingvo_gpipe import layers as gpipe_layers
  from lingvo_gpipe.engine import control_flow
  # pylint: enable=g-import-not-at-top
  loss_inside = schedule.CheckSchedule(schedule_name).loss_inside
  if servers:
    devices = [servers.Device(k) for k in range(num_stages)]
  else:
    devices = [f'/job:localhost/replica:0/task:0/device:CPU:{k}'
               for k in range(num_stages)]
  num_chunks = num_stages * virtual_stages
  cells = models.FcCells(num_chunks * cells_per_stage, dim, he_init=False)
  partition = [cells_per_stage] * num_chunks
  if loss_inside:  # The last chunk ends in the loss, a scalar per call.
    cells.append(models.LossCell())
    partition[-1] += 1
  graph = tf.Graph()
  with graph.as_default(), control_flow.ObservableLoops():
    py_utils.GetOrCreateGlobalStepVar()
    layer = gpipe_layers.GPipeSequentialLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_stages=num_stages,
        virtual_stages=virtual_stages, num_micro_batches=num_micro,
        partition=partition, remat=remat, devices=devices, engine=engine,
        schedule=schedule_name).Instantiate()
    inputs = np.random.RandomState(0).standard_normal(
        [num_micro * micro_batch_size, dim]).astype(np.float32)
    outputs = layer.FProp(layer.theta, tf.constant(inputs))
    # With the loss inside, FProp returns the mean over micro-batches of the
    # last cell's mean(y^2): the same loss.
    loss = outputs if loss_inside else tf.reduce_mean(tf.square(outputs))
    variables = layer.vars.Flatten()
    grads = tf.compat.v1.gradients(loss, variables,
                                   colocate_gradients_with_ops=True)
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.01)
    train_op = optimizer.apply_gradients(zip(grads, variables))
    table = schedule.BuildTable(layer.params.schedule, num_stages, num_micro,
                                virtual_stages)
    if servers:
      session = tf.compat.v1.Session(servers.target, graph=graph)
    else:
      session = tf.compat.v1.Session(
          graph=graph,
          config=tf.compat.v1.ConfigProto(
              device_count={'CPU': num_stages},
              intra_op_parallelism_threads=intra_op_threads,
              inter_op_parallelism_threads=2 * num_stages if intra_op_threads
              else 0))
    with session as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      # The loss too, as a trainer fetches it: with the loss inside, the last
      # chunk's forwards compute it only for that fetch.
      for _ in range(warmup_steps):
        sess.run([train_op, loss])
      run_metadata = tf.compat.v1.RunMetadata()
      sess.run([train_op, loss],
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
    simulated: The simulator fed with the mean forward, recompute +
      backward (a recompute is timed as part of its backward call) and, for
      a table that splits the backward, weight-gradient times, timed as the
      executor runs the step.
    table: The schedule table the step ran.
    executor: The loop engine's executor that ran the step, read from the
      trace ('lockstep' or 'per_device'); None for the unrolled engine.
    transfer_s: What a transfer of one micro-batch's activations between
      stages costs each side (`TransferSeconds`; 0.0 on logical devices),
      which the simulation charges both devices.
  """
  events: List[simulate.Event]
  devices: Dict[int, List[str]]
  occupancy: simulate.Occupancy
  mean_durations: Dict[str, List[float]]
  simulated: simulate.Simulation
  table: schedule.Table
  executor: Optional[str] = None
  transfer_s: float = 0.0


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
              intra_op_threads: int = 0,
              schedule_name: str = 'gpipe',
              processes: bool = False) -> TracedStep:
  """Records a step (see `RecordStep` for the arguments) and reads it.

  Returns:
    The TracedStep.

  Raises:
    ValueError: if the trace cannot be mapped to the pipeline's calls.
  """
  step_stats, table, transfer_s = RecordStep(
      num_stages, num_micro, remat, cells_per_stage, dim, micro_batch_size,
      warmup_steps, engine, virtual_stages, intra_op_threads, schedule_name,
      processes)
  kernels = trace.StepKernels(step_stats)
  executor = None if engine == 'unrolled' else trace.Executor(kernels)
  events, devices = trace.StepEvents(kernels, table, remat, engine)
  means = {phase: [_MeanDuration(events, c, phase)
                   for c in range(table.num_chunks)]
           for phase in schedule.PHASES}
  # The simulator assumes one free core per device; here K logical devices
  # share the host's cores. A recompute is timed as part of its backward call
  # (measured, it is not just another forward). Lockstep ticks only for the
  # lockstep executor: per-device loops wait only for what they receive.
  # A split backward's B and W are timed apart: backward_costs holds both,
  # weight_costs the W part. Between processes a transfer costs both sides.
  simulated = simulate.Simulate(
      table, means['forward'],
      [r + b + w for r, b, w in zip(means['recompute'], means['backward'],
                                    means['weight'])],
      'never', lockstep=executor == 'lockstep',
      weight_costs=means['weight'] if table.split_backward else None,
      transfer_cost=transfer_s, transfers_busy=processes)
  return TracedStep(events, devices,
                    simulate.StageOccupancy(events, num_stages), means,
                    simulated, table, executor, transfer_s)
