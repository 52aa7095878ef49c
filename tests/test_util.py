"""Helpers shared by the tests: cell stacks, references and runners."""

import collections
import os
import re
import subprocess
import sys

import numpy as np
from lingvo import compat as tf
from lingvo.core import builder_layers
from lingvo.core import layers
from lingvo.core import py_utils

from lingvo_gpipe import GPipeSequentialLayer
from params import lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 4
CPUS = [f'/job:localhost/replica:0/task:0/device:CPU:{i}'
        for i in range(NUM_DEVICES)]


def SessionConfig():
  """A TF1 session config with the four CPU devices the tests use."""
  return tf.compat.v1.ConfigProto(device_count={'CPU': NUM_DEVICES})


def RelErr(actual, expected, floor=0.0):
  """max |actual - expected| / max(max |expected|, floor); 0 if equal."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  if not expected.size:
    return 0.0
  diff = np.max(np.abs(actual - expected))
  return 0.0 if diff == 0 else diff / max(np.max(np.abs(expected)), floor)


def AssertTransparent(actual_values, expected_values, tol=1e-5):
  """Every tensor matches to relative error < tol.

  A tensor whose expected value is mathematically zero (e.g. the gradient of
  an attention key bias, which softmax ignores) holds only float round-off of
  the size of 1e-8 of the largest tensor; it can have no relative error, so
  both sides must stay below 1e-6 of the largest tensor instead.

  Args:
    actual_values: Arrays from the pipeline.
    expected_values: Arrays from the reference, same shapes.
    tol: The largest relative error allowed.
  """
  assert len(actual_values) == len(expected_values)
  zero = 1e-6 * max(
      np.max(np.abs(e)) if np.size(e) else 0.0 for e in expected_values)
  for i, (a, e) in enumerate(zip(actual_values, expected_values)):
    assert np.shape(a) == np.shape(e), (i, np.shape(a), np.shape(e))
    if np.size(e) and np.max(np.abs(e)) < zero:
      assert np.max(np.abs(a)) < zero, f'tensor {i} should be ~0: {a}'
    else:
      err = RelErr(a, e)
      assert err < tol, f'tensor {i}: relative error {err}'


def FCCells(num_cells=4, dim=8):
  return [
      layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=dim, output_dim=dim)
      for i in range(num_cells)
  ]


def FCKernelRuns(step_stats):
  """{(cell, device, is_gradient): runs} of the kernels of FCCells.

  The forward marker is fc<i>/Relu (Grappler fuses the forward matmul with the
  bias add), the gradient marker the weight gradient's matmul.

  Args:
    step_stats: RunMetadata step stats.

  Returns:
    A Counter keyed by cell index, full device name and whether the kernel is
    a gradient.
  """
  runs = collections.Counter()
  for dev in step_stats.dev_stats:
    for node in dev.node_stats:
      match = re.search(r'fc(\d)/(Relu$|MatMul_grad/MatMul_1$)',
                        node.node_name)
      if match:
        runs[(int(match.group(1)), dev.device,
              'gradients/' in node.node_name)] += 1
  return runs


def ConvCells(num_cells=4, channels=3):
  return [
      layers.Conv2DLayer.Params().Set(
          name=f'conv{i}',
          filter_shape=[3, 3, channels, channels],
          filter_stride=[1, 1],
          batch_norm=False) for i in range(num_cells)
  ]


def TransformerCells(num_cells=4, dim=8):
  return [
      lm.TransformerCell.Params().Set(name=f'tr{i}', dim=dim, num_heads=2,
                                      hidden_dim=2 * dim, causal=False)
      for i in range(num_cells)
  ]


def PipeParams(cells, **kwargs):
  return GPipeSequentialLayer.Params().Set(name='pipe', cell_tpl=cells,
                                           **kwargs)


def Reference(cells):
  """The plain sequential stack of the same cells, sharing variable names."""
  with py_utils.OpportunisticVariableReuseScope(True):
    return builder_layers.SequentialLayer.Params().Set(
        name='pipe', sub=cells).Instantiate()


def _Loss(outputs):
  outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
  return tf.add_n([tf.reduce_sum(tf.square(y)) for y in outputs
                   if y is not None and y.dtype.is_floating])


def _Outputs(out):
  """Outputs as a list; None becomes an empty marker so positions compare."""
  outs = list(out) if isinstance(out, (tuple, list)) else [out]
  return [tf.constant([], name='none_output') if y is None else y for y in outs]


def _Wrt(layer, inputs):
  return layer.vars.Flatten() + [x for x in inputs
                                 if x is not None and x.dtype.is_floating]


def RunGraph(pipe_params, cell_fn, inputs, fetch_extra=None):
  """Pipeline vs. reference in a TF1 graph.

  Args:
    pipe_params: GPipeSequentialLayer params (cells from cell_fn()).
    cell_fn: Returns fresh cell params for the reference.
    inputs: numpy arrays or None.
    fetch_extra: Optional fn(graph, pipe_layer) -> extra fetches.

  Returns:
    (pipe_values, ref_values, extra): outputs + grads of both, plus extra.
  """
  graph = tf.Graph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = pipe_params.Instantiate()
    ref = Reference(cell_fn())
    xs = [None if x is None else tf.constant(x) for x in inputs]
    y = pipe.FProp(pipe.theta, *xs)
    y_ref = ref.FProp(pipe.theta, *xs)
    fetches = []
    for out in (y, y_ref):
      grads = tf.gradients(_Loss(out), _Wrt(pipe, xs))
      fetches.append(_Outputs(out) + [tf.convert_to_tensor(g) for g in grads])
    extra = fetch_extra(graph, pipe) if fetch_extra else []
    with tf.compat.v1.Session(graph=graph, config=SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run(fetches + [extra])


def RunFunction(pipe_params, cell_fn, inputs, jit_compile=False):
  """Pipeline vs. reference inside one tf.function (optionally XLA)."""
  pipe = pipe_params.Instantiate()
  ref = Reference(cell_fn())
  xs = [None if x is None else tf.constant(x) for x in inputs]

  @tf.function(jit_compile=jit_compile, autograph=False)
  def Step():
    results = []
    for layer in (pipe, ref):
      with tf.GradientTape() as tape:
        tape.watch([x for x in xs if x is not None])
        out = layer.FProp(pipe.theta, *xs)
        loss = _Loss(out)
      results.append(_Outputs(out) + tape.gradient(loss, _Wrt(pipe, xs)))
    return results

  return [[t.numpy() for t in r] for r in Step()]


def RunToolInParallel(tool, runs, tmp, timeout):
  """Runs `python tools/<tool>` once per entry of `runs`, all at once.

  Args:
    tool: File name in tools/, e.g. 'plan.py'.
    runs: {name: argument list}; '{tmp}' in an argument becomes `tmp`.
    tmp: A scratch folder.
    timeout: Seconds each run may take.

  Returns:
    {name: (exit code, stdout, stderr)} plus 'tmp': tmp.
  """
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      [ROOT] + [p for p in [env.get('PYTHONPATH')] if p])
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  procs = {
      name: subprocess.Popen(
          [sys.executable, os.path.join('tools', tool)] +
          [a.format(tmp=tmp) for a in args],
          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True) for name, args in runs.items()
  }
  results = {'tmp': tmp}
  try:
    for name, proc in procs.items():
      stdout, stderr = proc.communicate(timeout=timeout)
      results[name] = (proc.returncode, stdout, stderr)
  finally:  # A run that timed out (or a failure here) leaves nothing behind.
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return results
