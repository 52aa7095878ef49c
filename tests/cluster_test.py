"""tools/train.py on a cluster: workers on loopback ports, one trainer client.

Two `tools/train.py --job=worker --num_devices=2` processes serve a cluster
of 2 x 2 CPU devices, started once for the module. On it, as a user would
run them:

* `--split_size=2`: 2 replicas of a 2-stage pipeline, one per worker; the
  losses equal the local `--num_devices=4 --split_size=2` run's.
* `--split_size=4`: one 4-stage pipeline across both workers (stage k on the
  k-th device of the cluster, as the step stats show); worker 1 is killed
  with SIGKILL while it trains: the client fails within a bounded time with
  one line, and after the worker restarts the same command continues from
  the last checkpoint to the same losses and variables as the local
  `--num_devices=4` run.
* Bad cluster flags fail before anything is built, with one line naming the
  flag.

Every process started here is killed when the module ends, and with
PR_SET_PDEATHSIG when this process dies.
"""

import collections
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import threading
import time

from absl.testing import flagsaver
import pytest
from lingvo import compat as tf
from lingvo.core import py_utils

from benchmarks import loopback
import engine_util
import launcher_util
import tool_util
from tools import train
from tools import workers

MODEL = launcher_util.MODEL
STEPS = 8
# The bound on the client's failure after a worker is killed (measured
# 0.2 s: the step fails as soon as the connection is refused).
FAIL_WITHIN_S = 30
_PR_SET_PDEATHSIG = 1
_COMMON = [f'--model={MODEL}', '--log_every=1']
_TWO_STAGES = launcher_util.TWO_STAGES
LOCAL_RUNS = {
    'local_replicas': _COMMON + [
        '--num_devices=4', '--split_size=2', _TWO_STAGES, '--max_steps=2',
        '--logdir={tmp}/local_replicas'],
    'local_pipeline': _COMMON + [
        '--num_devices=4', f'--max_steps={STEPS}',
        '--logdir={tmp}/local_pipeline'],
}


def _DieWithParent():
  """In a child before exec: SIGKILL it when the test process dies."""
  ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class WorkerProcesses:
  """`tools/train.py --job=worker` processes on 127.0.0.1, one per task.

  Attributes:
    addresses: 'host:port' of every task.
    spec: The --cluster_spec value.
  """

  def __init__(self, tmp, num_tasks, num_devices):
    self.addresses = [f'127.0.0.1:{port}'
                      for port in loopback.FreePorts(num_tasks)]
    self.spec = 'worker=' + ','.join(self.addresses)
    self._tmp = tmp
    self._num_devices = num_devices
    self._processes = {}

  def _Log(self, task):
    return os.path.join(self._tmp, f'worker{task}.log')

  def Start(self, task):
    """Starts `task` (again, on its port); WaitListening waits for it."""
    with open(self._Log(task), 'w') as log:
      self._processes[task] = subprocess.Popen(
          tool_util.ToolCommand('train.py') + [
              '--job=worker', f'--task={task}',
              f'--num_devices={self._num_devices}',
              f'--cluster_spec={self.spec}'],
          cwd=self._tmp, stdin=subprocess.DEVNULL, stdout=log,
          stderr=subprocess.STDOUT, preexec_fn=_DieWithParent)

  def WaitListening(self, task, timeout_s=180):
    """Waits until `task` printed that it listens (its own word).

    Args:
      task: The task.
      timeout_s: Seconds it may take.

    Raises:
      AssertionError: if it exits or is silent for `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    line = f'worker {task} of {len(self.addresses)} listening on '
    while time.monotonic() < deadline:
      with open(self._Log(task)) as f:
        output = f.read()
      if line + self.addresses[task] in output:
        return
      assert self._processes[task].poll() is None, output[-2000:]
      time.sleep(0.1)
    raise AssertionError(f'worker {task} did not listen in {timeout_s} s')

  def Kill(self, task):
    """SIGKILLs `task` and waits until it is gone."""
    process = self._processes.pop(task, None)
    if process is not None:
      process.kill()
      process.wait()

  def Close(self):
    """SIGKILLs every task still running."""
    for task in list(self._processes):
      self.Kill(task)


def _Client(spec, logdir, *args):
  """The trainer client's arguments on the cluster `spec`."""
  return _COMMON + ['--job=trainer_client', f'--cluster_spec={spec}',
                    f'--logdir={logdir}'] + list(args)


def _InThread(fn, results):
  """Starts fn() in a thread that puts what it returns into `results`."""
  thread = threading.Thread(target=lambda: results.update(fn()))
  thread.start()
  return thread


def _RunAndKillWorker(cluster, args, logdir, tmp):
  """Runs the client, SIGKILLs worker 1 after the first checkpoint.

  Args:
    cluster: The WorkerProcesses.
    args: The client's arguments ('{tmp}' is `tmp`).
    logdir: Its --logdir.
    tmp: The scratch folder.

  Returns:
    (exit code, stdout, stderr, seconds from the kill to the client's exit).
  """
  args = [a.format(tmp=tmp) for a in args]
  process = subprocess.Popen(
      tool_util.ToolCommand('train.py') + args, cwd=tmp,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      preexec_fn=_DieWithParent)
  try:
    deadline = time.monotonic() + 300
    while (time.monotonic() < deadline and process.poll() is None and
           not _Checkpoint(logdir)):
      time.sleep(0.02)
    cluster.Kill(1)
    killed = time.monotonic()
    stdout, stderr = process.communicate(timeout=FAIL_WITHIN_S + 30)
    return process.returncode, stdout, stderr, time.monotonic() - killed
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


def _Steps(stdout):
  """{step: printed loss} of a run's progress lines."""
  return {int(s): float(l) for s, l in
          re.findall(r'^step +(\d+) +loss ([\d.]+)', stdout, re.M)}


def _Checkpoint(logdir):
  return tf.train.latest_checkpoint(os.path.join(logdir, 'train'))


@contextlib.contextmanager
def _ClientParams(spec, split_size):
  """The launcher's trainer params on the cluster, as its client sets them.

  Args:
    spec: --cluster_spec.
    split_size: --split_size.

  Yields:
    (model params, the session target).
  """
  with flagsaver.flagsaver(model=MODEL, logdir='', cluster_spec=spec,
                           split_size=split_size,
                           **{**train.LAUNCHER_DEFAULTS, 'run_locally': ''}):
    found = workers.Discover(workers.WorkerAddresses(spec), timeout_s=60)
    manager = train.LocalDevicesRunnerManager(MODEL, found)
    manager.MaybeConfigRunDistributed()
    yield (manager.GetParamsForDataset('trainer_client', 'Train'),
           train.FLAGS.tf_master)


def _TraceOneClientStep(spec, split_size):
  """One training step of the client's graph on the cluster, traced.

  Its variables live in a container of their own, so that a client running
  at the same time keeps its own.

  Args:
    spec: --cluster_spec.
    split_size: --split_size.

  Returns:
    The step's RunMetadata.
  """
  with _ClientParams(spec, split_size) as (cfg, master):
    graph = tf.Graph()
    with graph.as_default(), tf.container('trace'), tf.compat.v1.Session(
        master, config=py_utils.SessionConfig()) as sess:
      return launcher_util.TraceTrainStep(cfg, sess)[0]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The runs of the module docstring, on one cluster of 2 x 2 devices."""
  tmp = str(tmp_path_factory.mktemp('cluster'))
  results = {'tmp': tmp}
  cluster = WorkerProcesses(tmp, num_tasks=2, num_devices=2)
  results['cluster'] = cluster
  try:
    for task in range(2):
      cluster.Start(task)
    local = _InThread(lambda: tool_util.RunToolInParallel(
        'train.py', LOCAL_RUNS, tmp, timeout=600), results)
    for task in range(2):
      cluster.WaitListening(task)
    started = time.monotonic()
    replicas = _InThread(lambda: tool_util.RunToolInParallel(
        'train.py', {'replicas': _Client(
            cluster.spec, '{tmp}/replicas', '--split_size=2', _TWO_STAGES,
            '--max_steps=2')}, tmp, timeout=600), results)
    results['trace'] = _TraceOneClientStep(cluster.spec, split_size=4)
    replicas.join()
    logdir = os.path.join(tmp, 'spanning')
    spanning = _Client(cluster.spec, logdir, '--split_size=4',
                       f'--max_steps={STEPS}')
    results['killed'] = _RunAndKillWorker(cluster, spanning, logdir, tmp)
    results['killed_at'] = _Checkpoint(logdir)
    cluster.Start(1)
    cluster.WaitListening(1)
    results.update(tool_util.RunToolInParallel(
        'train.py', {'resumed': spanning}, tmp, timeout=600))
    results['cluster_s'] = time.monotonic() - started
    local.join()
    yield results
  finally:
    cluster.Close()


@pytest.mark.slow
def testReplicasOnEveryWorkerTrainAsLocalReplicas(runs):
  """--split_size=2 on 2 x 2 devices: the local 4-device, 2-split losses."""
  model, steps, *_ = launcher_util.Trained(runs, 'replicas')
  assert (model, int(steps)) == (MODEL, 2)
  cluster = launcher_util.SummaryLosses(runs, 'replicas')
  local = launcher_util.SummaryLosses(runs, 'local_replicas')
  assert sorted(cluster) == sorted(local) == [1, 2]
  for step, loss in local.items():
    assert cluster[step] == pytest.approx(loss, rel=1e-6), step


def _KernelDevices(metadata):
  """{kind: (task, device) set} of a traced step of the tiny LM's 4 stages.

  Kinds: 'forward <k>' (kernels inside stage k's forward calls) and each
  cell's kernels by name, '-grad' for those of the backward pass.

  Args:
    metadata: RunMetadata of a step.

  Returns:
    A dict of sets.
  """
  kinds = collections.defaultdict(set)
  for dev in metadata.step_stats.dev_stats:
    where = tuple(int(n) for n in re.search(r'/task:(\d+)/device:CPU:(\d+)$',
                                            dev.device).groups())
    for node in dev.node_stats:
      call = launcher_util.StageCall(node)
      if call:
        kinds[f'forward {call[1]}'].add(where)
      for kind, pattern in launcher_util.CELL_KERNELS.items():
        if re.search(pattern, node.node_name):
          grad = '-grad' if node.node_name.startswith('gradients/') else ''
          kinds[kind + grad].add(where)
  return dict(kinds)


@pytest.mark.slow
def testPipelineAcrossWorkersRunsStageKOnTheKthDevice(runs):
  """--split_size=4 on 2 x 2 devices: stage k on task k // 2, CPU k % 2.

  Tiny LM cells, one per stage: [embedding, layer0, layer1, softmax]; the
  two Transformer layers run the same kernels, on stage 1's and stage 2's
  device.
  """
  devices = _KernelDevices(runs['trace'])
  stage = {k: {(k // 2, k % 2)} for k in range(4)}
  assert {k: devices[f'forward {k}'] for k in range(4)} == stage
  assert devices['embedding'] == stage[0]
  assert devices['softmax'] == devices['softmax-grad'] == stage[3]
  for kind in ('attention', 'attention-grad', 'feedforward',
               'feedforward-grad'):
    assert devices[kind] == stage[1] | stage[2], kind


@pytest.mark.slow
def testKilledWorkerFailsTheClientWhichResumesFromTheCheckpoint(runs):
  """SIGKILL of worker 1: one line, soon; the same command goes on.

  Same losses at every step and the same final variables as the local
  4-device run: the checkpoint restored the global step and every variable.
  """
  code, stdout, stderr, seconds = runs['killed']
  killed_at = runs['killed_at']
  assert code == 1, stderr[-3000:]
  assert seconds < FAIL_WITHIN_S
  (error,) = [l for l in stderr.splitlines() if l.startswith('train.py: ')]
  assert re.fullmatch(
      re.escape('train.py: error: lost worker task 1 '
                f'({runs["cluster"].addresses[1]}): ') + '.+' +
      re.escape(' (--cluster_spec); restart it and run this command again: it'
                f' continues from the last checkpoint, {killed_at}.'),
      error), error
  saved_step = int(killed_at.rsplit('-', 1)[1])
  assert saved_step < STEPS and 'trained' not in stdout

  _, resumed, _ = runs['resumed']
  model, steps, *_, checkpoint = launcher_util.Trained(runs, 'resumed')
  assert (model, int(steps)) == (MODEL, STEPS)
  assert min(_Steps(resumed)) == saved_step + 1
  local = _Steps(runs['local_pipeline'][1])
  assert sorted(local) == list(range(1, STEPS + 1))
  for step, loss in {**_Steps(stdout), **_Steps(resumed)}.items():
    assert loss == local[step], step
  restored = tf.train.load_checkpoint(checkpoint)
  expected = tf.train.load_checkpoint(
      _Checkpoint(os.path.join(runs['tmp'], 'local_pipeline')))
  names = restored.get_variable_to_shape_map()
  assert names == expected.get_variable_to_shape_map() and len(names) > 50
  for name in names:
    engine_util.AssertTransparent([restored.get_tensor(name)],
                                  [expected.get_tensor(name)], tol=1e-6)


def _MainFails(capsys, logdir, parsed=None, **flag_values):
  """train.main's one-line error (exit status 2) with these flags.

  Args:
    capsys: pytest's fixture.
    logdir: --logdir, which must not be created.
    parsed: {flag: value as on the command line} (the flag is then present).
    **flag_values: Other flag values.

  Returns:
    The message after 'train.py: error: '.
  """
  with flagsaver.flagsaver(**{'model': MODEL, 'logdir': logdir,
                              **flag_values}):
    for name, value in (parsed or {}).items():
      train.FLAGS[name].parse(value)
    with pytest.raises(SystemExit) as exit_info:
      train.main(['train.py'])
  assert exit_info.value.code == 2
  assert not os.path.exists(logdir)  # Nothing was made.
  error = capsys.readouterr().err
  assert error.startswith('train.py: error: ') and error.count('\n') == 1
  return error[len('train.py: error: '):-1]


@pytest.mark.slow
def testClusterFlagsThatDoNotFitTheWorkersAreOneLine(runs, tmp_path, capsys):
  """--split_size not dividing the devices, --num_devices over a worker's."""
  cluster = runs['cluster']
  logdir = str(tmp_path / 'logdir')
  assert _MainFails(capsys, logdir, cluster_spec=cluster.spec,
                    split_size=3) == (
                        "--split_size=3 must divide the cluster's 4 devices "
                        '(2 workers x 2 CPU devices); valid: [1, 2, 4].')
  assert _MainFails(capsys, logdir, cluster_spec=cluster.spec,
                    parsed={'num_devices': '4'}) == (
                        f'worker task 0 ({cluster.addresses[0]}) serves 2 CPU'
                        ' devices and --num_devices=4 asks for 4 on every '
                        'worker: start every worker with --num_devices=4, or '
                        'pass --num_devices=2.')


@pytest.mark.parametrize('flag_values,message', [
    (dict(job='worker'), '--job=worker serves one task of --cluster_spec; '
     'pass e.g. --cluster_spec=worker=host0:2222,host1:2222 --task=0.'),
    (dict(job='worker', cluster_spec='worker=127.0.0.1:1', task=1),
     '--task=1 is not a task of --cluster_spec (its 1 workers are tasks 0 to '
     '0).'),
    (dict(cluster_spec='worker=localhost'), "--cluster_spec='worker="
     "localhost': 'localhost' is not HOST:PORT; e.g. --cluster_spec=worker="
     'host0:2222,host1:2222.'),
    (dict(cluster_spec='ps=h:1@worker=h:2'), "--cluster_spec='ps=h:1@worker="
     "h:2' lists the jobs ['ps', 'worker']; the cluster has one job, "
     "'worker', a task per host, e.g. --cluster_spec=worker=host0:2222,"
     'host1:2222.'),
    # As given on the command line (the launcher's own default is 'cpu').
    (dict(cluster_spec='worker=h:1', parsed={'run_locally': 'cpu'}),
     '--run_locally=cpu '
     "trains on devices of this process, --cluster_spec on the workers'; "
     'pass one of them.'),
    (dict(cluster_spec='worker=h:1', job='controller,trainer_client'),
     '--job=controller,trainer_client with --cluster_spec: each worker runs '
     '--job=worker, the client --job=trainer_client (and evaler_* or '
     'decoder_* jobs beside it); an evaler or decoder alone needs no cluster: '
     'drop --cluster_spec and pass --num_devices=K.'),
])
def testBadClusterFlagsAreOneLine(tmp_path, capsys, flag_values, message):
  assert _MainFails(capsys, str(tmp_path / 'logdir'), **flag_values) == message


def testUnreachableWorkerIsNamedAfterTheTimeout(tmp_path, capsys):
  """No server on the port: the client waits --worker_timeout, then fails."""
  (port,) = loopback.FreePorts(1)
  started = time.monotonic()
  assert _MainFails(
      capsys, str(tmp_path / 'logdir'), worker_timeout=1,
      cluster_spec=f'worker=127.0.0.1:{port}') == (
          f'--cluster_spec: worker task 0 (127.0.0.1:{port}) did not answer '
          'within --worker_timeout=1 s; start each with `tools/train.py '
          '--job=worker --task=T` and the same --cluster_spec.')
  assert time.monotonic() - started < 10
