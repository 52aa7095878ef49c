"""Servers pinned to cores: `benchmarks.loopback`, and the errors of the
benchmark step that runs a stage in each (`benchmarks.worker` with
`processes`; benchmark_test.py runs it end to end).
"""

import os

import pytest
import tensorflow as tf

from benchmarks import loopback
from benchmarks import runner
from benchmarks import worker


def _AllowedCores(pid):
  """The cores every thread of process `pid` may run on."""
  cores = set()
  for tid in os.listdir(f'/proc/{pid}/task'):
    cores |= os.sched_getaffinity(int(tid))
  return cores


def testServersArePinnedToTheirCores():
  with loopback.LoopbackCluster(2, cores=[1, 0], intra_op_threads=1,
                                inter_op_threads=2) as cluster:
    assert _AllowedCores(cluster.Pid(0)) == {1}
    assert _AllowedCores(cluster.Pid(1)) == {0}
    with tf.Graph().as_default():
      with tf.device(cluster.Device(1)):
        two = tf.constant(1.0) + 1.0
      with tf.compat.v1.Session(cluster.target) as sess:
        assert sess.run(two) == 2.0


def testCoresMustNameOnePerTask():
  with pytest.raises(ValueError, match=r'cores=\[0\] must name one core for '
                     'each of the 2 tasks'):
    loopback.LoopbackCluster(2, cores=[0])


def testProcessesNeedACorePerStage(monkeypatch):
  monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0})
  config = runner.Config('gpipe', 4, 8, 16, 2, 4, 'never', stages=2,
                         schedule='1f1b', intra_op_threads=1, processes=True)
  with pytest.raises(runner.BenchmarkError, match=r'processes=True, stages=2: '
                     r'2 servers pinned to a core each need 2 cores, and '
                     r'this process may run on 1 \(\[0\]\)'):
    worker._GraphStep(config)


def testProcessesRunGpipeInGraphModeOnly():
  with pytest.raises(runner.BenchmarkError, match=r"processes=True runs gpipe "
                     r"in graph mode only, not model='plain' in mode='graph'"):
    runner.Config('plain', 4, 8, 16, 2, processes=True)
