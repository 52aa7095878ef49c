"""Tests of lingvo_gpipe.profiling: what plan.py auto measures of cells."""

from lingvo import compat as tf
from lingvo.core import layers
import numpy as np
import pytest

from lingvo_gpipe import profiling


def _FC(name, input_dim, output_dim, activation='RELU'):
  return layers.FCLayer.Params().Set(name=name, input_dim=input_dim,
                                     output_dim=output_dim,
                                     activation=activation)


def testProfileCellsSizes():
  """Sizes are exact whatever ran before in the process.

  The sizes come from the allocation records, which hold the chunks
  TensorFlow's BFC allocator (the tests' and the workers') gave: requests
  rounded up to 256 bytes, and a free chunk given whole when it is less
  than twice the request, so that what earlier tests left free decides
  whether a 512-byte request takes 512 or 768 bytes (a oneDNN-off suite run
  measured 96 bytes an example for a's 64 at 8 examples). Every tensor here
  (at 8 examples: a's ReLU output and its gradient, the input gradients, the
  weight gradients) is at most 256 bytes, a single chunk size; the test
  leaves free 768-byte chunks before it profiles to show that they do not
  count. The timed runs are 10, so that the fastest of a sub-millisecond
  call is found on a loaded host.
  """
  holes, kept = [], []
  for i in range(200):  # Allocated in turns: 768 bytes, then 256 kept.
    holes.append(tf.fill([192], float(i)))
    kept.append(tf.fill([64], float(i)))
  del holes
  with tf.Graph().as_default():
    cells = [_FC('a', 8, 8).Instantiate(),
             _FC('b', 8, 4, 'NONE').Instantiate()]
  sample = np.ones([8, 8], np.float32)
  profiles, outputs = profiling.ProfileCells(
      cells, sample, batch_dim=0, micro_batch_sizes=[4, 8],
      optimizer_fn=lambda: tf.compat.v1.train.AdamOptimizer(1e-3),
      num_warmup=1, num_runs=10)
  del kept
  a, b = profiles
  assert (a.name, b.name) == ('a', 'b')
  # a's backward keeps its ReLU output (8 floats an example); b is linear:
  # its backward needs only its input (held as a stage input) and weights.
  assert a.activation_bytes == 8 * 4 and b.activation_bytes == 0
  assert a.output_bytes == 8 * 4 and b.output_bytes == 4 * 4
  assert a.weight_bytes == (8 * 8 + 8) * 4 == a.gradient_bytes
  assert a.slot_bytes == 2 * a.weight_bytes  # Adam: m and v.
  assert b.weight_bytes == (8 * 4 + 4) * 4
  assert np.shape(outputs[0]) == (8, 4)
  for p, (input_dim, output_dim) in zip(profiles, [(8, 8), (8, 4)]):
    # A forward and backward of a small matmul on 8 examples: more than no
    # work (the fit is never below 0) and far from a second, which would be
    # a measurement of something else (the build, a retrace).
    assert 0.0 < p.forward_s(8) + p.backward_s(8) < 1.0, p
    assert 0.0 <= p.forward_s(8) < 1.0 and 0.0 <= p.update_s < 1.0, p
    # Beyond what the forward keeps and the weight gradients, the kernels can
    # hold at most the other tensors they make: for each example the
    # pre-activation, the output, their gradients and the input gradient.
    most = 8 * (4 * output_dim + input_dim) * 4
    for workspace in (p.workspace_bytes, p.kept_workspace_bytes):
      assert workspace(8) <= most, p


def testProfileCellsArguments():
  with tf.Graph().as_default():
    cells = [_FC('a', 8, 16).Instantiate()]
  sample = np.ones([8, 8], np.float32)
  with pytest.raises(ValueError, match='micro_batch_sizes'):
    profiling.ProfileCells(cells, sample, batch_dim=0, micro_batch_sizes=[0])
  with pytest.raises(ValueError, match='num_runs=0 must be >= 1'):
    profiling.ProfileCells(cells, sample, batch_dim=0, micro_batch_sizes=[2],
                           num_runs=0)
  with pytest.raises(ValueError, match='no 16 examples'):
    profiling.ProfileCells(cells, sample, batch_dim=0,
                           micro_batch_sizes=[16])


def testHeldAtForwardEnd():
  from tensorflow.core.framework import step_stats_pb2  # pylint: disable=g-import-not-at-top
  stats = step_stats_pb2.StepStats()
  device = stats.dev_stats.add(device='/cpu:0')

  def Node(name, start, end, records):
    node = device.node_stats.add(node_name=name, all_start_micros=start,
                                 all_end_rel_micros=end - start)
    memory = node.memory.add(allocator_name='cpu')
    for when, size in records:
      memory.allocation_records.add(alloc_micros=when, alloc_bytes=size)

  # A fed input is not the forward's allocation.
  Node('_arg_x_0_0', 0, 1, [(0, 1000)])
  # Forward: 100 kept; 40 allocated and released before the forward ends;
  # the 100 is released by the backward, later.
  Node('cell/a', 1, 3, [(1, 100), (10, -100)])
  Node('cell/b', 3, 5, [(3, 40), (4, -40)])
  Node('cell/c', 5, 6, [(5, 8)])
  Node(profiling.BACKWARD_SCOPE + '/grad', 7, 12, [(7, 500), (11, -500)])
  assert profiling.HeldAtForwardEnd(stats, profiling.BACKWARD_SCOPE) == 108
  assert profiling.AllocationPeak(stats) == 1608
  # The backward's own kernels: 500 at once, whatever the forward holds.
  assert profiling.AllocationPeak(stats, profiling.BACKWARD_SCOPE) == 500


def testProfileCellKeptBytesOfLingvoFeedForward():
  # Lingvo's transformer feed-forward layer on [time 4, batch 8, dim 8]: 32
  # positions. What its forward holds for the backward is measured from
  # traced runs: at least the ReLU output and its padding-masked copy (16
  # floats each per position), at most every tensor the forward makes (layer
  # norm 8, hidden 16, ReLU 16, masked copy 16, output 8 and residual 8
  # floats per position) as the allocator hands them out. The allocation
  # records hold what the allocator gave, not what was asked: TensorFlow's
  # BFC allocator (the tests' and the measuring workers') rounds to 256 bytes
  # and gives a free chunk whole when it is less than twice the request, so
  # a process that allocated before may record up to twice the bytes.
  # Grappler's rewrites and the allocator's state decide where in between.
  from lingvo.core import layers_with_attention  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    cell = layers_with_attention.TransformerFeedForwardLayer.Params().Set(
        name='ff', input_dim=8, hidden_dim=16).Instantiate()
  inputs = (np.ones([4, 8, 8], np.float32), np.zeros([4, 8], np.float32))
  runs = [profiling.ProfileCell(cell, inputs, num_warmup=1, num_runs=1)
          for _ in range(2)]
  for run in runs:
    assert (32 * 2 * 16 * 4 <= run.kept_bytes <=
            2 * 32 * (8 + 3 * 16 + 2 * 8) * 4), run
  assert runs[0].output_bytes == 32 * 8 * 4
  # Its backward's own kernels make at least the gradient of the hidden
  # layer (16 floats per position) beside the weight gradients.
  assert min(r.kept_workspace_bytes for r in runs) >= 32 * 16 * 4
