"""Tests of benchmarks/host.py: what measurements depend on, on any host.

The measuring processes read peak memory from TensorFlow's allocator
statistics, which TensorFlow's default CPU allocator does not keep where
oneDNN is off (CPUs without AVX-512-class features, or
TF_ENABLE_ONEDNN_OPTS=0). These tests pin that the workers' environment gives
them an allocator that keeps the statistics whatever oneDNN does, that the
user's oneDNN setting is kept, and that a setting which makes measuring
impossible gets one error naming it.
"""

import os

import pytest

from benchmarks import host
from benchmarks import runner


def testWorkerEnvironmentAddsTheAllocatorAndKeepsOneDnn():
  env = host.WorkerEnvironment({'PATH': '/bin', 'TF_ENABLE_ONEDNN_OPTS': '0'})
  assert env == {
      'PATH': '/bin', 'TF_ENABLE_ONEDNN_OPTS': '0',
      'TF_CPP_MIN_LOG_LEVEL': '2', 'TF_CPU_ALLOCATOR_USE_BFC': 'true'}


def testWorkerEnvironmentKeepsWhatTheUserSet():
  given = {'TF_CPP_MIN_LOG_LEVEL': '0', 'TF_CPU_ALLOCATOR_USE_BFC': 'false'}
  assert host.WorkerEnvironment(given) == given
  assert given == {'TF_CPP_MIN_LOG_LEVEL': '0',
                   'TF_CPU_ALLOCATOR_USE_BFC': 'false'}  # Not changed.


def testThisProcessMeasuresWhateverOneDnnDoes():
  """conftest.py started TensorFlow with the workers' environment."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  assert os.environ['TF_CPU_ALLOCATOR_USE_BFC'] == 'true'
  before = host.ResetMemoryStats()
  x = tf.ones([256, 1024])  # 1 MiB.
  assert host.PeakBytes() - before >= 2**20
  del x
  peak, now = host.TakeMemoryStats()
  assert peak - before >= 2**20 and now < peak
  assert host.TakeMemoryStats()[0] < peak  # A new peak since the last take.


def testDescribe():
  description = host.Describe()
  assert description == {
      'cpu': host.CpuModel(), 'cores': os.cpu_count(),
      'onednn': host.OneDnnEnabled(), 'allocator': 'bfc'}
  with open('/proc/cpuinfo') as f:
    assert f'model name\t: {description["cpu"]}' in f.read()
  setting = os.environ.get('TF_ENABLE_ONEDNN_OPTS')
  if setting in ('0', '1'):  # Unset: TensorFlow decides from the CPU.
    assert host.OneDnnEnabled() == (setting == '1')


@pytest.mark.parametrize('onednn,summary', [
    (True, 'AMD EPYC, 2 cores, oneDNN on'),
    (False, 'AMD EPYC, 2 cores, oneDNN off')])
def testSummary(onednn, summary):
  assert host.Summary({'cpu': 'AMD EPYC', 'cores': 2, 'onednn': onednn,
                       'allocator': 'bfc'}) == summary


@pytest.mark.slow
def testAWorkerThatCannotMeasureNamesTheSettings(monkeypatch):
  """With both allocators off, the worker's one error line says why."""
  monkeypatch.setenv('TF_CPU_ALLOCATOR_USE_BFC', 'false')
  monkeypatch.setenv('TF_ENABLE_ONEDNN_OPTS', '0')
  with pytest.raises(
      runner.BenchmarkError,
      match=r'keeps no statistics in this process \(TF_CPU_ALLOCATOR_USE_BFC='
      r'false, TF_ENABLE_ONEDNN_OPTS=0\)\. Memory is measured with '
      r'TF_CPU_ALLOCATOR_USE_BFC=true'):
    runner.Runner(1).Run(runner.Config('plain', 1, 8, 8, 1))
