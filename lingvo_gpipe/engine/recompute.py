"""Re-materialization: a stage call whose backward pass recomputes its forward.

`RecomputingCall` keeps only the call's inputs (weights, micro-batch, state).
Its custom gradient

* waits for every upstream gradient of the call, including the chain
  gradient of the stage's next micro-batch (see `stage.py`), and only then
  reruns the traced forward body inside the traced backward function. Without
  the wait a TF graph starts every recompute as soon as its inputs exist,
  i.e. during the forward pass, and peak memory exceeds the plain model's;
* runs on the stage's device (tf.gradients would otherwise leave the
  gradient ops unplaced, and they would land on the default device).

A stage's last call (its chain ends: pass_theta=False), y = theta x^2:

    >>> from lingvo_gpipe.engine import stage as stage_lib
    >>> def Body(theta, inputs, state, micro_batch_id):
    ...   return (theta[0] * tf.square(inputs[0]),), state
    >>> stage = stage_lib.Stage(Body, 'stage 1', '/cpu:1')
    >>> theta = stage.FlattenTheta([tf.constant(3.0)])
    >>> x, state = stage.FlattenCall([tf.constant(2.0)], ())
    >>> with tf.GradientTape() as tape:
    ...   tape.watch(theta + x)
    ...   (y,), token, theta_passed = RecomputingCall(
    ...       stage.forward, stage.backward, theta, x, state,
    ...       tf.constant(0, tf.int64), token=tf.constant(0.0),
    ...       pass_theta=False, device='/cpu:1')
    >>> float(y), theta_passed
    (12.0, [])
    >>> [float(g) for g in tape.gradient(y, theta + x)]  # x^2, 2 theta x
    [4.0, 12.0]
"""

from typing import Any, Callable, List, Sequence, Tuple

import tensorflow as tf


def Gate(tensors: Sequence[tf.Tensor],
         after: Sequence[Any]) -> List[tf.Tensor]:
  """Identities of `tensors` that exist only once all of `after` exist.

  The control dependencies are on an op that reads `after` (an identity,
  or one IdentityN for several tensors) as well as on the ops that made
  them: when TensorFlow inlines the function call that produced `after`, a
  control edge on the call becomes one on its side effects only and would
  not wait for its outputs, which the reading op takes as data inputs; the
  edge on the call is still needed, because Grappler inlines a call with
  side effects only where it has outgoing control edges.

  Args:
    tensors: What to pass on.
    after: Tensors (or None, or composites) to wait for.

  Returns:
    The identities of `tensors`.
  """
  after = tf.nest.flatten([t for t in after if t is not None],
                          expand_composites=True)
  waits = []
  if after and not tf.executing_eagerly():  # Eagerly, nothing to order.
    # One op reads them all: the same data edges as an identity each, but
    # one graph node per gate, not one per tensor (graph build time).
    read = (tf.identity(after[0]) if len(after) == 1 else
            tf.identity_n(after)[0])
    waits = [t.op for t in after] + [read.op]
  with tf.control_dependencies(waits):
    return [tf.identity(t) for t in tensors]


def JointGradients(tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
  """Identities of float `tensors` whose gradients each wait for all of them.

  For the inputs of a call that TensorFlow differentiates itself (one that
  keeps its activations): inlined, its gradient function yields each input's
  gradient as soon as that is computed, so the previous call's recompute,
  waiting through the chain for the weight gradients, could start before
  the gradient sent to the previous stage exists.

  Args:
    tensors: Float tensors (the chain's token and weights, the call's float
      inputs).

  Returns:
    Their identities.
  """
  if not tensors:
    return []

  @tf.custom_gradient
  def Joint(*xs):

    def Grad(*dys):
      dys = [tf.zeros_like(x) if d is None else d for x, d in zip(xs, dys)]
      return Gate(dys, dys)

    return [tf.identity(x) for x in xs], Grad

  return list(Joint(*tensors))


def _AddOptional(a, b):
  """a + b where either may be None and sparse gradients stay sparse."""
  if a is None:
    return b
  if b is None:
    return a
  if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
    return tf.IndexedSlices(
        tf.concat([a.values, b.values], 0),
        tf.concat([a.indices, b.indices], 0), a.dense_shape)
  return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def RecomputingCall(forward: Callable, backward: Callable,
                    theta: List[tf.Tensor], x: List[tf.Tensor],
                    state: List[tf.Tensor], micro_batch_id: tf.Tensor, *,
                    token: tf.Tensor, pass_theta: bool, device: str
                   ) -> Tuple[List[tf.Tensor], tf.Tensor, List[tf.Tensor]]:
  """Calls `forward` so that its gradient is computed by `backward`.

  Args:
    forward: (theta, x, state, micro_batch_id) -> outputs + new state (flat).
    backward: (theta, x, state, micro_batch_id, d_results) -> gradients of
      theta + x + state (None for non-differentiable entries); it recomputes
      the forward body itself.
    theta: Flat weights of the stage.
    x: The micro-batch inputs (tensors only).
    state: Flat stage state before this micro-batch.
    micro_batch_id: int64 scalar.
    token: The chain's scalar token.
    pass_theta: Whether to pass the weights on to the next micro-batch.
    device: Where the gradient ops run (the stage's device).

  Returns:
    (results, token, theta): the forward results, the chain's next token and
    the weights passed on (empty if not `pass_theta`).
  """
  n_theta, n_x = len(theta), len(x)

  @tf.custom_gradient
  def Call(*flat):
    inputs = list(flat[:-1])
    token_in = flat[-1]
    results = forward(inputs[:n_theta], inputs[n_theta:n_theta + n_x],
                      inputs[n_theta + n_x:], micro_batch_id)
    chain_out = Gate([token_in] +
                      (inputs[:n_theta] if pass_theta else []), results)
    num_results = len(results)

    def Grad(*d_flat, variables=None):
      d_results = list(d_flat[:num_results])
      d_token_out = d_flat[num_results]
      d_theta_out = list(d_flat[num_results + 1:]) or [None] * n_theta
      # Colocation (tf.gradients' colocate_gradients_with_ops) is part of the
      # tf.function cache key: it would retrace `backward` at every call.
      with tf.compat.v1.colocate_with(None, ignore_existing=True), \
          tf.device(device):
        gated = Gate(inputs, d_flat)
        # The gradients of the chain (the token, the weights passed on) are
        # data inputs too: made by the next micro-batch's backward, which
        # TensorFlow may inline (a call that keeps its activations).
        # The same number of waits at every call (the weights themselves stand
        # in for the gradients of weights not passed on, at a stage's last
        # call), so that `backward` is traced once per stage, not twice.
        waits = [d_token_out if d_token_out is not None else token_in] + [
            d if d is not None else t
            for d, t in zip(d_theta_out, gated[:n_theta])]
        d_inputs = backward(gated[:n_theta], gated[n_theta:n_theta + n_x],
                            gated[n_theta + n_x:], micro_batch_id, d_results,
                            tf.nest.flatten(waits, expand_composites=True))
        d_theta = [
            _AddOptional(a, b) for a, b in zip(d_inputs[:n_theta], d_theta_out)
        ]
        d_rest = list(d_inputs[n_theta:])
        if d_token_out is None:
          d_token_out = tf.zeros_like(token_in)
        d_token = Gate([d_token_out], d_theta + d_rest)[0]
      return d_theta + d_rest + [d_token], [None] * len(variables or [])

    return list(results) + chain_out, Grad

  out = Call(*theta, *x, *state, token)
  num_results = len(out) - 1 - (n_theta if pass_theta else 0)
  return list(out[:num_results]), out[num_results], list(out[num_results + 1:])
