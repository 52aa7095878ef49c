"""The loop engine's chunks: each chunk's body traced once, and its edges.

A step's edges (`planning.lowering.Edge`) carry tensors from chunk to chunk;
what each carries for one micro-batch (its `Boundary`) is known once its
source is traced. `Chunk` traces a chunk's forward once on those specs and
keeps its flat weights and initial state, and its `stage.SplitCall` when
some call keeps its activations, or its `split_backward.BackwardSplit` when
the table splits the backward.

    >>> from lingvo_gpipe.engine import stage as stage_lib
    >>> from lingvo_gpipe.planning import lowering
    >>> def Double(theta, inputs, state, micro_batch_id):
    ...   return (inputs[0] * theta,), state
    >>> edges = lowering.Edges(1, skips=())
    >>> boundaries = [Boundary([True], [tf.TensorSpec([2], tf.float32)]),
    ...               None]
    >>> chunk = Chunk(0, stage_lib.Stage(Double, 'c0', '/cpu:0'),
    ...               tf.constant(2.0), edges, boundaries, (),
    ...               check_weights=False, split=None)
    >>> chunk.in_edges, chunk.out_edges, boundaries[1].Structure()
    ([0], [1], (TensorSpec(shape=(2,), dtype=tf.float32, name=None),))
"""

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from lingvo_gpipe.engine import split_backward
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.planning import lowering


def Spec(t: tf.Tensor) -> tf.TensorSpec:
  return tf.TensorSpec(t.shape, t.dtype)


def Placeholder(spec: tf.TensorSpec) -> tf.Tensor:
  """Zeros of `spec` (unknown dimensions get size 0): a loop's first value."""
  shape = [0 if d is None else d for d in spec.shape.as_list()]
  return tf.zeros(shape, spec.dtype)


def Dense(t: Any, like: tf.Tensor) -> Optional[tf.Tensor]:
  """The gradient `t` of `like` as a dense tensor (None stays None).

  A sparse gradient (`tf.IndexedSlices`, an embedding lookup's) becomes a
  tensor of `like`'s shape, its rows added where its indices say, as
  `tf.convert_to_tensor` does; the number of rows is `like`'s static one
  where known, a constant, as XLA needs (the gradient's own dense shape is
  the output of a backward call, which XLA does not resolve to one).

  Args:
    t: A tensor, a `tf.IndexedSlices` or None.
    like: The tensor `t` is the gradient of.

  Returns:
    A tensor, or None.
  """
  if (isinstance(t, tf.IndexedSlices) and like.shape.rank and
      like.shape[0] is not None):
    return tf.math.unsorted_segment_sum(t.values, t.indices, like.shape[0])
  return None if t is None else tf.convert_to_tensor(t)


class Boundary:
  """The tensors that cross one edge for one micro-batch.

  Attributes:
    mask: Per leaf of the edge's structure, whether it is a tensor (not None).
    specs: TensorSpecs of the tensors.
    differentiable: Per tensor, whether its gradient flows back across the
      edge (by default: whether it is floating point or complex).
  """

  def __init__(self, mask: Sequence[bool], specs: Sequence[tf.TensorSpec],
               differentiable: Optional[Sequence[bool]] = None):
    self.mask = tuple(mask)
    self.specs = list(specs)
    self.differentiable = (
        [stage_lib.IsDifferentiable(s) for s in self.specs]
        if differentiable is None else list(differentiable))

  def Structure(self) -> Tuple[Optional[tf.TensorSpec], ...]:
    """The leaves, specs in place of tensors (None where None)."""
    specs = iter(self.specs)
    return tuple(next(specs) if present else None for present in self.mask)

  def DifferentiableSpecs(self) -> List[tf.TensorSpec]:
    """The specs of the tensors whose gradients flow back."""
    return [s for s, d in zip(self.specs, self.differentiable) if d]


class Chunk:
  """One chunk as the loops see it, found by tracing its body once.

  Attributes:
    stage: The chunk's `stage.Stage` (body and device).
    theta: Its flat weights (read once per step).
    in_edges: The edges it reads, main first (their tensors, in order, are
      its flat inputs).
    out_edges: The edges it writes, main first (their tensors, in order, are
      its flat outputs).
    state: Its flat initial state.
    split: Its `stage.SplitCall` or `split_backward.BackwardSplit`, or None
      (see `__init__`).
  """

  def __init__(self, index: int, stage: stage_lib.Stage, theta: Any,
               edges: Sequence[lowering.Edge],
               boundaries: List[Optional[Boundary]], state: Any,
               check_weights: bool, split: Optional[str]):
    """Traces the chunk's forward; sets the boundaries of its out-edges.

    Args:
      index: The chunk.
      stage: Its stage.
      theta: Its nest of weights.
      edges: The step's edges.
      boundaries: Per edge, its `Boundary` (those of the chunk's in-edges
        known); the chunk's out-edges' are set here.
      state: Its nest of initial state.
      check_weights: Whether to check that the body reads every weight from
        theta (a recompute must see them all).
      split: None, 'call' (some call keeps its activations: build its
        `stage.SplitCall`) or 'backward' (the table splits the backward:
        build its `split_backward.BackwardSplit`).
    """
    self.stage = stage
    self.in_edges = [e for e, edge in enumerate(edges) if edge.target == index]
    self.out_edges = [e for e, edge in enumerate(edges)
                      if edge.source == index]
    with tf.device(stage.device):
      self.theta = stage.FlattenTheta(theta)
    main, *skips = [boundaries[e].Structure() for e in self.in_edges]
    x_specs, self.state = stage.FlattenCall(main + tuple(skips), state)
    args = (self.theta, x_specs, self.state, tf.TensorSpec([], tf.int64))
    if check_weights:
      stage.CheckNoCapturedWeights(*args)
    with tf.device(stage.device):
      concrete = stage.forward.get_concrete_function(*args)
    results = list(concrete.structured_outputs)
    specs = iter(Spec(y) for y in results[:len(results) - stage.num_state])
    for e, mask in zip(self.out_edges,
                       stage.OutputGroups(len(self.out_edges) - 1)):
      boundaries[e] = Boundary(mask, [next(specs) for m in mask if m])
    with tf.device(stage.device):
      if split == 'backward':
        self.split = split_backward.BackwardSplit(stage, self.theta, x_specs,
                                                  self.state)
      else:
        self.split = (stage_lib.SplitCall(concrete, stage.name)
                      if split == 'call' else None)

  @property
  def device(self) -> str:
    return self.stage.device

  def Args(self, x: List[tf.Tensor], state: List[tf.Tensor],
           micro_batch_id: tf.Tensor) -> List[tf.Tensor]:
    """The flat arguments of a forward call."""
    return list(self.theta) + list(x) + list(state) + [micro_batch_id]
