"""TensorFlow servers on loopback ports, one process each, for the tests.

As a script, serves task TASK of the job 'worker' until process PARENT exits
(so that no server outlives the test process, even one that is killed):

    python tests/loopback_server.py 127.0.0.1:5001,127.0.0.1:5002 TASK PARENT

`LoopbackCluster` starts one such process per task on free ports, kills and
restarts them, and kills them all when closed:

    with LoopbackCluster(2) as cluster:
      with tf.compat.v1.Session(cluster.target) as sess:
        ...  # ops placed on cluster.Device(1) run in the second process.
"""

import os
import select
import socket
import subprocess
import sys
import time
from typing import List

JOB = 'worker'
READY = 'listening'  # What a server prints once its port is bound.


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
               attempts: int = 3):
    """Starts `num_tasks` servers and waits until they all listen.

    A port found free can be taken by another process (a connection of a
    test running beside this one) before the server binds it; the server
    then exits, and all tasks start again on new ports, up to `attempts`
    times.

    Args:
      num_tasks: The number of tasks (processes).
      start_timeout: Seconds a server may take to start listening.
      attempts: How many sets of ports to try.

    Raises:
      RuntimeError: if a server exits in every attempt or does not listen in
        time (the servers already started are killed).
    """
    self._start_timeout = start_timeout
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
         str(task), str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
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

  def Kill(self, task: int) -> None:
    """Kills the process of `task` (SIGKILL) and waits until it is gone."""
    process = self._processes[task]
    if process is not None:
      process.kill()
      process.wait()
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


def main(argv: List[str]) -> None:
  addresses, task, parent = argv[1].split(','), int(argv[2]), int(argv[3])
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  server = tf.distribute.Server(
      tf.train.ClusterSpec({JOB: addresses}), job_name=JOB, task_index=task)
  print(READY, flush=True)
  # Once the parent is gone this process is re-parented: stop serving.
  while os.getppid() == parent:
    time.sleep(0.5)
  del server


if __name__ == '__main__':
  main(sys.argv)
