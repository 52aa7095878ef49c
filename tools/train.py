r"""Trains a registered GPipe model with Lingvo's runner on K devices.

Lingvo's own `python -m lingvo.trainer --run_locally=cpu` gives its worker one
CPU device, so a pipeline has nowhere to put stage 2. This launcher runs the
same RunnerManager with four changes:

* the local TF server (graph mode) or the eager context has `--num_devices`
  CPU devices, and the cluster's model split is those K devices, so stage k
  of a `GPipeSequentialLayer` runs on CPU:k (or, with `--split_size=K` and
  R*K devices, R data-parallel towers of K devices each);
* the default job is `trainer_client` with checkpoints written by the
  trainer (`--checkpoint_in_trainer_cpu`): no controller, no 30 s start-up
  wait;
* variables start from stateless initializers seeded by their names (and
  the task's `random_seed`), `--stateless_vars_init`: every run, and every
  replica, starts from the same weights (Lingvo's trainer sets no graph
  seed, so its default initializers differ from run to run);
* progress goes to stdout as `step <n>  loss <l>  <x> examples/s` lines
  (the first says how long start-up took instead); Lingvo's full log goes to
  <logdir>/train_log.txt, TensorFlow's C++ log is quiet unless
  TF_CPP_MIN_LOG_LEVEL is set.

Every Lingvo trainer flag still works (`--use_eager`, `--job=evaler_dev`,
`--job=decoder_dev`, `--model_params_override`, ...). Running the same
command again continues from the last checkpoint in <logdir>/train.

  python tools/train.py --model=lm.GPipeCharLm --num_devices=4 \
      --logdir=/tmp/lm [--max_steps=300] [--use_eager]

On several machines (or processes), each runs one worker of TensorFlow's
gRPC cluster, and one client trains on all of them (graph mode):

  python tools/train.py --job=worker --task=T --num_devices=N \
      --cluster_spec=worker=host0:2222,host1:2222
  python tools/train.py --job=trainer_client --model=lm.GPipeCharLm \
      --cluster_spec=worker=host0:2222,host1:2222 --split_size=S \
      --logdir=/shared/lm

The client's model split is S of the cluster's devices, taken in task order
(task 0's devices, then task 1's, ...): R = all devices / S replicas, each
an S-stage pipeline (S <= N: every worker holds N / S of them; S > N: a
pipeline spans workers). Eval and decode jobs beside it run in the
client's process on S local CPU devices. A lost worker ends the run with one line; the same
command continues from the last checkpoint. docs/scaling_out.md has more.

The last line of a training run is

  trained <model>: steps=<n> loss <first> -> <last>, <x> examples/s, \
checkpoint <path>

Runs from any directory; tools/__init__.py says how it finds the repository
(and `params` in it).
"""

import os
import sys

if __name__ == '__main__':  # Run as a script: see tools/__init__.py.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  # TensorFlow's C++ errors at import on a CPU host (no CUDA driver, oneDNN
  # without AVX-512 for int32) are noise on a launcher's terminal; Python
  # raises for the errors that matter. TF_CPP_MIN_LOG_LEVEL=2 (or lower)
  # shows them again.
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

# pylint: disable=g-import-not-at-top,wrong-import-position
import logging
import re
import time

from absl import app
from absl import flags
from lingvo import compat as tf
from lingvo import model_registry
from lingvo import runners
from lingvo import trainer as lingvo_trainer
from lingvo.core import hyperparams
from lingvo.core import py_utils

import lingvo_gpipe
from lingvo_gpipe import GPipeSequentialLayer
from lingvo_gpipe import stacks
import params  # Registers the models.
from tools import cli
from tools import workers
# pylint: enable=g-import-not-at-top,wrong-import-position

flags.DEFINE_integer(
    'num_devices', 4, 'Local CPU devices. With one model split (the '
    'default) stage k of a GPipeSequentialLayer runs on CPU:k. With '
    '--job=worker: the devices this worker serves (its GPUs on a GPU host, '
    'else CPU devices); with --cluster_spec: the devices every worker must '
    'serve (default: what they serve).',
    lower_bound=1)
flags.DEFINE_integer(
    'split_size', None, 'K: devices of one model split (one pipeline); '
    '--num_devices=R*K with --split_size=K trains R data-parallel replicas '
    "(Lingvo's towers, gradients averaged). Default: --num_devices. With "
    "--cluster_spec: K of the cluster's devices in task order, R = all "
    'devices / K (K may exceed a worker\'s devices: a pipeline across '
    'workers).',
    lower_bound=1)
flags.DEFINE_float(
    'worker_timeout', 120, 'With --cluster_spec: seconds to wait for every '
    'worker to answer at start, and the longest one session call (a step, '
    'a checkpoint) may take before the run fails.', lower_bound=1)
flags.DEFINE_integer(
    'max_steps', None, 'Train until this global step (overrides the '
    "model's task.train.max_steps).", lower_bound=1)
flags.DEFINE_integer('log_every', 10, 'Print progress every this many steps.',
                     lower_bound=1)

FLAGS = flags.FLAGS
PROG = 'train.py'
# Lingvo flags whose default differs here: a local CPU run, one trainer job
# that writes its own checkpoints, the same initial weights in every run.
# Applied in main(), not at import, so that importing this module leaves
# Lingvo's defaults alone.
LAUNCHER_DEFAULTS = {
    'run_locally': 'cpu',
    'mode': 'sync',
    'job': 'trainer_client',
    'checkpoint_in_trainer_cpu': True,
    'stateless_vars_init': True,
}

# What Lingvo's trainers (graph and eager) log after each step, and what its
# evalers and decoders log after each checkpoint.
_TRAIN_LOG = re.compile(
    r'^step:\s*(\d+), steps/sec: \S+, examples/sec: \S+ (.*)$')
_EVAL_LOG = re.compile(r'^((?:eval|decoder)_\w+): step:\s*(\d+), (.*)$')
# Lingvo's eager evalers and decoders log without their job's name.
_EAGER_EVAL_LOG = re.compile(r'^step:\s*(\d+) ((?:\S+:\S+ ?)+)$')
_NOT_REPORTED = ('examples/sec', 'num_samples_in_batch', 'total_samples')


class Progress(logging.Handler):
  """Turns Lingvo's per-step log records into short progress lines.

  Attributes:
    steps: (step, loss, examples in the step, time) of every training step.
    results: {job: (step, {metric: value})} of every eval or decode job.
  """

  def __init__(self, log_every, eager_eval_job, start=None):
    """Prints every `log_every` steps; eager evals count as `eager_eval_job`.

    Args:
      log_every: Print every this many steps (and the first step).
      eager_eval_job: The job name of eager eval results.
      start: When the run started (time.time()); default now.
    """
    super().__init__()
    self._log_every = log_every
    self._eager_eval_job = eager_eval_job
    self._start = time.time() if start is None else start
    self.steps = []
    self.results = {}

  def ExamplesPerSecond(self):
    """Examples/s after the first step (graph building); None before two."""
    if len(self.steps) < 2:
      return None
    examples = sum(n for _, _, n, _ in self.steps[1:])
    return examples / (self.steps[-1][3] - self.steps[0][3])

  def Speed(self):
    """The rate as printed: '<x> examples/s', or the first step's time."""
    rate = self.ExamplesPerSecond()
    if rate is not None:
      return f'{rate:9.1f} examples/s'
    return (f'first step {self.steps[0][3] - self._start:.1f} s after start '
            '(building, restoring)')

  def emit(self, record):
    message = record.getMessage()
    train = _TRAIN_LOG.match(message)
    if train:
      values = dict(re.findall(r'(\S+):(\S+)', train.group(2)))
      step = int(train.group(1))
      self.steps.append((step, float(values['loss']),
                         float(values['num_samples_in_batch']),
                         record.created))
      if step % self._log_every == 0 or len(self.steps) == 1:
        print(f'step {step:6d}  loss {self.steps[-1][1]:.4f}  '
              f'{self.Speed()}', flush=True)
      return
    evaluation = _EVAL_LOG.match(message)
    if evaluation:
      job, step, pairs = evaluation.groups()
    else:
      evaluation = _EAGER_EVAL_LOG.match(message)
      if not evaluation:
        return
      job = self._eager_eval_job
      step, pairs = evaluation.groups()
    values = {k: float(v) for k, v in re.findall(r'(\S+):\s*([^,\s]+)', pairs)
              if k not in _NOT_REPORTED}
    self.results[job] = (int(step), values)


class _UserWarnings(logging.Filter):
  """Errors, and warnings from lingvo_gpipe or params/ (not TF's noise)."""

  _OURS = tuple(
      os.path.dirname(package.__file__) + os.sep
      for package in (lingvo_gpipe, params))

  def filter(self, record):
    return (record.levelno >= logging.ERROR or
            record.pathname.startswith(self._OURS))


class FinalCheckpointTrainer(runners.Trainer):
  """Lingvo's graph-mode trainer that also checkpoints the step it stops at.

  With --checkpoint_in_trainer_cpu Lingvo saves only every save_interval
  steps, so the steps after the last interval would be lost to a restart.
  """

  def _ShouldStop(self, sess=None, step=None, check_early_stop=True):
    stop = super()._ShouldStop(sess, step, check_early_stop)
    if stop and sess is not None and FLAGS.checkpoint_in_trainer_cpu:
      self._checkpointer.Save(sess, step, sync=True)
    return stop

  def _GetSession(self, **kwargs):
    """On a cluster: calls bounded by --worker_timeout, a lost worker ends."""
    if not _OnCluster():
      return super()._GetSession(**kwargs)
    graph = kwargs.pop('graph', self._graph)
    config = py_utils.SessionConfig(**kwargs)
    config.operation_timeout_in_ms = int(FLAGS.worker_timeout * 1000)
    return workers.ExitOnLostWorker(self._tf_master, _ExitOnLostWorker,
                                    graph=graph, config=config)


def _ExitOnLostWorker(error):
  """Ends the run with one line: the lost worker and how to go on."""
  lost = workers.LostWorker(error, workers.WorkerAddresses(FLAGS.cluster_spec))
  checkpoint = tf.train.latest_checkpoint(os.path.join(FLAGS.logdir, 'train'))
  resume = (f'it continues from the last checkpoint, {checkpoint}'
            if checkpoint else 'it starts again (no checkpoint yet)')
  print(f'{PROG}: error: lost {lost} (--cluster_spec); restart it and run '
        f'this command again: {resume}.', file=sys.stderr, flush=True)
  # Not sys.exit: the session cannot close without the worker, and the
  # runners may be threads.
  os._exit(1)  # pylint: disable=protected-access


def _SplitSize():
  return FLAGS.split_size or FLAGS.num_devices


def _OnLocalCpus():
  """Whether this run is local on CPU (else Lingvo's cluster flags rule)."""
  return FLAGS.run_locally == 'cpu'


def _OnCluster():
  """Whether this run uses the workers of --cluster_spec (not TPU, local)."""
  return bool(FLAGS.cluster_spec) and not FLAGS.tpu


class LocalDevicesRunnerManager(lingvo_trainer.RunnerManager):
  """Lingvo's RunnerManager with a K-device model split on this machine.

  On a cluster (`cluster_workers`) the model split is K of the workers'
  devices in task order (`_ConfigureClusterJobs`), and eval and decode jobs
  run in this process on K local CPU devices. Otherwise, with --run_locally
  other than 'cpu' (e.g. --tpu=...), it is Lingvo's own.
  """

  def __init__(self, model, cluster_workers=None):
    """Manages the runners of `model`.

    Args:
      model: --model.
      cluster_workers: The workers.Workers of --cluster_spec, or None for a
        local (or TPU) run.
    """
    super().__init__(model)
    self._servers = []
    self._workers = cluster_workers

  @property
  def Trainer(self):  # pylint: disable=invalid-name
    return super().Trainer if FLAGS.use_eager else FinalCheckpointTrainer

  def MaybeConfigRunLocally(self):
    super().MaybeConfigRunLocally()
    if self._workers:
      # Lingvo's MaybeConfigRunDistributed sets the master only for a lone
      # trainer_client job; this covers 'trainer_client,evaler_dev' too.
      FLAGS.tf_master = f'grpc://{self._workers.addresses[0]}'
      # Eval and decode jobs: the model split's K devices, in this process.
      config = tf.compat.v1.ConfigProto(device_count={'CPU': _SplitSize()})
      self._servers = [tf.distribute.Server.create_local_server(config=config)]
      return
    if FLAGS.use_eager or not _OnLocalCpus():
      return
    # One server for training and one for eval/decode jobs that run beside
    # it (Lingvo gives those independent sessions), both with K devices.
    config = tf.compat.v1.ConfigProto(device_count={'CPU': FLAGS.num_devices})
    self._servers = [
        tf.distribute.Server.create_local_server(config=config)
        for _ in range(2)
    ]
    FLAGS.tf_master = self._servers[0].target

  def MaybeLaunchTensorFlow(self):
    if not self._workers:  # On a cluster the workers answered in main().
      super().MaybeLaunchTensorFlow()

  def UpdateClusterParamsFromFlags(self, cluster, job_name):
    super().UpdateClusterParamsFromFlags(cluster, job_name)
    if self._workers:
      self._ConfigureClusterJobs(cluster)
      return
    if not _OnLocalCpus():
      return
    for job in (cluster.controller, cluster.worker, cluster.ps, cluster.evaler,
                cluster.decoder):
      job.cpus_per_replica = FLAGS.num_devices
      job.devices_per_split = _SplitSize()

  def _ConfigureClusterJobs(self, cluster):
    """Lingvo's cluster params: one Lingvo replica per model split.

    Lingvo keeps a split inside a replica and lists a job's devices sorted
    by task, so replicas of K devices over all the workers' devices are the
    model splits in task order: within a worker when K divides its devices,
    else across workers. Variables stay on the workers' CPUs (Lingvo's ps).

    Args:
      cluster: Lingvo's cluster params, updated in place.
    """
    split_size = _SplitSize()
    cluster.worker.name = cluster.ps.name = f'/job:{workers.JOB}'
    cluster.worker.replicas = workers.NumReplicas(self._workers, split_size)
    cluster.worker.devices_per_split = split_size
    if self._workers.device_type == 'GPU':
      cluster.worker.gpus_per_replica = split_size
    else:
      cluster.worker.cpus_per_replica = split_size
    cluster.ps.replicas = len(self._workers.addresses)
    cluster.ps.cpus_per_replica = self._workers.cpus_per_worker
    cluster.ps.gpus_per_replica = 0
    for job in (cluster.evaler, cluster.decoder):
      job.name = '/job:localhost'
      job.replicas = 1
      job.gpus_per_replica = 0
      job.cpus_per_replica = split_size
      job.devices_per_split = split_size

  def GetParamsForDataset(self, job_name, dataset_name):
    cfg = super().GetParamsForDataset(job_name, dataset_name)
    if FLAGS.max_steps is not None:
      cfg.train.max_steps = FLAGS.max_steps
      cfg.task.train.max_steps = FLAGS.max_steps
    return cfg

  def _CreateRunner(self, job, model_task_name, logdir, tf_master, trial):
    local = not tf_master or (self._workers and
                              job.startswith(('evaler_', 'decoder_')))
    if local and self._servers:
      tf_master = self._servers[-1].target
    return super()._CreateRunner(job, model_task_name, logdir, tf_master,
                                 trial)


def CheckStagesFitDevices(task_params, num_devices):
  """Raises ValueError if a pipeline in the task has more stages than devices.

  Args:
    task_params: A Lingvo task's Params.
    num_devices: Devices of one model split.

  Raises:
    ValueError: naming the pipeline, its num_stages and the devices.
  """
  def Visit(path, p):
    if isinstance(p, (list, tuple)):
      for i, item in enumerate(p):
        Visit(f'{path}[{i}]', item)
    if not isinstance(p, hyperparams.Params):
      return
    cls = getattr(p, 'cls', None)
    if isinstance(cls, type) and issubclass(cls, stacks.PipeliningLayer):
      num_stages = GPipeSequentialLayer.FromPipeliningLayer(p).num_stages
      if num_stages > num_devices:
        raise ValueError(
            f'{path} has {num_stages} stages (its splits or cell_tpl) and needs'
            f' a model split of at least {num_stages} devices; got '
            f'{num_devices} (--num_devices, --split_size). Pass '
            f'--num_devices={num_stages} or fewer {path}.splits.')
      return  # Its pipeline_tpl is a template of knobs, not a pipeline.
    if (cls is GPipeSequentialLayer and p.num_stages is not None and
        p.num_stages > num_devices):
      raise ValueError(
          f'{path}.num_stages={p.num_stages} needs a model split of at least '
          f'{p.num_stages} devices; got {num_devices} (--num_devices, '
          f'--split_size). Pass --num_devices={p.num_stages} or '
          f"--model_params_override='{path}.num_stages: {num_devices}'.")
    for name, value in p.IterParams():
      Visit(f'{path}.{name}', value)

  Visit('task', task_params)


def _CheckModel(name, num_devices):
  """Fails with one line unless `name` is a model that fits the devices.

  Args:
    name: --model.
    num_devices: --num_devices, or None to skip the fit check.
  """
  cli.CheckRegisteredModel(PROG, name)
  if num_devices is None:
    return
  try:
    CheckStagesFitDevices(model_registry.GetParams(name, 'Train').task,
                          num_devices)
  except ValueError as e:
    cli.Fail(PROG, e)


def _RouteLogs(logdir):
  """Sends TF/Lingvo logs to <logdir>/train_log.txt and progress to stdout.

  Args:
    logdir: --logdir.

  Returns:
    The Progress handler.
  """
  os.makedirs(logdir, exist_ok=True)
  log_file = logging.FileHandler(os.path.join(logdir, 'train_log.txt'))
  log_file.setFormatter(logging.Formatter('%(asctime)s %(message)s'))
  warnings = logging.StreamHandler(sys.stderr)
  warnings.setLevel(logging.WARNING)
  warnings.addFilter(_UserWarnings())
  # Lingvo's names of its evaler and decoder jobs' outputs ('eval_dev', ...).
  eval_jobs = [job.replace('evaler_', 'eval_', 1)
               for job in FLAGS.job.split(',')
               if job.startswith(('evaler_', 'decoder_'))]
  progress = Progress(FLAGS.log_every, ','.join(eval_jobs))
  for name in ('absl', 'tensorflow'):  # Lingvo logs through absl.
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.handlers[:] = [log_file, warnings, progress]
  return progress


def _Report(progress):
  """Prints one line per finished job (see the module docstring)."""
  for job, (step, values) in sorted(progress.results.items()):
    metrics = ', '.join(f'{k} {v:.4f}' for k, v in sorted(values.items()))
    print(f'{job} {FLAGS.model} at step {step}: {metrics}')
  if not any(job.startswith('trainer') for job in FLAGS.job.split(',')):
    return
  checkpoint = tf.train.latest_checkpoint(os.path.join(FLAGS.logdir, 'train'))
  if not progress.steps:
    print(f'trained {FLAGS.model}: nothing to do, checkpoint {checkpoint} is '
          'at or past max_steps')
    return
  first, last = progress.steps[0], progress.steps[-1]
  print(f'trained {FLAGS.model}: steps={last[0]} loss {first[1]:.4f} -> '
        f'{last[1]:.4f}, {progress.Speed().strip()}, checkpoint {checkpoint}')


def _CreateLocalEagerDevices(num_devices):
  """Splits the CPU into K logical devices (before TF initializes)."""
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)


def _ServeWorker():
  """--job=worker: serves task --task of --cluster_spec until killed."""
  if not FLAGS.cluster_spec:
    cli.Fail(PROG, '--job=worker serves one task of --cluster_spec; pass e.g. '
             '--cluster_spec=worker=host0:2222,host1:2222 --task=0.')
  try:
    workers.Serve(workers.WorkerAddresses(FLAGS.cluster_spec), FLAGS.task,
                  FLAGS.num_devices)
  except workers.ClusterError as e:
    cli.Fail(PROG, e)


def _DiscoverWorkers():
  """Checks the client's flags against the workers of --cluster_spec.

  Waits (up to --worker_timeout) until every worker answers. Sets
  --num_devices to the devices of one worker and clears --run_locally.

  Returns:
    The workers.Workers.
  """
  jobs = FLAGS.job.split(',')
  others = [job for job in jobs if job != 'trainer_client'
            and not job.startswith(('evaler_', 'decoder_'))]
  if others or 'trainer_client' not in jobs:
    cli.Fail(PROG, f'--job={FLAGS.job} with --cluster_spec: each worker runs '
             '--job=worker, the client --job=trainer_client (and evaler_* or '
             'decoder_* jobs beside it); an evaler or decoder alone needs no '
             'cluster: drop --cluster_spec and pass --num_devices=K.')
  if FLAGS['run_locally'].present and FLAGS.run_locally:
    cli.Fail(PROG, f'--run_locally={FLAGS.run_locally} trains on devices of '
             "this process, --cluster_spec on the workers'; pass one of them.")
  if FLAGS.use_eager:
    cli.Fail(PROG, '--use_eager runs in this process only; with '
             '--cluster_spec the client runs a graph on the workers: drop '
             '--use_eager.')
  asked = FLAGS.num_devices if FLAGS['num_devices'].present else None
  try:
    found = workers.Discover(workers.WorkerAddresses(FLAGS.cluster_spec),
                             FLAGS.worker_timeout, asked)
    FLAGS.num_devices = found.devices_per_worker
    workers.NumReplicas(found, _SplitSize())
  except workers.ClusterError as e:
    cli.Fail(PROG, e)
  FLAGS.run_locally = ''
  return found


def main(argv):
  for name, value in LAUNCHER_DEFAULTS.items():
    FLAGS.set_default(name, value)  # Flags given on the command line win.
  if len(argv) > 1:
    cli.Fail(PROG, f'unexpected arguments {argv[1:]}; every setting is a flag.')
  if FLAGS.job == 'worker':
    _ServeWorker()
    return
  if not FLAGS.model:
    cli.Fail(PROG, '--model is required, e.g. --model=lm.GPipeCharLm.')
  if not FLAGS.logdir:
    cli.Fail(PROG, '--logdir is required, e.g. --logdir=/tmp/lm.')
  cluster_workers = _DiscoverWorkers() if _OnCluster() else None
  if not cluster_workers and FLAGS.num_devices % _SplitSize():
    cli.Fail(PROG, f'--split_size={FLAGS.split_size} must divide '
             f'--num_devices={FLAGS.num_devices}.')
  progress = _RouteLogs(FLAGS.logdir)
  _CheckModel(FLAGS.model,
              _SplitSize() if _OnLocalCpus() or cluster_workers else None)
  py_utils.SetEagerMode(FLAGS.use_eager)
  if FLAGS.use_eager and _OnLocalCpus():
    _CreateLocalEagerDevices(FLAGS.num_devices)
  try:
    LocalDevicesRunnerManager(FLAGS.model, cluster_workers).Start()
  except workers.LOST_WORKER_ERRORS as e:
    if not cluster_workers:
      raise
    _ExitOnLostWorker(e)  # E.g. listing the devices, before the first step.
  _Report(progress)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.FlagsParser(PROG))
