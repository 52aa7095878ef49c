"""Tests of lingvo_gpipe.costs: params, flops and profile costs of cells."""

from lingvo import compat as tf
from lingvo.core import layers
from lingvo.core import tshape
import numpy as np
import pytest

from lingvo_gpipe import costs
import test_util


def _FC(name, input_dim, output_dim):
  return layers.FCLayer.Params().Set(
      name=name, input_dim=input_dim, output_dim=output_dim)


def _Build(cell_params):
  """Instantiates cells the way a model does: in a TF1 graph."""
  with tf.Graph().as_default():
    return [p.Instantiate() for p in cell_params]


def _FCFlops(rows, input_dim, output_dim):
  """Lingvo's FCLayer estimate: matmul, ReLU (1 flop) and bias."""
  return 2 * rows * input_dim * output_dim + rows * output_dim + output_dim


def testParams():
  cells = _Build([_FC('a', 3, 5), _FC('b', 5, 2), _FC('c', 2, 2)])
  assert costs.CellCosts(cells, 'params') == [3 * 5 + 5, 5 * 2 + 2, 2 * 2 + 2]
  assert costs.CellMemory(cells) == [4.0 * 20, 4.0 * 12, 4.0 * 6]


def testParamsCountOnlyTrainableVariables():
  bn = layers.BatchNormLayer.Params().Set(name='bn', dim=4)
  cells = _Build([bn, _FC('fc', 4, 4)])
  # Beta and gamma train; the moving mean and variance do not.
  assert costs.CellCosts(cells, 'params') == [8.0, 20.0]
  assert costs.CellMemory(cells) == [4.0 * 16, 4.0 * 20]


@pytest.mark.parametrize(
    'input_shapes',
    [[4, 8], (4, 8), tf.TensorShape([4, 8]), (tshape.Shape([4, 8]),),
     ([4, 8],)])
def testFlopsChained(input_shapes):
  cells = _Build([_FC('a', 8, 16), _FC('b', 16, 4)])
  assert costs.CellCosts(cells, 'flops', input_shapes=input_shapes) == [
      _FCFlops(4, 8, 16), _FCFlops(4, 16, 4)
  ]


def testFlopsFromSampleInputs():
  cells = _Build([_FC('a', 8, 16)])
  sample = np.zeros([3, 5, 8], np.float32)
  assert costs.CellCosts(cells, 'flops', sample_inputs=sample) == [
      _FCFlops(15, 8, 16)
  ]


def testFlopsErrors():
  cells = _Build(test_util.TransformerCells(2))
  with pytest.raises(
      ValueError,
      match=r"partition='flops': cell 'tr0' \(TransformerCell\) does not "
      r"define FPropMeta.*partition='params' or 'profile'"):
    costs.CellCosts(cells, 'flops', input_shapes=([2, 3, 8], [2, 3]))
  fcs = _Build([_FC('a', 8, 16), _FC('b', 8, 4)])
  with pytest.raises(ValueError, match=r"cell 'b' \(FCLayer\) rejects input "
                     r'shapes \(\[4, 16\]\)'):
    costs.CellCosts(fcs, 'flops', input_shapes=[4, 8])
  with pytest.raises(ValueError, match='unknown dimensions'):
    costs.CellCosts(fcs, 'flops', input_shapes=[None, 8])
  with pytest.raises(ValueError, match="needs the first cell's input_shapes"):
    costs.CellCosts(fcs, 'flops')


def testBadArguments():
  with pytest.raises(ValueError, match=r"method='time' .*'flops', 'params'"):
    costs.CellCosts(_Build([_FC('a', 2, 2)]), 'time')
  with pytest.raises(ValueError, match='cells=.*non-empty list'):
    costs.CellCosts([], 'params')


def testProfileRanksHeavyCellFirst():
  cells = _Build([_FC('heavy', 512, 512), _FC('down', 512, 8),
                  _FC('light', 8, 8)])
  sample = np.random.default_rng(0).standard_normal([64, 512]).astype(
      np.float32)
  seconds = costs.CellCosts(cells, 'profile', sample_inputs=sample)
  assert len(seconds) == 3 and min(seconds) > 0
  assert seconds[0] > seconds[2], seconds


def testProfileMultipleInputsFromShapes():
  # (vecs, paddings) flow from cell to cell; inputs are made from the shapes.
  cells = _Build(test_util.TransformerCells(2))
  seconds = costs.CellCosts(cells, 'profile', input_shapes=([2, 3, 8], [2, 3]))
  assert len(seconds) == 2 and min(seconds) > 0
