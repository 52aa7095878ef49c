"""The loop engine's passes and their gradients.

A table with the loss outside the pipeline (`LossOutside`) runs its forward
pass as loops whose custom gradient runs the backward loops; a table with the
loss inside (`LossInside`) runs forward and backward instructions in one pass
in the forward computation, and its gradient scales the gradients that pass
summed by the upstream gradient of the mean loss. Both take the executor
(`loop.Executor`) made from the flat weights and stacked inputs, so that only
the custom gradient differentiates the loops.
"""

from typing import Any, List, Sequence

import tensorflow as tf

from lingvo_gpipe.engine import stage as stage_lib


def Join(parts: Sequence[Sequence[Any]]) -> List[Any]:
  """Concatenates lists."""
  return [t for part in parts for t in part]


def Unjoin(values: Sequence[Any],
            sizes: Sequence[Sequence[int]]) -> List[List[List[Any]]]:
  """Cuts `values` into groups of lists of the given sizes (`Join` inverse).

  Args:
    values: A flat sequence.
    sizes: Per group, the lengths of its lists, in order.

  Returns:
    Per group, its lists.
  """
  groups, start = [], 0
  for group in sizes:
    lists = []
    for size in group:
      lists.append(list(values[start:start + size]))
      start += size
    groups.append(lists)
  return groups


@tf.custom_gradient
def _NoGradient(t):
  """Identity whose gradient is an error: outputs a loss-inside step cannot
  differentiate."""

  def Grad(unused_d):
    raise ValueError(
        'A gradient flows through an output of a pipeline with the loss '
        'inside (its last cell computes the loss) other than its first (the '
        'loss): a metric or a final state. The step computes the gradient of '
        'the mean loss only; compute other terms outside the pipeline, or '
        'use a schedule with the loss outside.')

  return tf.identity(t), Grad


def _StopGradients(flat: Sequence[Any]) -> List[Any]:
  """tf.stop_gradient of each tensor, on the tensor's own device.

  The weights and inputs reach here on their chunk's device (`chunks.Chunk`
  reads them there); a stop_gradient under the caller's device scope (Lingvo's
  trainer builds under one) would send every chunk's weights to that device
  and back at each step.

  Args:
    flat: Tensors.

  Returns:
    Their stop_gradients.
  """
  stopped = []
  for t in flat:
    with tf.device(t.device):
      stopped.append(tf.stop_gradient(t))
  return stopped


def LossOutside(new_executor, flat, sizes, step, output_edges):
  """Forward loops, and backward loops as their gradient.

  Args:
    new_executor: Makes the `Executor` from flat weights + stacked inputs.
    flat: Weights, stacked inputs and initial states, flat.
    sizes: How `flat` is cut (`Unjoin`).
    step: The lowered step (passes 'forward' and 'backward').
    output_edges: The edges into the output.

  Returns:
    (outputs stacked [M, ...], final states flat).
  """
  (_, forward_ticks), (_, backward_ticks) = step.phases

  @tf.custom_gradient
  def Pipelined(*flat):
    # Only Grad differentiates the loops: tapes must not watch them (a
    # recording tape, as Lingvo's eager trainer keeps one, would build the
    # loops' own gradients, for minutes).
    flat = _StopGradients(flat)
    run = new_executor(flat)
    interp = run.interp
    v = run.Run(forward_ticks, run.Initial(Unjoin(flat, sizes)[2]),
                'forward')
    outputs, final_states, _, _, _ = interp.Results(v)
    num_outputs = len(outputs)

    def Grad(*d_flat, variables=None):
      d_flat = [None if d is None else tf.stop_gradient(d) for d in d_flat]
      d_states = Unjoin(d_flat[num_outputs:], sizes[2:])[0]
      # tf.gradients colocates gradient ops with the op they differentiate;
      # this one spans every chunk's device, and places its ops itself.
      with tf.compat.v1.colocate_with(None, ignore_existing=True):
        given = iter(zip(d_flat[:num_outputs], outputs))
        for e in output_edges:
          interp.d_outputs[e] = []
          for d in interp.Differentiable(e):
            g, y = next(given)
            interp.d_outputs[e].append(
                None if not d else tf.zeros_like(y) if g is None else g)
        initial = run.Initial(final_states, d_states)
        for key in ('data', 'saved_state', 'stash'):
          initial[key] = v[key]
        backward = run.Run(backward_ticks, initial, 'backward')
        _, _, d_theta, d_x, d_init = interp.Results(backward)
      return (Join(d_theta) + d_x + Join(d_init),
              [None] * len(variables or []))

    return outputs + Join(final_states), Grad

  results = Pipelined(*flat)
  num_outputs = len(results) - sum(sizes[2])
  return results[:num_outputs], results[num_outputs:]


def LossInside(new_executor, flat, sizes, step, output_edges):
  """One pass of forward and backward instructions in the forward pass.

  The backward starts from d(mean loss) / d(loss of micro-batch m) = 1 / M;
  the gradient of the pass scales the gradients the pass summed by the
  upstream gradient of the mean loss. Gradients through the other outputs
  (metrics) or the final states are errors (`_NoGradient`).

  Args:
    new_executor: Makes the `Executor` from flat weights + stacked inputs.
    flat: Weights, stacked inputs and initial states, flat.
    sizes: How `flat` is cut (`Unjoin`).
    step: The lowered step (one pass, 'step').
    output_edges: The edge into the output (one: the loss and metrics).

  Returns:
    (means of the outputs over micro-batches, final states flat).
  """
  (output,) = output_edges
  ((_, ticks),) = step.phases

  @tf.custom_gradient
  def Pipelined(*flat):
    flat = _StopGradients(flat)
    run = new_executor(flat)
    interp = run.interp
    num_micro = step.table.num_micro_batches
    device = interp.chunks[-1].device
    with tf.device(device):
      interp.d_outputs[output] = [
          None if not d else
          tf.constant(1.0 / num_micro if i == 0 else 0.0, s.dtype)
          for i, (d, s) in enumerate(zip(
              interp.Differentiable(output),
              interp.boundaries[output].specs))
      ]
    v = run.Run(ticks, run.Initial(Unjoin(flat, sizes)[2]), 'step')
    outputs, final_states, d_theta, d_x, _ = interp.Results(v)
    with tf.device(device):
      means = [tf.reduce_mean(y, 0) for y in outputs]

    def Grad(*d_flat, variables=None):
      scale = d_flat[0]  # The upstream gradient of the mean loss.
      grads = [None if g is None else g * tf.cast(scale, g.dtype)
               for g in Join(d_theta) + d_x]
      return (grads + [None] * len(Join(final_states)),
              [None] * len(variables or []))

    return means + Join(final_states), Grad

  results = Pipelined(*flat)
  num_outputs = len(results) - sum(sizes[2])
  outputs = [results[0]] + [_NoGradient(y) for y in results[1:num_outputs]]
  final_flat = [_NoGradient(t) if stage_lib.IsDifferentiable(t) else t
                for t in results[num_outputs:]]
  return outputs, final_flat
