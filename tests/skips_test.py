"""Skip connections across stages: GPipeSequentialLayer.Params().skips."""

import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import layers
from lingvo.core import py_utils

import engine_util
import test_util

RNG = np.random.RandomState(7)
X = RNG.randn(16, 8).astype(np.float32)


class SkipFCCell(base_layer.BaseLayer):
  """An FC layer of x plus the sum of whatever skips in: relu((x + s) w)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 8, 'Input and output size.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('fc', layers.FCLayer.Params().Set(
        input_dim=self.params.dim, output_dim=self.params.dim))

  def FProp(self, theta, x, *skipped):
    for s in skipped:
      x += s
    return self.fc.FProp(theta.fc, x)


class MeanSquareLoss(base_layer.BaseLayer):
  """The loss cell of 1F1B: mean(x^2) of x plus what skips in."""

  def FProp(self, theta, x, *skipped):
    del theta
    for s in skipped:
      x += s
    return tf.reduce_mean(tf.square(x))


def Cells(num_cells=8, loss=False):
  cells = [SkipFCCell.Params().Set(name=f'c{i}') for i in range(num_cells)]
  if loss:
    cells.append(MeanSquareLoss.Params().Set(name='loss'))
  return cells


SKIPS = [('c0', 'c5'), ('c1', 'c7'), ('c2', None), ('c3', 'c4'),
         ('c0', 'c7')]


def Plain(layer, theta, x, skips, num_micro=1, loss=False):
  """The cells run in order by hand, with the skips, per micro-batch."""
  names = [c.params.name for c in layer.children.values()]
  results = []
  for part in tf.split(x, num_micro):
    values, h = {}, part
    for name in names:
      skipped = [values[a] for a, b in skips if b == name]
      h = layer.children[name].FProp(theta[name], h, *skipped)
      values[name] = h
    extra = [values[a] for a, b in skips if b is None]
    results.append([h] + extra)
  if loss:
    return tf.add_n([r[0] for r in results]) / num_micro
  return [tf.concat(parts, 0) for parts in zip(*results)]


def _Run(k, m, engine, schedule='gpipe', remat='always', v=1):
  loss_inside = schedule != 'gpipe'
  skips = SKIPS if not loss_inside else [s for s in SKIPS if s[1]] + [
      ('c6', 'loss')]
  graph = tf.Graph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    pipe = test_util.PipeParams(
        Cells(loss=loss_inside), num_stages=k, virtual_stages=v,
        num_micro_batches=m, engine=engine, schedule=schedule, remat=remat,
        skips=skips, partition='params' if loss_inside else 'uniform'
    ).Instantiate()
    # A placeholder: with the loss inside, the input gradient is computed
    # for inputs a gradient can be asked for (engine/watched.py).
    x = tf.compat.v1.placeholder_with_default(X, X.shape)
    out = pipe.FProp(pipe.theta, x)
    ref = Plain(pipe, pipe.theta, x, skips, m, loss_inside)
    wrt = pipe.vars.Flatten() + [x]
    if loss_inside:
      fetches = [[out] + tf.gradients(out, wrt), [ref] + tf.gradients(ref, wrt)]
    else:
      fetches = [
          list(out) + tf.gradients([tf.reduce_sum(y * y) for y in out], wrt),
          ref + tf.gradients([tf.reduce_sum(y * y) for y in ref], wrt)]
    with tf.compat.v1.Session(graph=graph,
                              config=engine_util.SessionConfig()) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return sess.run(fetches)


# (K, M): for each K, fewer micro-batches than stages, as many, and more.
@pytest.mark.parametrize('k,m', [(1, 1), (1, 8), (2, 1), (2, 4), (4, 1),
                                 (4, 4), (4, 8)])
def testSkipsAreTransparent(k, m, engine):
  """Outputs (the last cell's, then c2's) and every gradient vs by hand."""
  actual, expected = _Run(k, m, engine)
  assert len(actual) == len(expected) == 2 + 8 * 2 + 1
  engine_util.AssertTransparent(actual, expected)


@pytest.mark.parametrize('k,v,m', [(2, 1, 4), (4, 1, 8), (2, 2, 4)])
@pytest.mark.parametrize('remat', ['always', 'never'])
def testSkipsWith1F1B(k, v, m, remat):
  actual, expected = _Run(k, m, 'loop', '1f1b', remat, v)
  engine_util.AssertTransparent(actual, expected)


@pytest.mark.parametrize('engine,remat', [('unrolled', 'never'),
                                          ('unrolled', 'except_last'),
                                          ('loop', 'never')])
def testSkipsKeepingActivations(engine, remat):
  actual, expected = _Run(4, 4, engine, remat=remat)
  engine_util.AssertTransparent(actual, expected)


@pytest.mark.parametrize('skips,message', [
    ([('c3', 'c1')], r"\('c3', 'c1'\) goes to itself or backwards"),
    ([('c2', 'c2')], r"\('c2', 'c2'\) goes to itself or backwards"),
    ([('c2', 'c9')], r"'c9' is not a cell; the cells are \['c0'"),
    ([('cx', None)], r"'cx' is not a cell"),
    ([('c1',)], r"\('c1',\) is not a \(from_cell, to_cell\) pair"),
])
def testBadSkipsFailNamingSkips(skips, message):
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r'skips=.*' + message):
      test_util.PipeParams(Cells(), num_stages=2, skips=skips).Instantiate()
