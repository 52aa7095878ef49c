"""TensorFlow servers on loopback ports, one process each.

The tests run stages in several processes with it, and the benchmarks give
each stage a core of its own: a server pinned to one core runs all its ops
there, where logical devices of one process share every core.

As a script, serves task TASK of the job 'worker' until process PARENT exits
(so that no server outlives the process that started it, even one that is
killed); CORE (optional, -1 for none) pins the server to that core, INTRA
and INTER (optional, 0 for TensorFlow's defaults) set its threads per op and
its ops run at once:

    python benchmarks/loopback.py 127.0.0.1:5001,127.0.0.1:5002 TASK PARENT \
        [CORE [INTRA [INTER]]]

A line `memory` on its standard input makes it print `memory PEAK CURRENT`:
the bytes its CPU allocator held at most since the last such line (or since
it started) and holds now; it then starts a new peak. The server's process
is its device's memory, as an accelerator's memory is the device's own
(logical devices of one process share one allocator). The allocator keeps
these statistics with TF_CPU_ALLOCATOR_USE_BFC=true (`host`); without, the
answer is `error MESSAGE`.

`LoopbackCluster` starts one such process per task on free ports, kills and
restarts them, reads their memory, and kills them all when closed:

    with LoopbackCluster(2) as cluster:
      with tf.compat.v1.Session(cluster.target) as sess:
        ...  # ops placed on cluster.Device(1) run in the second process.
"""

import os
import sys

if __name__ == '__main__':  # Run as a script: see tools/__init__.py.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import select
import socket
import subprocess
import time
from typing import List, Optional, Sequence, Tuple

from benchmarks import host
# pylint: enable=g-import-not-at-top,wrong-import-position

JOB = 'worker'
READY = 'listening'  # What a server prints once its port is bound.
MEMORY = 'memory'  # The request for a server's allocator statistics.


class ServerExited(RuntimeError):
  """A server process exited before it listened (e.g. its port was taken)."""


def FreePorts(count: int) -> List[int]:
  """`count` distinct loopback ports that were free a moment ago."""
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(('127.0.0.1', 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


class LoopbackCluster:
  """Server processes for the tasks of job 'worker' on 127.0.0.1.

  Attributes:
    addresses: 'host:port' of every task.
  """

  def __init__(self, num_tasks: int, start_timeout: float = 120.0,
               attempts: int = 3, cores: Optional[Sequence[int]] = None,
               intra_op_threads: int = 0, inter_op_threads: int = 0):
    """Starts `num_tasks` servers and waits until they all listen.

    A port found free can be taken by another process (a connection of a
    test running beside this one) before the server binds it; the server
    then exits, and all tasks start again on new ports, up to `attempts`
    times.

    Args:
      num_tasks: The number of tasks (processes).
      start_timeout: Seconds a server may take to start listening.
      attempts: How many sets of ports to try.
      cores: The core each task is pinned to, or None for no pinning.
      intra_op_threads: Threads per op in each server (0: TensorFlow's
        default).
      inter_op_threads: Ops each server runs at once (0: TensorFlow's
        default, which is 1 in a server pinned to one core).

    Raises:
      RuntimeError: if a server exits in every attempt or does not listen in
        time (the servers already started are killed).
    """
    self._start_timeout = start_timeout
    if cores is not None and len(cores) != num_tasks:
      raise ValueError(f'cores={list(cores)} must name one core for each of '
                       f'the {num_tasks} tasks.')
    self._cores = list(cores) if cores is not None else [-1] * num_tasks
    self._threads = [intra_op_threads, inter_op_threads]
    self._processes = [None] * num_tasks
    for attempt in range(1, attempts + 1):
      self.addresses = [f'127.0.0.1:{port}' for port in FreePorts(num_tasks)]
      try:
        for task in range(num_tasks):
          self._Launch(task)
        for task in range(num_tasks):
          self._WaitUntilListening(task)
        return
      except BaseException as e:
        self.Close()
        if not isinstance(e, ServerExited) or attempt == attempts:
          raise

  @property
  def target(self) -> str:
    """The session target of task 0."""
    return f'grpc://{self.addresses[0]}'

  def Device(self, task: int) -> str:
    """The CPU device of `task`, named in full as TensorFlow reports it."""
    return f'/job:{JOB}/replica:0/task:{task}/device:CPU:0'

  def _Launch(self, task: int) -> None:
    self._processes[task] = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), ','.join(self.addresses),
         str(task), str(os.getpid()), str(self._cores[task])] +
        [str(n) for n in self._threads],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)

  def _WaitUntilListening(self, task: int) -> None:
    """Waits until the task's server says it listens (`main` prints READY).

    The server's own word, not a connection to the port: another process
    may listen there.

    Args:
      task: The task.

    Raises:
      ServerExited: if the server exits first.
      RuntimeError: if it does not listen within the start timeout.
    """
    process = self._processes[task]
    deadline = time.monotonic() + self._start_timeout
    while True:
      readable, _, _ = select.select(
          [process.stdout], [], [], max(deadline - time.monotonic(), 0.0))
      if not readable:
        raise RuntimeError(
            f'server task {task} did not listen on {self.addresses[task]} '
            f'within {self._start_timeout} s.')
      line = process.stdout.readline()
      if line.strip() == READY:
        return
      if not line:  # The end of its output: it exited.
        raise ServerExited(
            f'server task {task} exited with code {process.wait()} before '
            f'listening on {self.addresses[task]}; run `python {__file__} '
            f"{','.join(self.addresses)} {task} $$` to see why.")

  def MemoryBytes(self, task: int) -> Tuple[int, int]:
    """The peak and current bytes of `task`'s allocator; starts a new peak.

    Args:
      task: The task.

    Returns:
      (the most bytes its CPU allocator held since the previous call, or
      since it started; the bytes it holds now).

    Raises:
      RuntimeError: if the server's allocator keeps no statistics, or the
        server does not answer within the start timeout.
    """
    process = self._processes[task]
    process.stdin.write(MEMORY + '\n')
    process.stdin.flush()
    readable, _, _ = select.select([process.stdout], [], [],
                                   self._start_timeout)
    answer = process.stdout.readline().strip() if readable else ''
    words = answer.split()
    if words[:1] == ['error']:
      raise RuntimeError(f'server task {task}: {answer[len("error "):]}')
    if words[:1] != [MEMORY] or len(words) != 3:
      raise RuntimeError(f'server task {task} answered {answer!r} to '
                         f'{MEMORY!r}, not "{MEMORY} PEAK CURRENT".')
    return int(words[1]), int(words[2])

  def Pid(self, task: int) -> int:
    """The process id of `task`'s server."""
    return self._processes[task].pid

  def Kill(self, task: int) -> None:
    """Kills the process of `task` (SIGKILL) and waits until it is gone."""
    process = self._processes[task]
    if process is not None:
      process.kill()
      process.wait()
      process.stdin.close()
      process.stdout.close()
      self._processes[task] = None

  def Restart(self, task: int) -> None:
    """Starts `task` again on the same port; waits until it listens."""
    self.Kill(task)
    self._Launch(task)
    self._WaitUntilListening(task)

  def Close(self) -> None:
    """Kills every server process."""
    for task in range(len(self._processes)):
      self.Kill(task)

  def __enter__(self) -> 'LoopbackCluster':
    return self

  def __exit__(self, *unused_exc_info) -> None:
    self.Close()


def PinnedCluster(num_tasks: int,
                  intra_op_threads: int = 0) -> LoopbackCluster:
  """A server per task, task k pinned to the k-th core this process may use.

  Each server runs two ops at once: with one, a pipeline step took 1.3 times
  as long, and varied more (docs/benchmarks.md, zero bubble).

  Args:
    num_tasks: The number of servers.
    intra_op_threads: Threads per op (0: TensorFlow's default, which is one
      thread in a server pinned to one core).

  Returns:
    The started cluster.

  Raises:
    ValueError: if this process may run on fewer cores than `num_tasks`.
  """
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < num_tasks:
    raise ValueError(f'{num_tasks} servers pinned to a core each need '
                     f'{num_tasks} cores, and this process may run on '
                     f'{len(cores)} ({cores}).')
  return LoopbackCluster(num_tasks, cores=cores[:num_tasks],
                         intra_op_threads=intra_op_threads, inter_op_threads=2)


def main(argv: List[str]) -> None:
  addresses, task, parent = argv[1].split(','), int(argv[2]), int(argv[3])
  core, intra, inter = (int(a) for a in (argv[4:] + ['-1', '0', '0'])[:3])
  if core >= 0:  # Before TensorFlow starts its threads: all of them pinned.
    os.sched_setaffinity(0, {core})
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  server = tf.distribute.Server(
      tf.train.ClusterSpec({JOB: addresses}), job_name=JOB, task_index=task,
      config=tf.compat.v1.ConfigProto(intra_op_parallelism_threads=intra,
                                      inter_op_parallelism_threads=inter))
  print(READY, flush=True)
  requests = sys.stdin
  # Once the parent is gone this process is re-parented: stop serving.
  while os.getppid() == parent:
    readable, _, _ = select.select([requests] if requests else [], [], [], 0.5)
    if not readable:
      continue
    line = requests.readline()
    if not line:  # Nothing more to read (e.g. /dev/null): serve on.
      requests = None
    elif line.strip() == MEMORY:
      print(_MemoryAnswer(), flush=True)
  del server


def _MemoryAnswer() -> str:
  """'memory PEAK CURRENT' of this process's allocator (see the docstring)."""
  try:
    peak, current = host.TakeMemoryStats()
  except host.MemoryStatsError as e:
    return f'error {" ".join(str(e).split())}'
  return f'{MEMORY} {peak} {current}'


if __name__ == '__main__':
  main(sys.argv)
