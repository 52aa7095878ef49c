"""Helpers of the Lingvo layer tests: cell stacks, references and runners."""

import collections
import contextlib
import re

import numpy as np
from lingvo import compat as tf
from lingvo.core import builder_layers
from lingvo.core import layers
from lingvo.core import py_utils

from lingvo_gpipe import GPipeSequentialLayer
from params import lm

import engine_util


def SeededGraph(seed=1):
  """A new tf.Graph whose variables get the same initial values in every run.

  A new graph has no seed, and Lingvo's initializers then draw new weights
  in every run; with one, Lingvo seeds each variable from its name.

  Args:
    seed: The graph seed.

  Returns:
    The graph.
  """
  graph = tf.Graph()
  graph.seed = seed
  return graph


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


def BatchMajorStackParams(cls, splits, num_micro_batches, dim):
  """A small packed-input batch-major Transformer stack: 1 encoder, 1 decoder.

  Args:
    cls: Lingvo's `GPipeBatchMajorTransformerStack` or ours.
    splits: Lingvo's split of the cells.
    num_micro_batches: M.
    dim: The model dimension (2 heads, feed-forward 2 dim).

  Returns:
    The stack's Params; embeddings and softmax are left to the caller.
  """
  p = cls.Params().Set(name='stack', model_dim=dim, num_encoder_layers=1,
                       num_decoder_layers=1, packed_input=True, splits=splits,
                       num_micro_batches=num_micro_batches, random_seed=1)
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.input_dim = dim
    tpl.tr_atten_tpl.num_heads = 2
    tpl.tr_fflayer_tpl.hidden_dim = 2 * dim
  return p


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


def RunGraph(pipe_params, cell_fn, inputs):
  """Pipeline vs. reference in a TF1 graph.

  Args:
    pipe_params: GPipeSequentialLayer params (cells from cell_fn()).
    cell_fn: Returns fresh cell params for the reference.
    inputs: numpy arrays or None.

  Returns:
    (pipe_values, ref_values, sparse): outputs + dense gradients of both, and
    {variable name: indices} of every pipeline weight gradient that is
    sparse (IndexedSlices) as built, before any densifying.
  """
  graph = SeededGraph()  # The same weights in every run.
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = pipe_params.Instantiate()
    ref = Reference(cell_fn())
    xs = [None if x is None else tf.constant(x) for x in inputs]
    y = pipe.FProp(pipe.theta, *xs)
    y_ref = ref.FProp(pipe.theta, *xs)
    grads = [tf.gradients(_Loss(out), _Wrt(pipe, xs)) for out in (y, y_ref)]
    fetches = [_Outputs(out) + [tf.convert_to_tensor(g) for g in out_grads]
               for out, out_grads in zip((y, y_ref), grads)]
    sparse = {v.name: g.indices for v, g in zip(pipe.vars.Flatten(), grads[0])
              if isinstance(g, tf.IndexedSlices)}
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run(fetches + [sparse])


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


def TracedFCStep(remat, num_micro_batches=2, engine='unrolled', num_stages=4,
                 cluster=contextlib.nullcontext()):
  """One traced training step (gradients) of FCCells().

  Args:
    remat: The remat mode.
    num_micro_batches: M.
    engine: The pipeline engine.
    num_stages: K.
    cluster: The Lingvo cluster to build the step in (devices=None).

  Returns:
    (graph, step_stats): the graph and the RunMetadata step stats.
  """
  graph, metadata = TracedFCRun(remat, num_micro_batches, engine, num_stages,
                                cluster)
  return graph, metadata.step_stats


def TracedFCRun(remat, num_micro_batches=2, engine='unrolled', num_stages=4,
                cluster=contextlib.nullcontext()):
  """`TracedFCStep`, returning all of the step's RunMetadata.

  Args:
    remat: The remat mode.
    num_micro_batches: M.
    engine: The pipeline engine.
    num_stages: K.
    cluster: The Lingvo cluster to build the step in (devices=None).

  Returns:
    (graph, run_metadata): the graph, and the RunMetadata with step stats and
    the partition graphs the step ran (after Grappler and function inlining:
    the graphs whose node names the step stats report).
  """
  p = PipeParams(FCCells(), num_stages=num_stages,
                 num_micro_batches=num_micro_batches, remat=remat,
                 engine=engine)
  graph = tf.Graph()
  with graph.as_default(), cluster:
    py_utils.GetOrCreateGlobalStepVar()
    pipe = p.Instantiate()
    y = pipe.FProp(pipe.theta, tf.constant(np.ones([8, 8], np.float32)))
    # Without recompute the gradient of a stage call is TensorFlow's own;
    # Lingvo's trainer colocates gradients with their ops, so do we here.
    grads = tf.compat.v1.gradients(
        tf.reduce_sum(y * y), pipe.vars.Flatten(),
        colocate_gradients_with_ops=remat != 'always')
    with tf.compat.v1.Session(
        graph=graph, config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      metadata = tf.compat.v1.RunMetadata()
      sess.run(grads,
               options=tf.compat.v1.RunOptions(
                   trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                   output_partition_graphs=True),
               run_metadata=metadata)
  return graph, metadata
