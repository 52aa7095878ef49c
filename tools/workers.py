"""The worker servers of a TensorFlow cluster, as tools/train.py uses them.

A cluster is Lingvo's `--cluster_spec=worker=HOST:PORT,...`: one job,
'worker', with one task per address, served by TensorFlow's own gRPC servers
(`tf.distribute.Server`). `Serve` runs one task with N devices
(`tools/train.py --job=worker`). A trainer client (`--job=trainer_client`)
waits, for a bounded time, until every task answers and reads its devices
(`Discover`), checks its model split against them (`NumReplicas`), and runs
its steps in a session that fails the run at once when a worker is lost
(`ExitOnLostWorker`): closing a session whose worker died would wait until
that worker is back.

    addresses = WorkerAddresses('worker=host0:2222,host1:2222')
    workers = Discover(addresses, timeout_s=60)   # 2 x 2 CPU devices
    NumReplicas(workers, split_size=4)            # 1 pipeline spanning both
"""

import dataclasses
import re
import time
from typing import Callable, List, NoReturn, Optional

import tensorflow as tf

JOB = 'worker'
# How a session fails when a worker is gone (the connection is refused or
# reset), restarted (its session state is lost) or hung (the call's timeout).
LOST_WORKER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
                      tf.errors.DeadlineExceededError)
_EXAMPLE = '--cluster_spec=worker=host0:2222,host1:2222'
_ADDRESS = re.compile(r'(\[[0-9a-fA-F:.]+\]|[^\s:,@=\[\]]+):\d{1,5}')
# Seconds one probe of a worker may wait for an answer.
_PROBE_S = 2.0


class ClusterError(ValueError):
  """A cluster flag that does not match the cluster; the message names it."""


@dataclasses.dataclass(frozen=True)
class Workers:
  """The tasks of job 'worker' and the devices each serves.

  Attributes:
    addresses: 'host:port' of every task, in task order.
    device_type: 'GPU' if the workers serve GPUs, else 'CPU'.
    devices_per_worker: Devices of `device_type` on every task.
    cpus_per_worker: CPU devices on every task (where Lingvo puts variables
      on GPU hosts: its ps devices).
  """
  addresses: List[str]
  device_type: str
  devices_per_worker: int
  cpus_per_worker: int

  @property
  def num_devices(self) -> int:
    """Devices of the whole cluster."""
    return len(self.addresses) * self.devices_per_worker

  def __str__(self) -> str:
    return (f'{len(self.addresses)} workers x {self.devices_per_worker} '
            f'{self.device_type} devices')


def WorkerAddresses(cluster_spec: str) -> List[str]:
  """The worker addresses of Lingvo's `--cluster_spec` ('job=a,b@job2=c').

  Args:
    cluster_spec: The flag's value.

  Returns:
    'host:port' of every task of job 'worker', in task order.

  Raises:
    ClusterError: naming the flag and the part that is not valid.
  """
  jobs = {}
  for job_spec in cluster_spec.split('@'):
    name, equals, hosts = job_spec.partition('=')
    if not (name and equals and hosts):
      raise ClusterError(
          f'--cluster_spec={cluster_spec!r}: {job_spec!r} is not '
          f'JOB=HOST:PORT[,HOST:PORT...]; e.g. {_EXAMPLE}.')
    jobs[name] = hosts.split(',')
  if list(jobs) != [JOB]:
    raise ClusterError(
        f'--cluster_spec={cluster_spec!r} lists the jobs {sorted(jobs)}; the '
        f"cluster has one job, '{JOB}', a task per host, e.g. {_EXAMPLE}.")
  addresses = jobs[JOB]
  for address in addresses:
    if not _ADDRESS.fullmatch(address):
      raise ClusterError(
          f'--cluster_spec={cluster_spec!r}: {address!r} is not HOST:PORT; '
          f'e.g. {_EXAMPLE}.')
  if len(set(addresses)) < len(addresses):
    raise ClusterError(f'--cluster_spec={cluster_spec!r} lists an address '
                       'twice; every task needs its own HOST:PORT.')
  return addresses


def Serve(addresses: List[str], task: int, num_devices: int) -> None:
  """Serves task `task` of job 'worker' with `num_devices` devices.

  A host with GPUs serves `num_devices` of its GPUs (and one CPU device),
  any other host `num_devices` CPU devices. Prints one line once the server
  listens, and serves until the process is killed or interrupted (Ctrl-C;
  `server.join()` would not see it).

  Args:
    addresses: Every task's 'host:port' (`WorkerAddresses`).
    task: This process's task.
    num_devices: Devices to serve.

  Raises:
    ClusterError: if `task` is not a task of the cluster, the host has fewer
      GPUs than asked, or the address cannot be served here.
  """
  if not 0 <= task < len(addresses):
    raise ClusterError(
        f'--task={task} is not a task of --cluster_spec (its {len(addresses)} '
        f'workers are tasks 0 to {len(addresses) - 1}).')
  gpus = len(tf.config.list_physical_devices('GPU'))
  if gpus and num_devices > gpus:
    raise ClusterError(f'--num_devices={num_devices}: this host has {gpus} '
                       f'GPUs; pass --num_devices={gpus} or fewer.')
  device_type = 'GPU' if gpus else 'CPU'
  try:
    server = tf.distribute.Server(
        tf.train.ClusterSpec({JOB: addresses}), job_name=JOB, task_index=task,
        config=tf.compat.v1.ConfigProto(
            device_count={device_type: num_devices}))
  except tf.errors.OpError as e:
    raise ClusterError(
        f'--cluster_spec: task {task} cannot serve {addresses[task]} here '
        f'({" ".join(e.message.split())}); is the port taken, or is the host '
        'another machine?') from e
  print(f'worker {task} of {len(addresses)} listening on {addresses[task]} '
        f'with {num_devices} {device_type} devices', flush=True)
  try:
    while True:
      time.sleep(3600)
  except KeyboardInterrupt:
    del server


def _TaskDevices(task: int, address: str,
                 timeout_s: float) -> Optional[List[str]]:
  """Device types task `task` serves, or None if it did not answer in time."""
  config = tf.compat.v1.ConfigProto(
      operation_timeout_in_ms=max(int(timeout_s * 1000), 1),
      device_filters=[f'/job:{JOB}/task:{task}'])
  try:
    with tf.compat.v1.Session(f'grpc://{address}', graph=tf.Graph(),
                              config=config) as sess:
      return [d.device_type for d in sess.list_devices()
              if re.search(rf'/job:{JOB}/replica:\d+/task:{task}/', d.name)]
  except tf.errors.OpError:
    return None


def Discover(addresses: List[str], timeout_s: float,
             num_devices: Optional[int] = None) -> Workers:
  """Waits until every task answers and returns the devices they serve.

  Args:
    addresses: Every task's 'host:port' (`WorkerAddresses`).
    timeout_s: Seconds to wait for all of them (--worker_timeout).
    num_devices: Devices every task must serve (--num_devices), or None for
      whatever they serve, the same on every task.

  Returns:
    The Workers.

  Raises:
    ClusterError: naming the tasks that did not answer in time, or serve
      another cluster, or serve a number of devices other than asked or
      other than the rest.
  """
  deadline = time.monotonic() + timeout_s
  found = {}
  while True:
    for task, address in enumerate(addresses):
      if task not in found:
        remaining = deadline - time.monotonic()
        kinds = _TaskDevices(task, address, min(max(remaining, 0.1), _PROBE_S))
        if kinds is not None:
          found[task] = kinds
    missing = [t for t in range(len(addresses)) if t not in found]
    if not missing:
      break
    if time.monotonic() >= deadline:
      raise ClusterError(
          '--cluster_spec: ' + ', '.join(
              f'worker task {t} ({addresses[t]})' for t in missing) +
          f' did not answer within --worker_timeout={timeout_s:g} s; start '
          'each with `tools/train.py --job=worker --task=T` and the same '
          '--cluster_spec.')
    time.sleep(0.1)  # In case a probe fails at once instead of waiting.
  for task, kinds in found.items():
    if not kinds:
      raise ClusterError(
          f'--cluster_spec: {addresses[task]} answers but is not worker task '
          f'{task} of this cluster; start it with --task={task} and the same '
          '--cluster_spec.')
  device_type = 'GPU' if any('GPU' in k for k in found.values()) else 'CPU'
  counts = [found[t].count(device_type) for t in range(len(addresses))]
  expected = num_devices or counts[0]
  for task, count in enumerate(counts):
    if count != expected:
      wanted = (f'--num_devices={num_devices} asks for {num_devices} on every '
                f'worker' if num_devices else
                f'task 0 serves {expected}; all must serve the same number')
      raise ClusterError(
          f'worker task {task} ({addresses[task]}) serves {count} '
          f'{device_type} devices and {wanted}: start every worker with '
          f'--num_devices={expected}' +
          (f', or pass --num_devices={count}.' if num_devices else '.'))
  return Workers(addresses, device_type, expected, found[0].count('CPU'))


def NumReplicas(workers: Workers, split_size: int) -> int:
  """R: pipelines of `split_size` devices the cluster holds, in task order.

  Args:
    workers: The cluster (`Discover`).
    split_size: S, devices of one pipeline (--split_size).

  Returns:
    workers.num_devices // split_size.

  Raises:
    ClusterError: unless S divides the cluster's devices.
  """
  if workers.num_devices % split_size:
    valid = [s for s in range(1, workers.num_devices + 1)
             if workers.num_devices % s == 0]
    raise ClusterError(
        f"--split_size={split_size} must divide the cluster's "
        f'{workers.num_devices} devices ({workers}); valid: {valid}.')
  return workers.num_devices // split_size


def LostWorker(error: tf.errors.OpError, addresses: List[str]) -> str:
  """Which worker a session error says is lost, and why, in a few words.

  Args:
    error: One of LOST_WORKER_ERRORS.
    addresses: Every task's 'host:port'.

  Returns:
    E.g. 'worker task 1 (host1:2222): failed to connect to all addresses',
    or "a worker (DeadlineExceededError: Deadline Exceeded; task 0, h:p, is
    the session's master)" when the error names no task (as when task 0
    dies: the session waits for it until the call's timeout).
  """
  text = str(error.message)
  tasks = {t for t, address in enumerate(addresses)
           if re.search(re.escape(address) + r'\b', text)}
  if not tasks:  # The addresses may be host names, the error names IPs.
    tasks = {int(t) for t in re.findall(
        rf'remote target /job:{JOB}/replica:\d+/task:(\d+)', text)}
  cause = re.search(rf'From /job:{JOB}/replica:\d+/task:\d+:\n([^;\n]*)', text)
  lines = [line for line in text.splitlines()
           if line.strip() and not line.startswith('=')]
  why = cause.group(1) if cause else lines[-1] if lines else ''
  if len(tasks) == 1 and min(tasks) < len(addresses):
    task = min(tasks)
    return f'worker task {task} ({addresses[task]}): {why}'
  return (f'a worker ({type(error).__name__}: {why}; task 0, {addresses[0]}, '
          "is the session's master)")


class ExitOnLostWorker(tf.compat.v1.Session):
  """A session on the workers that hands a lost worker to `on_lost`.

  Closing a session after a worker died waits until the worker is back
  (gRPC reconnects for ever), so a `with` block that a worker error leaves
  calls `on_lost(error)`, which must not return (e.g. it exits the process),
  instead of closing.
  """

  def __init__(self, target: str, on_lost: Callable[[Exception], NoReturn],
               **kwargs):
    """A tf.compat.v1.Session on `target`; kwargs are Session's."""
    super().__init__(target, **kwargs)
    self._on_lost = on_lost

  def __exit__(self, exc_type, exc_value, traceback):
    if isinstance(exc_value, LOST_WORKER_ERRORS):
      self._on_lost(exc_value)
    return super().__exit__(exc_type, exc_value, traceback)
