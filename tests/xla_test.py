"""engine/xla.py: when a pipelined step counts as compiled by XLA."""

import pytest
import tensorflow as tf

from lingvo_gpipe.engine import xla

TPU_CORES = ['/device:TPU_REPLICATED_CORE:0', '/device:TPU_REPLICATED_CORE:1']


@pytest.mark.parametrize('device,is_tpu', [
    ('', False), ('/cpu:0', False), ('/device:GPU:1', False),
    ('/job:localhost/replica:0/task:0/device:CPU:3', False),
    ('/device:TPU_REPLICATED_CORE:2', True), ('/tpu:0', True),
    ('/job:worker/replica:0/task:1/device:TPU:7', True)])
def testIsTpuDevice(device, is_tpu):
  assert xla.IsTpuDevice(device) is is_tpu


def testABadDeviceStringRaises():
  with pytest.raises(ValueError, match='bogus'):
    xla.CompiledByXla(['bogus'])


def testEagerlyOnlyOnTpu():
  assert xla.CompiledByXla() is False
  assert xla.CompiledByXla(['/cpu:0', '/cpu:1']) is False
  assert xla.CompiledByXla(TPU_CORES) is True


@pytest.mark.parametrize('jit_compile', [False, True])
def testInsideAFunctionWhenItIsJitCompiled(jit_compile):
  seen = {}

  @tf.function(jit_compile=jit_compile, autograph=False)
  def Step(x):
    seen['no devices'] = xla.CompiledByXla()
    seen['cpus'] = xla.CompiledByXla(['/cpu:0', '/cpu:1'])
    seen['tpu'] = xla.CompiledByXla(TPU_CORES)
    return x

  Step.get_concrete_function(tf.constant(0.0))
  assert seen == {'no devices': jit_compile, 'cpus': jit_compile,
                  'tpu': True}


def testInATf1GraphOnlyInsideTpuReplication():
  """tpu.rewrite builds on CPU: its replicate context is an XLA context."""
  seen = {}

  def Replicated(x):
    seen['replicated'] = xla.CompiledByXla()
    return x + 1.0

  with tf.Graph().as_default():
    seen['graph'] = xla.CompiledByXla()
    tf.compat.v1.tpu.rewrite(Replicated, [tf.constant(1.0)])
  assert seen == {'graph': False, 'replicated': True}
