"""Tests of keras.costs: the per-layer costs of partition='params'/'profile'."""

import keras
import pytest

from lingvo_gpipe.keras import costs


def _Built(layers, input_dim):
  keras.Sequential([keras.Input((input_dim,))] + layers)
  return layers


def testParamCountsAndVariableBytes():
  dense, bn, relu = _Built([keras.layers.Dense(3), keras.layers.
                            BatchNormalization(), keras.layers.ReLU()], 4)
  # Dense 4 -> 3: kernel and bias; batch norm of 3 channels: gamma and beta
  # trainable, moving mean and variance not; ReLU: nothing.
  assert costs.ParamCounts([dense, bn, relu]) == [4 * 3 + 3, 2 * 3, 0]
  assert costs.VariableBytes([dense, bn, relu]) == [(4 * 3 + 3) * 4,
                                                    4 * 3 * 4, 0]


def testProfileTimesTimesEachLayerOnTheOutputOfTheLastOne():
  layers = _Built([keras.layers.Dense(8), keras.layers.Dense(2)], 4)
  times = costs.ProfileTimes(layers, [16, 4], num_warmup=1, num_runs=3)
  assert len(times) == 2 and all(0.0 < t < 1.0 for t in times), times
  with pytest.raises(ValueError, match='every dimension known, got '
                     r'\[None, 4\]'):
    costs.ProfileTimes(layers, [None, 4])
