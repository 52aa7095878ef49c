"""One pipeline stage: its body traced once, called once per micro-batch.

A stage function maps `(theta, inputs, state, micro_batch_id)` to
`(outputs, state)`: `theta` is a nest of weight tensors, `inputs` and `outputs`
are tuples of tensors or None, `state` is a nest of tensors carried from one
micro-batch to the next (accumulated counters, auxiliary losses, batch-norm
sums), and `micro_batch_id` is an int64 scalar unique to the micro-batch and
training step, for seeding randomness. The body is traced into a `tf.function`
once per stage (Python tracing costs O(K)); the unrolled engine calls it once
per micro-batch, so the graph holds K * M calls.

Every call also threads a *chain* through the stage's micro-batches: a scalar
token and (while more micro-batches follow) the stage's weights, passed on as
identities after the call's outputs exist. Because micro-batch m + 1 consumes
the chain that micro-batch m produced, the forward pass runs a stage's
micro-batches in order, and the backward pass, which must finish m + 1 before
it can produce m's chain gradient, runs them in reverse; the weight gradients
are summed along the same chain as the backward pass proceeds instead of being
held M times and added at the end (torchgpipe's fork/join, done with tensors).
A stage that counts its micro-batches in its state, called on two of them:

    >>> def Body(theta, inputs, state, micro_batch_id):
    ...   (x,) = inputs
    ...   return (tf.matmul(x, theta),), state + 1.0
    >>> stage = Stage(Body, name='stage0', device='/cpu:1')
    >>> @tf.function
    ... def Step(theta, micro_batches):
    ...   with tf.GradientTape() as tape:
    ...     tape.watch(theta)
    ...     chain, state, loss = stage.StartChain(theta), tf.constant(0.0), 0.0
    ...     for m, x in enumerate(micro_batches):
    ...       (y,), state, chain = stage.Call(
    ...           chain, [x], state, tf.constant(m, tf.int64), remat=True,
    ...           last=m == len(micro_batches) - 1)
    ...       loss += tf.reduce_sum(y)
    ...   return loss, state, tape.gradient(loss, theta)
    >>> loss, state, d_theta = Step(3.0 * tf.eye(2),
    ...                             [tf.ones([1, 2]), 2.0 * tf.ones([1, 2])])
    >>> float(loss), float(state), d_theta.numpy().tolist()
    (18.0, 2.0, [[3.0, 3.0], [3.0, 3.0]])
"""

import contextlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

from absl import logging
import tensorflow as tf
try:  # Private: see _DisableSpecialization.
  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
  from tensorflow.python.eager.polymorphic_function import attributes as _tf_attributes
  # pylint: enable=g-direct-tensorflow-import,g-import-not-at-top
except ImportError:
  _tf_attributes = None

from lingvo_gpipe.engine import recompute
from lingvo_gpipe.engine import scopes

_NO_SPECIALIZE = '_nospecialize'

MaybeTensor = Optional[tf.Tensor]
StageFn = Callable[[Any, Tuple[MaybeTensor, ...], Any, tf.Tensor],
                   Tuple[Sequence[MaybeTensor], Any]]


def IsDifferentiable(t: tf.Tensor) -> bool:
  """Whether gradients flow through tensor `t` (floating or complex dtype)."""
  return t.dtype.is_floating or t.dtype.is_complex


def _DisableSpecialization(fn: tf.types.experimental.PolymorphicFunction):
  """Asks Grappler not to copy `fn` once per call site.

  Grappler's function optimizer specializes a function body per call site and
  optimizes every copy anew, so the first session run of a step grows with
  the M calls of each stage's backward function (docs/design.md has the
  measurement). The FunctionDef attribute '_nospecialize' turns that off, but
  tf.function only accepts attribute names from an allowlist, which is
  extended here for this one name. If a TensorFlow release drops the
  mechanism, functions are specialized as before (slower, still correct).

  Args:
    fn: A tf.function, before its first trace.
  """
  allowlists = ('TRACING_COMPILATION_ALLOWLIST',
                'MONOMORPHIC_FUNCTION_ALLOWLIST')
  if _tf_attributes is None or not all(
      hasattr(_tf_attributes, a) for a in allowlists) or not hasattr(
          fn, '_attributes'):
    logging.warning('Cannot mark %s %s; Grappler may specialize it per call.',
                    fn, _NO_SPECIALIZE)
    return
  for allowlist in allowlists:
    setattr(_tf_attributes, allowlist,
            getattr(_tf_attributes, allowlist) | {_NO_SPECIALIZE})
  fn._attributes[_NO_SPECIALIZE] = True  # pylint: disable=protected-access


class SplitCall:
  """A stage's forward that returns what its backward needs, and that backward.

  TensorFlow's own split of a traced forward function, the pair its gradient
  of a call uses: the forward returns the outputs followed by the
  intermediate tensors the backward reads; the backward takes the gradients
  of the differentiable outputs followed by those intermediates. The loop
  engine stashes the intermediates of a call that does not re-materialize
  from its forward's tick to its backward's. Intermediates that are the
  call's own arguments are not stashed: the backward gets the arguments
  again; nor are those with a static value (shapes, reduction axes), which
  the backward gets as constants.

  The backward function returns its gradients flat: a sparse gradient (an
  embedding lookup's `tf.IndexedSlices`) as its component tensors (values,
  indices, dense shape), and nothing for an argument the outputs do not
  depend on. `Backward` packs them back into one gradient per argument, as
  `Stage.backward` returns them.

  It uses a private TensorFlow API (`ConcreteFunction.
  _delayed_rewrite_functions.forward_backward()`, TF 2.21); without it the
  constructor raises, and only remat='always' runs in the loop engine. For
  y = tanh(theta x), the stash is y, which the gradient reads:

      >>> def Body(theta, inputs, state, micro_batch_id):
      ...   return (tf.tanh(theta[0] * inputs[0]),), state
      >>> stage = Stage(Body, 'stage 0', device='')
      >>> theta = stage.FlattenTheta([tf.constant(2.0)])
      >>> x, state = stage.FlattenCall([tf.constant(0.5)], ())
      >>> micro_batch_id = tf.constant(0, tf.int64)
      >>> split = SplitCall(stage.forward.get_concrete_function(
      ...     theta, x, state, micro_batch_id), 'stage 0')
      >>> args = theta + x + state + [micro_batch_id]
      >>> (y,), stash = split.Forward(args)
      >>> round(float(y), 4), [round(float(t), 4) for t in stash]
      (0.7616, [0.7616])
      >>> d_theta, d_x, d_id = split.Backward([tf.constant(1.0)], args, stash)
      >>> round(float(d_theta), 4), round(float(d_x), 4), d_id
      (0.21, 0.8399, None)
  """

  def __init__(self, concrete: Any, name: str):
    """Splits a concrete forward function.

    Args:
      concrete: The concrete function of a stage's forward call.
      name: The stage's name, for errors.

    Raises:
      ValueError: if this TensorFlow has no such split, or it is not the
        expected shape.
    """
    # The split appends the intermediates to the forward graph's outputs.
    self._num_outputs = len(concrete.outputs)
    self._output_grads = [IsDifferentiable(t) for t in concrete.outputs]
    try:
      rewrites = concrete._delayed_rewrite_functions  # pylint: disable=protected-access
      self._forward, backward = rewrites.forward_backward()
      self._backward = backward._inference_function  # pylint: disable=protected-access
      backward_inputs = backward.graph.inputs
      self._grads_of_args = backward.structured_outputs
    except AttributeError as e:
      raise ValueError(
          f'{name}: this TensorFlow does not split a traced call into forward '
          'and backward functions (private API), which keeping activations '
          "in the loop engine needs; use remat='always' or engine='unrolled'."
      ) from e
    graph = self._forward.graph
    self._captures = list(concrete.captured_inputs)
    arg_ids = {id(t): i for i, t in enumerate(graph.inputs)}
    # Per intermediate: the argument it is (an index), a constant (a numpy
    # value: shapes and reduction axes, which XLA needs as constants), or
    # None: stashed.
    self._sources = []
    self.stash_specs = []
    for t in graph.outputs[self._num_outputs:]:
      source = arg_ids.get(id(t))
      if source is None:
        source = tf.get_static_value(t)
      if source is None:
        self.stash_specs.append(tf.TensorSpec(t.shape, t.dtype))
      self._sources.append(source)
    num_intermediates = len(self._sources)
    if len(backward_inputs) - num_intermediates != sum(self._output_grads):
      raise ValueError(
          f'{name}: the backward function takes '
          f'{len(backward_inputs) - num_intermediates} output gradients, '
          f'expected {sum(self._output_grads)}; this TensorFlow splits calls '
          "differently. Use remat='always' or engine='unrolled'.")

  def Forward(self, args: Sequence[tf.Tensor]
             ) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
    """Runs the forward; returns (outputs, tensors to stash)."""
    results = self._forward.call_flat(*args, *self._captures)
    intermediates = results[self._num_outputs:]
    return (list(results[:self._num_outputs]),
            [t for t, source in zip(intermediates, self._sources)
             if source is None])

  def Backward(self, d_outputs: Sequence[Optional[tf.Tensor]],
               args: Sequence[tf.Tensor],
               stash: Sequence[tf.Tensor]) -> List[Any]:
    """Gradients of the call's arguments (None where not differentiable).

    Args:
      d_outputs: One per forward output: a gradient for each differentiable
        output (zeros where none flows), anything for the others.
      args: The call's arguments, as given to `Forward`.
      stash: What `Forward` returned to stash.

    Returns:
      One gradient per argument: a tensor, or a `tf.IndexedSlices` where
      TensorFlow's gradient is sparse; zeros for a differentiable argument
      the outputs do not depend on, None for the others.
    """
    inputs = list(args) + self._captures
    stashed = iter(stash)
    intermediates = []
    for source in self._sources:
      if source is None:
        intermediates.append(next(stashed))
      elif isinstance(source, int):
        intermediates.append(inputs[source])
      else:
        intermediates.append(tf.constant(source))
    grads = [d for d, differentiable in zip(d_outputs, self._output_grads)
             if differentiable]
    flat = iter(self._backward.call_flat(*grads, *intermediates))
    results = []
    for arg, g in zip(args, self._grads_of_args):
      if g is None:
        results.append(tf.zeros_like(arg) if IsDifferentiable(arg) else None)
      else:  # A tensor, or the components of a composite (IndexedSlices).
        parts = [next(flat) for _ in tf.nest.flatten(g, expand_composites=True)]
        results.append(tf.nest.pack_sequence_as(g, parts,
                                                expand_composites=True))
    return results


class Chain:
  """The ordering chain of one stage: a token plus the weights passed along."""

  def __init__(self, token: tf.Tensor, theta: List[tf.Tensor]):
    self.token = token
    self.theta = theta


class Stage:
  """A stage body traced once and called per micro-batch.

  Attributes:
    name: Used in error messages and function names.
    device: The device of the stage's ops.
  """

  def __init__(self, stage_fn: StageFn, name: str, device: str,
               pin_forward: bool = True):
    """Wraps `stage_fn`.

    Args:
      stage_fn: The stage body, see the module docstring.
      name: A name for error messages and the traced functions.
      device: Where the stage's forward and backward ops run ('' = default).
        Callers place the calls on it.
      pin_forward: Whether the traced forward body places its ops on `device`
        itself. Needed where TensorFlow inlines the forward call into the
        caller's graph (the unrolled engine): inlining does not place the body
        on the call's device. A body that runs as a call (the backward always,
        both in the loop engine) runs on the call's device; pinned inside, it
        would run as a multi-device function (about six executor runs per
        call instead of one).
    """
    self.name = name
    self.device = device
    self._pin_forward = pin_forward
    self._stage_fn = stage_fn
    self._theta_struct = None
    self._state_struct = None
    self._input_struct = None
    self._input_mask = None
    self._output_struct = None
    self._output_mask = None
    self._num_state = 0
    self._checked_weights = False
    self.forward = tf.function(self._Forward, autograph=False)
    # Inlining would let TensorFlow start a recompute as soon as its forward
    # inputs exist, ignoring the gate on upstream gradients (recompute.py).
    self.backward = tf.function(
        self._Backward,
        autograph=False,
        experimental_attributes={'_noinline': True})
    _DisableSpecialization(self.backward)

  def StartChain(self, theta: Any) -> Chain:
    """Reads the stage's weights once per step and starts its chain.

    Args:
      theta: A nest of tensors or variables.

    Returns:
      The chain for the stage's first micro-batch.
    """
    return Chain(tf.zeros([], tf.float32), self.FlattenTheta(theta))

  def FlattenTheta(self, theta: Any) -> List[tf.Tensor]:
    """Reads the stage's weights once per step; returns them flat.

    Args:
      theta: A nest of tensors or variables.

    Returns:
      Identities of the flattened weights, in `tf.nest` order.
    """
    self._theta_struct = theta
    return [tf.identity(t) for t in tf.nest.flatten(theta)]

  def FlattenCall(self, inputs: Sequence[Any],
                  state: Any) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
    """Records the structure of a call's inputs and state; returns them flat.

    Args:
      inputs: The micro-batch's inputs: tensors or None, then (with skip
        connections) one tuple per incoming skip.
      state: The stage's state before the call.

    Returns:
      (x_tensors, state_flat): the input leaves that are not None and the
      state's tensors in `tf.nest` order.
    """
    self._input_struct = tuple(inputs)
    self._input_mask = tuple(
        x is not None for x in tf.nest.flatten(self._input_struct))
    self._state_struct = state
    state_flat = tf.nest.flatten(state)
    self._num_state = len(state_flat)
    return ([x for x in tf.nest.flatten(self._input_struct) if x is not None],
            state_flat)

  def OutputGroups(self, num_trailing: int) -> List[Tuple[bool, ...]]:
    """The output leaves' masks, cut into the main outputs and trailing groups.

    Args:
      num_trailing: How many of the body's outputs (the last ones) are
        groups of their own (skip connections leaving the stage).

    Returns:
      1 + num_trailing masks (True where an output leaf is a tensor, not
      None), which together cover every output leaf.
    """
    entries = list(self._output_struct)
    cut = len(entries) - num_trailing
    if cut < 0:
      raise ValueError(f'{self.name} returns {len(entries)} outputs, fewer '
                       f'than its {num_trailing} outgoing skips.')
    groups, leaves = [], iter(self._output_mask)
    for part in [entries[:cut]] + [[e] for e in entries[cut:]]:
      groups.append(tuple(next(leaves) for _ in tf.nest.flatten(part)))
    return groups

  @property
  def num_state(self) -> int:
    """The number of state tensors of the last recorded call."""
    return self._num_state

  def _Body(self, theta_flat, x_tensors, state_flat, micro_batch_id, pinned):
    """Runs the user's body on flat arguments; returns flat outputs + state.

    Args:
      theta_flat: Flat weights.
      x_tensors: The micro-batch input leaves that are not None.
      state_flat: Flat state before this micro-batch.
      micro_batch_id: int64 scalar.
      pinned: Whether to place the body's ops on the stage's device.

    Returns:
      (outputs, state): the body's output leaves that are not None and its
      flat new state.
    """
    theta = tf.nest.pack_sequence_as(self._theta_struct, list(theta_flat))
    tensors = iter(x_tensors)
    inputs = tf.nest.pack_sequence_as(
        self._input_struct,
        [next(tensors) if present else None for present in self._input_mask])
    state = tf.nest.pack_sequence_as(self._state_struct, list(state_flat))
    with tf.device(self.device) if pinned else contextlib.nullcontext():
      outputs, new_state = self._stage_fn(theta, inputs, state, micro_batch_id)
    if not isinstance(outputs, (tuple, list)):
      outputs = (outputs,)
    leaves = tf.nest.flatten(tuple(outputs))
    mask = tuple(y is not None for y in leaves)
    if self._output_mask is not None and mask != self._output_mask:
      raise ValueError(f'{self.name}: outputs changed from one trace to the '
                       f'next: {self._output_mask} vs {mask}.')
    self._output_mask = mask
    self._output_struct = tf.nest.map_structure(lambda _: 0, tuple(outputs))
    new_state_flat = tf.nest.flatten(new_state)
    if len(new_state_flat) != self._num_state:
      raise ValueError(
          f'{self.name}: the stage function returned a state with '
          f'{len(new_state_flat)} tensors, expected {self._num_state} '
          'like the state it was given.')
    return [y for y in leaves if y is not None], new_state_flat

  def _Forward(self, theta_flat, x_tensors, state_flat, micro_batch_id):
    y, state = self._Body(theta_flat, x_tensors, state_flat, micro_batch_id,
                          self._pin_forward)
    return y + state

  def InlineForward(self, theta_flat: Sequence[tf.Tensor],
                    x_tensors: Sequence[tf.Tensor],
                    state_flat: Sequence[tf.Tensor],
                    micro_batch_id: tf.Tensor) -> List[tf.Tensor]:
    """Builds the forward body where it is called, with no function call.

    For a caller that already runs once per micro-batch as a function, such
    as the body of a loop over ticks, where a call of `forward` would run as
    a function of its own at every tick, a cost that shows on small stages
    (docs/engines.md). The caller
    places the ops (`tf.device`); they are named
    '<caller's scope>/<scopes.INLINE_FORWARD_SCOPE>/<op as named in
    `forward`>'.

    Args:
      theta_flat: Flat weights.
      x_tensors: The micro-batch input leaves that are not None.
      state_flat: Flat state before this micro-batch.
      micro_batch_id: int64 scalar.

    Returns:
      The output leaves that are not None, then the flat new state, as
      `forward` returns them.
    """
    with tf.name_scope(scopes.INLINE_FORWARD_SCOPE):
      y, state = self._Body(theta_flat, x_tensors, state_flat,
                            micro_batch_id, pinned=False)
    return y + state

  def _Backward(self, theta_flat, x_tensors, state_flat, micro_batch_id,
                d_outputs, waits=()):
    """Recomputes the body and returns gradients of its differentiable inputs.

    Args:
      theta_flat: Flat weights.
      x_tensors: The micro-batch inputs that are not None.
      state_flat: Flat state before this micro-batch.
      micro_batch_id: The same id as in the forward call.
      d_outputs: Gradients of the forward outputs (outputs then state), None
        for outputs that are not differentiable.
      waits: Tensors the call must wait for, unused inside: as data inputs
        of the (never inlined, never specialized) call they order it even
        after tensors made by inlined functions, where control edges would
        only wait for side effects (`recompute.RecomputingCall`).

    Returns:
      Gradients for theta_flat + x_tensors + state_flat, one per entry; zeros
      for unconnected differentiable entries, None for the others.
    """
    del waits  # Only their existence matters.
    y, state = self._Body(theta_flat, x_tensors, state_flat, micro_batch_id,
                          pinned=False)
    ys, dys = [], []
    for out, d_out in zip(y + state, d_outputs):
      if d_out is not None:
        ys.append(out)
        dys.append(d_out)
    wrt = list(theta_flat) + list(x_tensors) + list(state_flat)
    diff = [t for t in wrt if IsDifferentiable(t)]
    grads = iter(
        tf.gradients(
            ys, diff, dys, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        if ys and diff else [tf.zeros_like(t) for t in diff])
    return [next(grads) if IsDifferentiable(t) else None for t in wrt]

  def Call(self, chain: Chain, inputs: Sequence[MaybeTensor], state: Any,
           micro_batch_id: tf.Tensor, remat: bool, last: bool,
           training: bool = True) -> Tuple[List[MaybeTensor], Any, Chain]:
    """Runs the stage on one micro-batch.

    Args:
      chain: The chain from the previous micro-batch (or `StartChain`).
      inputs: The micro-batch's inputs, tensors or None.
      state: The stage's state after the previous micro-batch.
      micro_batch_id: int64 scalar, unique per micro-batch and step.
      remat: Whether the backward pass recomputes this call instead of keeping
        its activations.
      last: Whether this is the stage's last micro-batch of the step (the chain
        then stops passing the weights on).
      training: Whether the step takes gradients (with remat False, the
        call's inputs then get joint gradients, `recompute.JointGradients`).

    Returns:
      (outputs, state, chain): outputs with None where the body returned None,
      the new state, and the chain for the next micro-batch.
    """
    x_tensors, state_flat = self.FlattenCall(inputs, state)
    args = (chain.theta, x_tensors, state_flat, micro_batch_id)
    if remat:
      self.CheckNoCapturedWeights(*args)
      results, token, theta = recompute.RecomputingCall(
          self.forward, self.backward, *args, token=chain.token,
          pass_theta=not last, device=self.device)
    else:
      # TensorFlow differentiates the call itself, keeping its activations.
      flat = [chain.token] + list(chain.theta) + x_tensors + state_flat
      floats = [i for i, t in enumerate(flat)
                if training and t.dtype.is_floating]
      joint = recompute.JointGradients([flat[i] for i in floats])
      for i, t in zip(floats, joint):
        flat[i] = t
      token_in, *flat = flat
      theta_in, flat = flat[:len(chain.theta)], flat[len(chain.theta):]
      results = self.forward(theta_in, flat[:len(x_tensors)],
                             flat[len(x_tensors):], micro_batch_id)
      token, *theta = recompute.Gate(
          [token_in] + ([] if last else theta_in), results)
      if last:
        # Grappler inlines a call with side effects only where it has an
        # outgoing control edge; the last call's chain goes nowhere, so its
        # outputs wait for the token (whose identity has that edge).
        results = recompute.Gate(results, [token])
    num_y = len(results) - self._num_state
    y_iter = iter(results[:num_y])
    outputs = tf.nest.pack_sequence_as(
        self._output_struct,
        [next(y_iter) if present else None for present in self._output_mask])
    new_state = tf.nest.pack_sequence_as(state, results[num_y:])
    return list(outputs), new_state, Chain(token, theta)

  def CheckNoCapturedWeights(self, *args) -> None:
    """Raises if the traced body reads trainable variables not in theta.

    Checked once per stage; later calls return at once.

    Args:
      *args: The arguments of a forward call (theta, x, state, id; flat).

    Raises:
      ValueError: naming the variables.
    """
    if self._checked_weights:
      return
    self._checked_weights = True
    graph = self.forward.get_concrete_function(*args).graph
    captured = [v.name for v in graph.variables if v.trainable]
    if captured:
      raise ValueError(
          f'{self.name} reads trainable variables {captured} that are not '
          'passed in its theta; their gradients would be lost by the '
          'recompute. Pass every weight a stage uses through theta.')
