"""The measuring host: its CPU, oneDNN, and an allocator that keeps statistics.

Peak memory is read from TensorFlow's allocator statistics
(`tf.config.experimental.get_memory_info('CPU:0')`). TensorFlow's default CPU
allocator keeps none; oneDNN's allocator does, but TensorFlow 2.21 turns oneDNN
on only on CPUs with AVX-512-class features (or with TF_ENABLE_ONEDNN_OPTS=1).
TensorFlow's BFC allocator keeps them whatever oneDNN does, so every measuring
process runs with TF_CPU_ALLOCATOR_USE_BFC=true: its peaks then mean the same
on every x86-64 host, and the user's oneDNN setting is left as it is.

    env = host.WorkerEnvironment()           # in the parent, for subprocesses
    before = host.ResetMemoryStats()         # in the worker, before a step
    peak = host.PeakBytes()                  # after it
    result['host'] = host.Describe()         # what the figures depend on

Standard library only at import; TensorFlow is imported where it is read.
"""

import os
from typing import Any, Dict, Mapping, Optional, Tuple

# TensorFlow reads this variable when it creates the CPU allocator.
ALLOCATOR_VARIABLE = 'TF_CPU_ALLOCATOR_USE_BFC'
ONEDNN_VARIABLE = 'TF_ENABLE_ONEDNN_OPTS'
_FALSE = ('0', 'false')
_TRUE = ('1', 'true')


class MemoryStatsError(ValueError):
  """The allocator keeps no statistics; says which setting prevents it."""


def WorkerEnvironment(
    base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
  """The environment of a measuring subprocess.

  Args:
    base: The environment to start from (default: this process's).

  Returns:
    A copy of `base` with TF_CPP_MIN_LOG_LEVEL=2 and TF_CPU_ALLOCATOR_USE_BFC=
    true unless `base` sets them. TF_ENABLE_ONEDNN_OPTS stays as given.
  """
  env = dict(os.environ if base is None else base)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  env.setdefault(ALLOCATOR_VARIABLE, 'true')
  return env


def _MemoryInfo(reset: bool) -> Dict[str, int]:
  """`get_memory_info('CPU:0')`, after resetting the peak if `reset`.

  Raises:
    MemoryStatsError: if the allocator keeps no statistics, naming the
      environment settings that decide it.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    if reset:
      tf.config.experimental.reset_memory_stats('CPU:0')
    return tf.config.experimental.get_memory_info('CPU:0')
  except ValueError as e:
    allocator = os.environ.get(ALLOCATOR_VARIABLE)
    onednn = os.environ.get(ONEDNN_VARIABLE)
    raise MemoryStatsError(
        f'{e}: the CPU allocator keeps no statistics in this process '
        f'({ALLOCATOR_VARIABLE}={allocator}, {ONEDNN_VARIABLE}={onednn}). '
        f'Memory is measured with {ALLOCATOR_VARIABLE}=true (TensorFlow\'s '
        'BFC allocator) set before TensorFlow starts; the tools set it unless '
        'the environment sets it to another value.') from e


def ResetMemoryStats() -> int:
  """Resets the CPU allocator's peak; returns the bytes allocated now.

  Raises:
    MemoryStatsError: if the allocator keeps no statistics.
  """
  return _MemoryInfo(reset=True)['current']


def PeakBytes() -> int:
  """The CPU allocator's peak since the last `ResetMemoryStats`.

  Raises:
    MemoryStatsError: if the allocator keeps no statistics.
  """
  return _MemoryInfo(reset=False)['peak']


def TakeMemoryStats() -> Tuple[int, int]:
  """(the peak since the last reset, the bytes allocated now); resets it.

  Raises:
    MemoryStatsError: if the allocator keeps no statistics.
  """
  peak = PeakBytes()
  return peak, ResetMemoryStats()


def CpuModel() -> str:
  """The CPU's model name from /proc/cpuinfo ('unknown' where there is none)."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        key, _, value = line.partition(':')
        if key.strip() == 'model name':
          return ' '.join(value.split())
  except OSError:
    pass
  return 'unknown'


def OneDnnEnabled() -> bool:
  """Whether TensorFlow runs oneDNN's kernels in this process.

  TensorFlow decides it from the CPU and TF_ENABLE_ONEDNN_OPTS; it reports the
  decision only through a private module, read here when present and
  otherwise inferred from the variable alone (unset counts as on, as on
  AVX-512 hosts).
  """
  try:
    # pylint: disable=g-import-not-at-top
    from tensorflow.python.util import _pywrap_util_port
    # pylint: enable=g-import-not-at-top
    return bool(_pywrap_util_port.IsMklEnabled())
  except (ImportError, AttributeError):
    return os.environ.get(ONEDNN_VARIABLE, '1').lower() not in _FALSE


def Describe() -> Dict[str, Any]:
  """What a measurement depends on: CPU model, core count, oneDNN, allocator."""
  return {
      'cpu': CpuModel(),
      'cores': os.cpu_count(),
      'onednn': OneDnnEnabled(),
      'allocator': ('bfc' if os.environ.get(ALLOCATOR_VARIABLE, '').lower()
                    in _TRUE else 'default'),
  }


def Summary(description: Mapping[str, Any]) -> str:
  """One line for a report, e.g. 'AMD EPYC, 2 cores, oneDNN on'."""
  onednn = 'on' if description['onednn'] else 'off'
  return (f'{description["cpu"]}, {description["cores"]} cores, '
          f'oneDNN {onednn}')
