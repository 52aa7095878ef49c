"""Tests of engine.watched: which inputs a gradient can be asked for."""

import tensorflow as tf

from lingvo_gpipe.engine import watched


def testInAGraphTheInputsAVariableOrPlaceholderFeeds():
  with tf.Graph().as_default():
    fed = tf.compat.v1.placeholder(tf.float32, [2])
    w = tf.compat.v1.get_variable('w', [2])
    inputs = [
        fed * 2.0,  # A placeholder feeds it.
        tf.tanh(w),  # A variable does.
        tf.constant([1.0, 2.0]),  # Constants only.
        tf.stop_gradient(fed),  # No gradient passes.
        tf.cast(fed, tf.int32),  # Not floating point.
        None,
    ]
    assert watched.WatchedInputs(inputs) == [True, True, False, False, False,
                                             False]


def testEagerlyTheInputsTheTapeWatches():
  x, y = tf.constant([1.0]), tf.constant([2.0])
  assert watched.WatchedInputs([x, y]) == [False, False]  # No tape.
  with tf.GradientTape() as tape:
    tape.watch(x)
    assert watched.WatchedInputs([x, y, x * y, None]) == [True, False, True,
                                                          False]
