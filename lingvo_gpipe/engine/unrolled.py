"""The unrolled engine: every (stage, micro-batch) call is its own graph node.

K x M calls of the K stage bodies (each body traced once per stage), ordered
by `stage.py`'s chains and re-materialized by `recompute.py`. The steady step
is the fastest on few micro-batches, but the graph, its trace and its XLA
compile grow with K x M; the loop engine (`loop.py`) does not.

    outputs, states = Run(stages, thetas, inputs, states, num_micro_batches=4,
                          batch_dim=0, remat='always', first_id=id0,
                          training=True)
"""

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from lingvo_gpipe.engine import microbatch
from lingvo_gpipe.engine import stage as stage_lib
from lingvo_gpipe.planning import schedule


def Run(stages: Sequence[stage_lib.Stage], thetas: Sequence[Any],
        inputs: Sequence[Optional[tf.Tensor]], states: List[Any], *,
        num_micro_batches: int, batch_dim: int, remat: str,
        first_id: tf.Tensor,
        training: bool) -> Tuple[List[Optional[tf.Tensor]], List[Any]]:
  """Builds the K x M stage calls of one step in `schedule.GPipeSchedule` order.

  Args:
    stages: K stages, each with its device.
    thetas: K nests of weights.
    inputs: The mini-batch inputs, tensors or None.
    states: K nests of initial stage states.
    num_micro_batches: M.
    batch_dim: The dimension inputs are split and outputs merged along.
    remat: One of `schedule.REMAT_MODES`.
    first_id: int64 id of micro-batch 0; micro-batch m gets first_id + m.
    training: If False, no call is set up for recompute.

  Returns:
    (outputs, states): the last stage's outputs merged along batch_dim and
    each stage's state after the last micro-batch.
  """
  num_stages, num_micro = len(stages), num_micro_batches
  states = list(states)
  with tf.device(stages[0].device):
    micro_inputs = microbatch.Split(inputs, num_micro, batch_dim)
  chains = []
  for s, theta in zip(stages, thetas):
    with tf.device(s.device):
      chains.append(s.StartChain(theta))
  outputs = [[None] * num_micro for _ in range(num_stages)]
  for tick in schedule.GPipeSchedule(num_stages, num_micro):
    for k, m in tick:
      x = micro_inputs[m] if k == 0 else outputs[k - 1][m]
      with tf.device(stages[k].device), tf.name_scope(f'stage{k}'):
        outputs[k][m], states[k], chains[k] = stages[k].Call(
            chains[k], x, states[k], first_id + m,
            remat=training and schedule.Recomputes(remat, m, num_micro),
            last=m == num_micro - 1)
  with tf.device(stages[-1].device):
    merged = microbatch.Merge(outputs[-1], batch_dim)
  return merged, states
