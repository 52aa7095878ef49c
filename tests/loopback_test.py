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


def testServersReadTheirOwnAllocatorsPeak():
  """A 64 MiB tensor made in task 1 shows in its peak, then a new peak starts.

  The servers run with this process's environment (conftest.py), whose
  allocator keeps statistics.
  """
  mib = 2**20
  with loopback.LoopbackCluster(2) as cluster:
    with tf.Graph().as_default():
      with tf.device(cluster.Device(1)):
        # 64 MiB of floats, drawn (constants would be folded away).
        total = tf.reduce_sum(tf.random.uniform([16 * mib]))
      with tf.compat.v1.Session(cluster.target) as sess:
        cluster.MemoryBytes(1)
        assert 0 < sess.run(total) < 16 * mib
    peak, current = cluster.MemoryBytes(1)
    assert 64 * mib <= peak < 65 * mib and current < mib
    assert cluster.MemoryBytes(0)[0] < mib  # Task 0 held no such tensor.
    assert cluster.MemoryBytes(1)[0] < mib  # A new peak since the last read.


def testServersWithoutAllocatorStatisticsSaySo(monkeypatch):
  monkeypatch.setenv('TF_CPU_ALLOCATOR_USE_BFC', 'false')
  monkeypatch.setenv('TF_ENABLE_ONEDNN_OPTS', '0')
  with loopback.LoopbackCluster(1) as cluster:
    with pytest.raises(RuntimeError, match=r'^server task 0: Allocator stats '
                       r"not available for device 'CPU:0': the CPU allocator "
                       r'keeps no statistics in this process \('
                       r'TF_CPU_ALLOCATOR_USE_BFC=false, '
                       r'TF_ENABLE_ONEDNN_OPTS=0\)\. Memory is measured with'):
      cluster.MemoryBytes(0)


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
