"""Tests of keras.stages: Keras layers as stage functions, and their checks."""

import keras
import pytest

from lingvo_gpipe.keras import stages


def testSubLayersWalksEveryDepth():
  inner = keras.layers.Dense(2, name='inner')
  block = keras.Sequential([inner], name='block')
  assert [layer.name for layer in stages.SubLayers(block)][:2] == [
      'block', 'inner']
  assert stages.SubLayers(inner) == [inner]


def testLayerVariablesSeparateMovingStatisticsFromState():
  bn = keras.layers.BatchNormalization(name='bn')
  keras.Sequential([keras.Input((3,)), bn])
  variables = stages.LayerVariables(bn)
  assert [v.name for v in variables.trainable] == ['gamma', 'beta']
  # A training batch norm's moving statistics go in theta, not in state.
  assert [v.name for v in variables.non_trainable] == ['moving_mean',
                                                       'moving_variance']
  assert variables.fixed == [True, True] and variables.State() == []
  assert variables.batch_norms == [bn] and variables.accepts_training


def testCheckLayersNamesTheLayerInsideItsOwner():
  block = keras.Sequential(
      [keras.layers.BatchNormalization(renorm=True, name='bn')], name='block')
  with pytest.raises(ValueError, match="'bn' .* inside 'block' .*has "
                     'renorm=True'):
    stages.CheckLayers([keras.layers.Dense(2), block])
  stages.CheckLayers([keras.layers.Dense(2), keras.layers.ReLU()])
