"""A chunk's backward cut in two: input gradients (B), then weight gradients (W).

Zero-bubble schedules (`planning.schedule`, 'zb1p' and 'zbv') run a call's
backward as two actions: B returns the gradients of the call's inputs and
state, which the previous chunk waits for, and W, later, the gradients of
its weights, which only the optimizer needs. W must not redo B's work.

`BackwardSplit` builds one graph of a call: the chunk's forward followed by
TensorFlow's gradient of every differentiable argument (`tf.gradients`). Its
ops fall in three parts: the forward (what the outputs need), B (what the
input and state gradients need beyond the forward) and W (what the weight
gradients need beyond both: for a matmul x w, the product x^T dy). The
tensors W reads from the other two parts cross the cut: B returns them and
the engine stashes them until W (the *weight stash*). Each part becomes a
function of its own, pruned from the graph (`WrappedFunction.prune`):

* `Forward`: the forward of a call that keeps its activations, returning
  what B and W read of it (its stash);
* `Input`: B, from that stash, or recomputing the forward when the call
  re-materializes (the recompute belongs to B);
* `Weight`: W, from the weights and the weight stash.

A part is cut out of the graph by copying the ops its results need from the
given tensors (`_Parts`), through data edges only: a control edge into the
other part (e.g. to a check the forward already ran) is dropped.

Tensors crossing a cut whose value is static (shapes, reduction axes) are
not stashed: the receiving function gets them as constants, as XLA needs.
For y = tanh(w x), B stashes dy (1 - y^2) and x, and W multiplies them:

    >>> from lingvo_gpipe.engine import stage as stage_lib
    >>> def Body(theta, inputs, state, micro_batch_id):
    ...   return (tf.tanh(theta[0] * inputs[0]),), state
    >>> stage = stage_lib.Stage(Body, 'chunk 0', device='')
    >>> theta = stage.FlattenTheta([tf.constant(2.0)])
    >>> x, state = stage.FlattenCall([tf.constant(0.5)], ())
    >>> split = BackwardSplit(stage, theta, x, state)
    >>> args = theta + x + state + [tf.constant(0, tf.int64)]
    >>> d_inputs, stash = split.Input([tf.constant(1.0)], args, None)
    >>> [round(float(g), 4) for g in d_inputs], len(stash)
    ([0.8399], 2)
    >>> [round(float(g), 4) for g in split.Weight(theta, stash)]
    [0.21]
"""

from typing import Any, List, Optional, Sequence, Set, Tuple

import tensorflow as tf

from lingvo_gpipe.engine import stage as stage_lib


def _Closure(fetches: Sequence[tf.Tensor], stops: Set[Any]) -> Set[Any]:
  """The ops whose data `fetches` need, not walking past tensors in `stops`.
  """
  ops, stack = set(), [t.op for t in fetches if t.ref() not in stops]
  while stack:
    op = stack.pop()
    if op in ops:
      continue
    ops.add(op)
    stack += [t.op for t in op.inputs if t.ref() not in stops]
  return ops


class _Parts:
  """Cuts functions out of one graph (its GraphDef serialized once)."""

  def __init__(self, graph: Any):
    self._graph = graph
    self._graph_def = graph.as_graph_def()
    self._nodes = {node.name: node for node in self._graph_def.node}
    # The graph's captures: internal placeholder ref -> outer tensor.
    self._captured = {internal.ref(): external
                      for external, internal in graph.captures}

  def Function(self, feeds: Sequence[tf.Tensor],
               fetches: Sequence[tf.Tensor]) -> Any:
    """A function of `feeds` computing `fetches` with the graph's ops.

    Copies (as a GraphDef) the ops the fetches need from the feeds, each
    feed becoming a placeholder; tensors the graph captured are captured
    again. A feed may be one output of an op whose other outputs are
    computed. The copies lose their colocation constraints (the call's
    device places them).

    Args:
      feeds: Tensors of the graph the function takes, in order.
      fetches: Tensors of the graph it returns, in order.

    Returns:
      A concrete function whose calls are never inlined: inlined into the
      branch of a loop engine's instruction, a part's ops miss oneDNN's
      rewrite that its own instantiation gets (a weight gradient's matmuls
      ran as TensorFlow's Eigen kernels, 7% of a zb1p step).

    Raises:
      ValueError: if a fetch needs a placeholder that is not fed (a bug of
        the cut).
    """
    fed = {t.ref() for t in feeds}
    captures = [(r, outer) for r, outer in self._captured.items()
                if r not in fed]
    ops = _Closure(fetches, fed | {r for r, _ in captures})
    for op in ops:
      if op.type == 'Placeholder':
        raise ValueError(f'{op.name} is needed by {list(fetches)} but not '
                         'fed.')
    placeholder = {}
    for t in list(feeds) + [r.deref() for r, _ in captures]:
      placeholder.setdefault(t.name, f'split_backward_fed_{len(placeholder)}')
    part = tf.compat.v1.GraphDef(library=self._graph_def.library,
                                 versions=self._graph_def.versions)
    for t_name, name in placeholder.items():
      t = self._graph.get_tensor_by_name(t_name)
      node = part.node.add(name=name, op='Placeholder')
      node.attr['dtype'].type = t.dtype.as_datatype_enum
      node.attr['shape'].shape.CopyFrom(t.shape.as_proto())
    names = {op.name for op in ops}
    for op in ops:
      node = part.node.add()
      node.CopyFrom(self._nodes[op.name])
      del node.input[:]
      if '_class' in node.attr:  # Colocation with ops it may not copy.
        del node.attr['_class']
      for edge in self._nodes[op.name].input:
        if edge.startswith('^'):
          if edge[1:] in names:  # Control edges within the part alone.
            node.input.append(edge)
          continue
        tensor = edge if ':' in edge else edge + ':0'
        node.input.append(placeholder.get(tensor, edge))
    fetch_names = [f'{placeholder[t.name]}:0' if t.name in placeholder else
                   t.name for t in fetches]

    def Run(*values):
      input_map = {f'{placeholder[t.name]}:0': v
                   for t, v in zip(feeds, values)}
      input_map.update({f'{placeholder[r.deref().name]}:0': outer
                        for r, outer in captures})
      return tf.graph_util.import_graph_def(part, input_map=input_map,
                                            return_elements=fetch_names,
                                            name='')

    specs = [tf.TensorSpec(t.shape, t.dtype) for t in feeds]
    part_fn = tf.compat.v1.wrap_function(Run, specs)
    return tf.function(
        lambda *values: part_fn(*values), input_signature=specs,
        autograph=False,
        experimental_attributes={'_noinline': True}).get_concrete_function()


def _Crossing(fetches: Sequence[tf.Tensor], stops: Set[Any],
              available: Set[Any]) -> List[tf.Tensor]:
  """The tensors `fetches` read from `available` ops, in a fixed order.

  Walks back from `fetches` through ops that are not `available`; a tensor
  of an available op (or a graph input not in `stops`) crosses the cut.

  Args:
    fetches: The tensors a function computes.
    stops: Refs of the tensors it is given (not walked past, not crossing).
    available: Ops computed on the other side of the cut.

  Returns:
    The crossing tensors, each once.
  """
  crossing, seen, stack = [], set(), list(fetches)
  while stack:
    t = stack.pop()
    if t.ref() in seen or t.ref() in stops:
      continue
    seen.add(t.ref())
    if t.op in available or t.op.type == 'Placeholder':
      crossing.append(t)
      continue
    stack += list(t.op.inputs)
  return sorted(crossing, key=lambda t: t.name)


class _Cut:
  """Tensors crossing a cut: those stashed, and those passed as constants."""

  def __init__(self, tensors: Sequence[tf.Tensor]):
    self.tensors = list(tensors)
    self.values = [tf.get_static_value(t) for t in self.tensors]
    self.stashed = [t for t, v in zip(self.tensors, self.values) if v is None]
    self.specs = [tf.TensorSpec(t.shape, t.dtype) for t in self.stashed]

  def Feed(self, stash: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """Every crossing tensor's value: from `stash`, or its constant."""
    stashed = iter(stash)
    return [next(stashed) if v is None else tf.constant(v, t.dtype)
            for t, v in zip(self.tensors, self.values)]

  def Stash(self, values: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """The values to stash among every crossing tensor's value."""
    return [x for x, v in zip(values, self.values) if v is None]


class BackwardSplit:
  """One chunk's forward, input-gradient and weight-gradient functions.

  Attributes:
    stash_specs: Specs of what `Forward` stashes for `Input` (and `Weight`).
    weight_stash_specs: Specs of what `Input` stashes for `Weight`.
  """

  def __init__(self, stage: stage_lib.Stage, theta: Sequence[tf.Tensor],
               x: Sequence[Any], state: Sequence[tf.Tensor]):
    """Builds the chunk's graph and cuts it.

    Args:
      stage: The chunk's stage, its call structure recorded
        (`Stage.FlattenCall`).
      theta: Its flat weights (tensors or specs).
      x: Its flat inputs (tensors or specs).
      state: Its flat state (tensors or specs).
    """
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in
             list(theta) + list(x) + list(state)]
    specs.append(tf.TensorSpec([], tf.int64))
    self._num_theta, self._num_args = len(theta), len(specs)
    # The forward's outputs, from its trace (the engine's Chunk made it).
    results_of = stage.forward.get_concrete_function(
        list(theta), list(x), list(state), tf.TensorSpec([], tf.int64))
    self._result_specs = [tf.TensorSpec(t.shape, t.dtype) for t in
                          tf.nest.flatten(results_of.structured_outputs)]
    self._output_grads = [stage_lib.IsDifferentiable(s)
                          for s in self._result_specs]

    def Call(*flat):
      """The forward, then the gradients of the differentiable arguments."""
      args, d_outputs = flat[:self._num_args], flat[self._num_args:]
      results = stage.InlineForward(
          args[:len(theta)], args[len(theta):len(theta) + len(x)],
          args[len(theta) + len(x):-1], args[-1])
      diff_results = [y for y in results if stage_lib.IsDifferentiable(y)]
      diff_args = [a for a in args if stage_lib.IsDifferentiable(a)]
      grads = tf.gradients(diff_results, diff_args, list(d_outputs),
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)
      return results, grads

    graph_fn = tf.compat.v1.wrap_function(
        Call, specs + [s for s, d in zip(self._result_specs,
                                         self._output_grads) if d])
    graph = graph_fn.graph
    args = graph.inputs[:self._num_args]
    d_outputs = graph.inputs[self._num_args:self._num_args +
                             sum(self._output_grads)]
    results, grads = graph_fn.structured_outputs
    grads = iter(grads)
    per_arg = [next(grads) if stage_lib.IsDifferentiable(a) else None
               for a in args]
    self._theta_grads = per_arg[:self._num_theta]
    self._input_grads = per_arg[self._num_theta:-1]  # The id has none.
    weight_fetches = tf.nest.flatten(
        [g for g in self._theta_grads if g is not None],
        expand_composites=True)
    input_fetches = [g for g in self._input_grads if g is not None]
    given = {t.ref() for t in list(args) + list(d_outputs)}
    forward_ops = _Closure(results, given)
    input_ops = _Closure(input_fetches, given)
    theta_refs = {t.ref() for t in args[:self._num_theta]}
    self._weight_cut = _Cut(_Crossing(weight_fetches, theta_refs,
                                      forward_ops | input_ops))
    self.weight_stash_specs = self._weight_cut.specs
    # A call that keeps its activations: B reads the forward's tensors.
    self._forward_cut = _Cut(_Crossing(
        input_fetches + self._weight_cut.tensors, given, forward_ops))
    self.stash_specs = self._forward_cut.specs
    parts = _Parts(graph)
    self._forward = parts.Function(
        list(args), list(results) + self._forward_cut.tensors)
    self._input_keeping = parts.Function(
        list(args) + list(d_outputs) + self._forward_cut.tensors,
        input_fetches + self._weight_cut.tensors)
    self._input_recomputing = parts.Function(
        list(args) + list(d_outputs),
        input_fetches + self._weight_cut.tensors)
    self._weight = parts.Function(
        list(args[:self._num_theta]) + self._weight_cut.tensors,
        weight_fetches)

  def Forward(self, args: Sequence[tf.Tensor]
             ) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
    """A call that keeps its activations: (outputs and state, its stash)."""
    values = self._forward(*args)
    num_results = len(self._output_grads)
    return (list(values[:num_results]),
            self._forward_cut.Stash(values[num_results:]))

  def Input(self, d_outputs: Sequence[Optional[tf.Tensor]],
            args: Sequence[tf.Tensor],
            stash: Optional[Sequence[tf.Tensor]]
           ) -> Tuple[List[Optional[tf.Tensor]], List[tf.Tensor]]:
    """B: the gradients of the inputs and state, and the weight stash.

    Args:
      d_outputs: One per output (outputs, then state): its gradient, or None
        where none flows (zeros are passed) or it is not differentiable.
      args: The call's flat arguments (weights, inputs, state, id).
      stash: What `Forward` stashed, or None to recompute the forward.

    Returns:
      (gradients, weight stash): one gradient per input and state tensor
      (None where not differentiable), and what `Weight` needs.
    """
    grads = [tf.zeros(s.shape, s.dtype) if d is None else d
             for d, s, diff in zip(d_outputs, self._result_specs,
                                   self._output_grads) if diff]
    if stash is None:
      values = self._input_recomputing(*args, *grads)
    else:
      values = self._input_keeping(*args, *grads,
                                   *self._forward_cut.Feed(stash))
    values = iter(values)
    gradients = [None if g is None else next(values)
                 for g in self._input_grads]
    return gradients, self._weight_cut.Stash(list(values))

  def Weight(self, theta: Sequence[tf.Tensor],
             stash: Sequence[tf.Tensor]) -> List[Optional[Any]]:
    """W: the gradients of the weights (None where not differentiable).

    A sparse gradient (an embedding lookup's) is a `tf.IndexedSlices`.
    """
    values = iter(self._weight(*theta, *self._weight_cut.Feed(stash)))
    gradients = []
    for g in self._theta_grads:
      if g is None:
        gradients.append(None)
      else:
        parts = [next(values) for _ in tf.nest.flatten(
            g, expand_composites=True)]
        gradients.append(tf.nest.pack_sequence_as(g, parts,
                                                  expand_composites=True))
    return gradients
