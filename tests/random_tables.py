"""Schedule tables for property tests: random valid ones, and FIFO backward.

Pure Python. `RandomTable` draws a valid table of any sizes and placement
from a seeded `random.Random`, so that a test can check a reader of tables
(the simulator, the memory model, an engine) on many schedules that nobody
wrote by hand. `FifoBackwardTable` is one such schedule that the named
ones never make: the backwards in the order of the forwards.
"""

import random
from typing import Dict, List, Optional, Sequence, Tuple

from lingvo_gpipe.planning import schedule

A = schedule.Action
F, B, W = schedule.FORWARD, schedule.BACKWARD, schedule.WEIGHT


def RandomPlacement(rng: random.Random, num_devices: int,
                    virtual_stages: int) -> Tuple[int, ...]:
  """A random placement of K v chunks: every device gets exactly v of them.

  Args:
    rng: The source of randomness.
    num_devices: K.
    virtual_stages: v.

  Returns:
    Per chunk, its device.
  """
  devices = [k for k in range(num_devices) for _ in range(virtual_stages)]
  rng.shuffle(devices)
  return tuple(devices)


def Needs(action: schedule.Action, num_chunks: int, num_micro_batches: int,
          loss_outside: bool) -> List[schedule.Action]:
  """The actions that `action` needs to have run, by the rules of `Validate`.

  Stated here again, not taken from the schedule module, so that a test of
  the module does not check it against itself.

  Args:
    action: An action of the step.
    num_chunks: C.
    num_micro_batches: M.
    loss_outside: Whether every backward needs every forward of the last
      chunk (the loss runs after the pipeline).

  Returns:
    The forward of the previous chunk for a forward; for a backward, its own
    forward, the backward of the next chunk and, with the loss outside, the
    forwards of the last chunk; each once; for a weight gradient, its own
    backward.
  """
  phase, c, m = action
  if phase == F:
    return [A(F, c - 1, m)] if c else []
  if phase == W:
    return [A(B, c, m)]
  needs = [A(F, c, m)]
  if c + 1 < num_chunks:
    needs.append(A(B, c + 1, m))
  if loss_outside:
    needs += [A(F, num_chunks - 1, i) for i in range(num_micro_batches)]
  return list(dict.fromkeys(needs))  # The last chunk's own forward once.


def RandomTable(rng: random.Random,
                num_devices: int,
                num_micro_batches: int,
                virtual_stages: int,
                loss_outside: bool,
                placement: Optional[Sequence[int]] = None,
                split_backward: bool = False) -> schedule.Table:
  """A random valid table: a random order of the step's actions, placed.

  Draws a placement if none is given (`RandomPlacement`), then a random
  topological order of all 2 C M (split: 3 C M) actions under the dependencies of
  `Needs` (Kahn's algorithm taking a random ready action each time), cuts
  it into per-device orders (each action to the device of its chunk) and
  places them with `schedule.TableFromOrders`.

  The orders cannot deadlock: `TableFromOrders` makes an action wait for
  what it needs and for its device's previous action, and both come before
  it in the one global order (the first by construction, the second since
  each device's order is a subsequence of it). Every wait points back in
  that order, so there is no cycle of waits, and each action lands on a
  tick after everything it needs: the table is valid.

  Args:
    rng: The source of randomness (e.g. `random.Random(seed)`).
    num_devices: K.
    num_micro_batches: M.
    virtual_stages: v.
    loss_outside: See `schedule.Table`.
    placement: Per chunk, its device; None: a random one.
    split_backward: Whether the table splits each backward into B and W
      (a weight-gradient action per call, `schedule.Table.split_backward`).

  Returns:
    The validated table, named 'random'.
  """
  num_chunks = num_devices * virtual_stages
  if placement is None:
    placement = RandomPlacement(rng, num_devices, virtual_stages)
  phases = (F, B, W) if split_backward else (F, B)
  actions = [A(phase, c, m) for phase in phases
             for c in range(num_chunks) for m in range(num_micro_batches)]
  waiting: Dict[schedule.Action, int] = {}
  followers: Dict[schedule.Action, List[schedule.Action]] = {
      a: [] for a in actions}
  for action in actions:
    needs = Needs(action, num_chunks, num_micro_batches, loss_outside)
    waiting[action] = len(needs)
    for need in needs:
      followers[need].append(action)
  ready = [a for a in actions if not waiting[a]]
  orders = [[] for _ in range(num_devices)]
  while ready:
    i = rng.randrange(len(ready))
    ready[i], ready[-1] = ready[-1], ready[i]
    action = ready.pop()
    orders[placement[action.chunk]].append(action)
    for follower in followers[action]:
      waiting[follower] -= 1
      if not waiting[follower]:
        ready.append(follower)
  return schedule.TableFromOrders(
      'random', num_devices=num_devices, num_micro_batches=num_micro_batches,
      virtual_stages=virtual_stages, loss_outside=loss_outside,
      orders=orders, placement=placement)


def FifoBackwardTable(num_devices: int,
                      num_micro_batches: int) -> schedule.Table:
  """GPipe with the backwards in the order of the forwards (FIFO).

  Not in the reverse order, as GPipe's own: device k runs the forwards of
  micro-batches 0 .. M - 1, then their backwards in the same order; the loss
  is outside the pipeline, v = 1.

  Args:
    num_devices: K.
    num_micro_batches: M.

  Returns:
    The validated table, named 'fifo'.
  """
  micro_batches = range(num_micro_batches)
  orders = [[A(F, k, m) for m in micro_batches] +
            [A(B, k, m) for m in micro_batches]
            for k in range(num_devices)]
  return schedule.TableFromOrders(
      'fifo', num_devices=num_devices, num_micro_batches=num_micro_batches,
      virtual_stages=1, loss_outside=True, orders=orders)
