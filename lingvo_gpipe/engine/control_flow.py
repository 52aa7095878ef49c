"""The loop engine's control flow: loops and branches, lowered or not.

Outside XLA, TensorFlow lowers a graph's While, If and Case ops to
Switch/Merge control flow before it runs them, unless an op says otherwise.
The loop engine keeps its loops and branches unlowered: each tick is then
one function call per loop, as in Lingvo's recurrent.py, instead of control
kernels for every loop variable and every tensor a chunk reads, which make
a step run many times the kernels, and slower (docs/engines.md). Lowered,
the kernels inside the loops show in RunMetadata step stats, where tests and
the timeline read which device ran them when; the ops, their devices and
the executor are the same either way. Lowering is a build option of the
code that builds the step (`ObservableLoops`, a context variable: scoped to
the `with` block and its thread), read when the engine builds its loops.

    >>> with ObservableLoops():
    ...   lowered = Lowered()
    >>> lowered, Lowered()
    (True, False)
"""

import contextlib
import contextvars
from typing import Any, Callable, Sequence, Tuple

from absl import logging
import tensorflow as tf

_LOWERING_ATTR = '_lower_using_switch_merge'
_LOWERED = contextvars.ContextVar('lingvo_gpipe_lowered_loops',
                                  default=False)
BRANCH_OPS = ('If', 'StatelessIf', 'Case', 'StatelessCase')
LOOP_OPS = ('While', 'StatelessWhile')


@contextlib.contextmanager
def ObservableLoops(lowered: bool = True):
  """Builds the loop engine's loops lowered, so step stats show their kernels.

  Args:
    lowered: Whether to lower the loops built inside the context.

  Yields:
    Nothing.
  """
  token = _LOWERED.set(lowered)
  try:
    yield
  finally:
    _LOWERED.reset(token)


def Lowered() -> bool:
  """Whether loops built now are lowered (`ObservableLoops`)."""
  return _LOWERED.get()


def Flow(v: Any) -> tf.Tensor:
  """A TensorArray's flow, or the tensor itself."""
  return v.flow if isinstance(v, tf.TensorArray) else v


def KeepUnlowered(outputs: Any, op_types: Tuple[str, ...],
                  lowered: bool) -> None:
  """Marks the While, If or Case op that made `outputs` to run as calls.

  Args:
    outputs: What tf.while_loop, tf.cond or tf.switch_case returned.
    op_types: The op types to look for, e.g. BRANCH_OPS.
    lowered: If True, leaves the op to be lowered.
  """
  if lowered or tf.executing_eagerly():
    return
  for t in tf.nest.flatten(outputs):
    op = Flow(t).op
    while op.type == 'Identity' and op.inputs:
      op = op.inputs[0].op
    if op.type in op_types:
      try:
        op._set_attr(  # pylint: disable=protected-access
            _LOWERING_ATTR, tf.compat.v1.AttrValue(b=False))
      except AttributeError:  # A TF without Operation._set_attr: lowered.
        logging.warning('Cannot keep %s unlowered; it runs lowered.', op.name)
      return


def Dispatch(choices: Sequence[Any], idles: bool, branch: tf.Tensor,
             run: Callable[[Any], Any], idle: Callable[[], Any], name: str,
             lowered: bool) -> Any:
  """Runs one device's instruction, picked by `branch`.

  Args:
    choices: The instruction keys the device runs.
    idles: Whether it may idle instead.
    branch: int32 scalar, the index into choices (len(choices): idle).
    run: run(choice) builds a branch; returns the device's values.
    idle: Returns the device's values unchanged.
    name: The branch op's name.
    lowered: Whether the branch op is lowered (`KeepUnlowered`).

  Returns:
    What `run` or `idle` returns.
  """
  fns = [lambda c=c: run(c) for c in choices]
  if idles:
    fns.append(idle)
  if len(fns) == 1:
    return fns[0]()
  if len(fns) == 2:
    results = tf.cond(branch < 1, fns[0], fns[1], name=name)
  else:
    results = tf.switch_case(branch, fns, name=name)
  KeepUnlowered(results, BRANCH_OPS, lowered)
  return results
