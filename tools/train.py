r"""Trains a small GPipe model on K local CPU devices (what `make train` runs).

A stack of Lingvo FC cells learns a fixed random teacher network on
synthetic data, pipelined over --num_devices stages and --num_micro_batches
micro-batches, in Lingvo's TF1 graph mode. It prints progress and ends with

  trained <model>: steps=<n> loss <first> -> <last>, <x> examples/s, \
checkpoint <path>

Usage:
  python tools/train.py --num_devices=4 --max_steps=200 --logdir=/tmp/gpipe
"""

import os
import time

from absl import app
from absl import flags
import numpy as np

flags.DEFINE_integer('num_devices', 4, 'K: local CPU devices = pipeline '
                     'stages.', lower_bound=1)
flags.DEFINE_integer('num_micro_batches', 8, 'M: micro-batches per step.',
                     lower_bound=1)
flags.DEFINE_integer('num_layers', 8, 'FC cells in the pipeline.',
                     lower_bound=1)
flags.DEFINE_integer('dim', 64, 'Width of every cell.', lower_bound=1)
flags.DEFINE_integer('batch_size', 64, 'Examples per step.', lower_bound=1)
flags.DEFINE_integer('max_steps', 200, 'Training steps.', lower_bound=1)
flags.DEFINE_float('learning_rate', 0.3, 'SGD learning rate.')
flags.DEFINE_enum('remat', 'always', ['always', 'except_last', 'never'],
                  'Re-materialization mode.')
flags.DEFINE_string('logdir', '/tmp/lingvo_gpipe_train', 'Checkpoint folder.')
flags.DEFINE_integer('log_every', 20, 'Print progress every this many steps.',
                     lower_bound=1)

FLAGS = flags.FLAGS
MODEL_NAME = 'synthetic_fc_regression'


def _BuildModel():
  """Builds the pipelined model, its loss and its train op in the graph.

  Returns:
    (loss, train_op, x, y): tensors and placeholders.
  """
  # Imported here so that --help does not start TensorFlow.
  from lingvo import compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import layers  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe import GPipeSequentialLayer  # pylint: disable=g-import-not-at-top

  global_step = py_utils.GetOrCreateGlobalStepVar()
  cells = [
      layers.FCLayer.Params().Set(
          name=f'fc{i}', input_dim=FLAGS.dim, output_dim=FLAGS.dim,
          activation='TANH') for i in range(FLAGS.num_layers)
  ]
  p = GPipeSequentialLayer.Params().Set(
      name='pipe',
      cell_tpl=cells,
      num_stages=FLAGS.num_devices,
      num_micro_batches=FLAGS.num_micro_batches,
      remat=FLAGS.remat,
      devices=[f'/device:CPU:{k}' for k in range(FLAGS.num_devices)])
  pipe = p.Instantiate()
  x = tf.compat.v1.placeholder(tf.float32, [FLAGS.batch_size, FLAGS.dim])
  y = tf.compat.v1.placeholder(tf.float32, [FLAGS.batch_size, FLAGS.dim])
  loss = tf.reduce_mean(tf.square(pipe.FProp(pipe.theta, x) - y))
  variables = pipe.vars.Flatten()
  grads = tf.compat.v1.gradients(loss, variables)
  updates = [v.assign_sub(FLAGS.learning_rate * g)
             for v, g in zip(variables, grads)]
  with tf.control_dependencies(updates):
    train_op = global_step.assign_add(1)
  return loss, train_op, x, y


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if FLAGS.batch_size % FLAGS.num_micro_batches:
    raise app.UsageError(
        f'--num_micro_batches={FLAGS.num_micro_batches} must divide '
        f'--batch_size={FLAGS.batch_size}.')
  if FLAGS.num_devices > FLAGS.num_layers:
    raise app.UsageError(f'--num_devices={FLAGS.num_devices} must be at most '
                         f'--num_layers={FLAGS.num_layers}.')
  from lingvo import compat as tf  # pylint: disable=g-import-not-at-top

  rng = np.random.RandomState(0)
  teacher = [rng.randn(FLAGS.dim, FLAGS.dim) / np.sqrt(FLAGS.dim)
             for _ in range(2)]

  def Batch():
    x = rng.randn(FLAGS.batch_size, FLAGS.dim).astype(np.float32)
    return x, np.tanh(np.tanh(x @ teacher[0]) @ teacher[1]).astype(np.float32)

  with tf.Graph().as_default():
    loss, train_op, x, y = _BuildModel()
    saver = tf.compat.v1.train.Saver()
    config = tf.compat.v1.ConfigProto(
        device_count={'CPU': FLAGS.num_devices})
    os.makedirs(FLAGS.logdir, exist_ok=True)
    with tf.compat.v1.Session(config=config) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      losses, start = [], time.time()
      for step in range(1, FLAGS.max_steps + 1):
        xs, ys = Batch()
        value, _ = sess.run([loss, train_op], {x: xs, y: ys})
        losses.append(value)
        if step % FLAGS.log_every == 0 or step == FLAGS.max_steps:
          rate = step * FLAGS.batch_size / (time.time() - start)
          print(f'step {step:5d}  loss {value:.5f}  {rate:8.1f} examples/s',
                flush=True)
      rate = FLAGS.max_steps * FLAGS.batch_size / (time.time() - start)
      path = saver.save(sess, os.path.join(FLAGS.logdir, 'ckpt'),
                        global_step=FLAGS.max_steps)
  print(f'trained {MODEL_NAME}: steps={FLAGS.max_steps} loss {losses[0]:.4f} '
        f'-> {losses[-1]:.4f}, {rate:.1f} examples/s, checkpoint {path}')


if __name__ == '__main__':
  app.run(main)
