r"""Trains a Keras model whose body is a GPipe pipeline on K local devices.

The model is ordinary Keras 3: `keras.Sequential([Input, GPipeSequential(
[Dense, BatchNormalization, Dropout] * L), Dense])`, compiled and trained with
`model.fit` on a synthetic 10-class problem (labels from a fixed random
teacher, so there is something to learn). The pipeline splits the
body into --num_devices stages, one per local device: the GPUs if there are
that many, else that many logical CPU devices carved out of the host CPU.

  python tools/keras_example.py train
  python tools/keras_example.py train --num_devices=2 --num_micro_batches=4 \
      --jit_compile --save_to=/tmp/pipe.keras

The last line is

  trained: K=<k> M=<m> devices <list> partition <list>: loss <first> -> \
<last>, accuracy <a> (chance 0.10)

With --save_to the model is saved, loaded back with keras.models.load_model
and its predictions compared ('reloaded: ... max difference <d>').

Runs from any directory; tools/__init__.py says how it finds the repository.
"""

import os
import sys

if __name__ == '__main__':  # Run as a script: see tools/__init__.py.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

# pylint: disable=g-import-not-at-top,wrong-import-position
from typing import List, Sequence

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from tools import cli
# pylint: enable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS

flags.DEFINE_integer('num_devices', 4, 'K: pipeline stages, one per local '
                     'device (GPUs if there are K, else K logical CPUs).',
                     lower_bound=1)
flags.DEFINE_integer('num_micro_batches', 8, 'M: micro-batches per batch; '
                     'must divide --batch_size.', lower_bound=1)
flags.DEFINE_integer('num_blocks', 8, 'Blocks of [Dense(relu), '
                     'BatchNormalization, Dropout] in the pipelined body; at '
                     'least --num_devices.', lower_bound=1)
flags.DEFINE_integer('dim', 128, 'Width of every hidden Dense layer.',
                     lower_bound=1)
flags.DEFINE_integer('samples', 8192, 'Training examples; a multiple of '
                     '--batch_size (every batch must split into M).',
                     lower_bound=1)
flags.DEFINE_integer('batch_size', 256, 'Mini-batch size of model.fit.',
                     lower_bound=1)
flags.DEFINE_integer('epochs', 3, 'Epochs of model.fit.', lower_bound=1)
flags.DEFINE_float('dropout', 0.1, 'Dropout rate after every block.',
                   lower_bound=0.0, upper_bound=0.99)
flags.DEFINE_enum('remat', 'always', ['always', 'except_last', 'never'],
                  'Re-materialization of GPipeSequential.')
flags.DEFINE_bool('jit_compile', False, 'Compile the train step with XLA '
                  '(model.compile(jit_compile=True)).')
flags.DEFINE_string('save_to', None, 'Optional .keras path: save the trained '
                    'model, load it back and compare predictions.')

NUM_CLASSES = 10
INPUT_DIM = 32


class ExampleError(ValueError):
  """A bad flag combination; printed on one line."""


def LocalDevices(num_devices: int) -> List[str]:
  """K local devices: the GPUs if there are K, else K logical CPU devices.

  Must run before TensorFlow initializes its devices.
  """
  gpus = tf.config.list_physical_devices('GPU')
  if len(gpus) >= num_devices:
    return [d.name for d in tf.config.list_logical_devices('GPU')[:num_devices]]
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
  return [d.name for d in tf.config.list_logical_devices('CPU')]


def Data(samples: int, seed: int = 0):
  """(x, labels): Gaussian inputs, labels of a fixed random linear teacher."""
  rng = np.random.RandomState(seed)
  x = rng.randn(samples, INPUT_DIM).astype(np.float32)
  teacher = rng.randn(INPUT_DIM, NUM_CLASSES).astype(np.float32)
  labels = np.argmax(x @ teacher, axis=1)
  return x, labels.astype(np.int32)


def BuildModel(num_stages: int):
  """The Keras model: Input -> GPipeSequential(blocks) -> Dense(10).

  Keras is imported here, once `LocalDevices` has configured the devices.
  """
  # pylint: disable=g-import-not-at-top
  import keras
  from lingvo_gpipe.keras import GPipeSequential
  # pylint: enable=g-import-not-at-top
  body = []
  for i in range(FLAGS.num_blocks):
    body += [
        keras.layers.Dense(FLAGS.dim, activation='relu', name=f'dense{i}'),
        keras.layers.BatchNormalization(name=f'bn{i}'),
        keras.layers.Dropout(FLAGS.dropout, seed=i, name=f'dropout{i}'),
    ]
  pipe = GPipeSequential(body, num_stages=num_stages,
                         num_micro_batches=FLAGS.num_micro_batches,
                         remat=FLAGS.remat, name='body')
  model = keras.Sequential([
      keras.Input((INPUT_DIM,)),
      pipe,
      keras.layers.Dense(NUM_CLASSES, name='logits'),
  ], name='classifier')
  model.compile(
      optimizer=keras.optimizers.Adam(3e-3),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=['accuracy'], jit_compile=FLAGS.jit_compile)
  return model, pipe


def CheckFlags() -> None:
  if FLAGS.num_blocks * 3 < FLAGS.num_devices:
    raise ExampleError(f'--num_devices={FLAGS.num_devices} needs at least '
                       f'{FLAGS.num_devices} layers; --num_blocks='
                       f'{FLAGS.num_blocks} makes {FLAGS.num_blocks * 3}.')
  if FLAGS.batch_size % FLAGS.num_micro_batches:
    raise ExampleError(f'--num_micro_batches={FLAGS.num_micro_batches} must '
                       f'divide --batch_size={FLAGS.batch_size}.')
  if FLAGS.samples % FLAGS.batch_size:
    raise ExampleError(f'--samples={FLAGS.samples} must be a multiple of '
                       f'--batch_size={FLAGS.batch_size}, so that every batch '
                       'splits into M micro-batches.')
  if FLAGS.save_to is not None and not FLAGS.save_to.endswith('.keras'):
    raise ExampleError(f'--save_to={FLAGS.save_to!r} must end in .keras.')


def Train(args: Sequence[str]):
  """Trains the model and prints the result; returns the numbers."""
  if args:
    raise ExampleError(f'keras_example.py takes no positional arguments, got '
                       f'{list(args)}.')
  CheckFlags()
  devices = LocalDevices(FLAGS.num_devices)
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  x, labels = Data(FLAGS.samples)
  model, pipe = BuildModel(FLAGS.num_devices)
  history = model.fit(x, labels, batch_size=FLAGS.batch_size,
                      epochs=FLAGS.epochs, verbose=2).history
  loss = history['loss']
  accuracy = float(history['accuracy'][-1])
  stage_devices = pipe.StageDevices()
  print(f'trained: K={pipe.num_stages} M={pipe.num_micro_batches} devices '
        f'{stage_devices} partition {pipe.partition}: loss {loss[0]:.4f} -> '
        f'{loss[-1]:.4f}, accuracy {accuracy:.3f} (chance '
        f'{1 / NUM_CLASSES:.2f})')
  numbers = {'num_stages': pipe.num_stages,
             'num_micro_batches': pipe.num_micro_batches,
             'local_devices': devices, 'stage_devices': stage_devices,
             'partition': pipe.partition, 'loss': [float(v) for v in loss],
             'accuracy': accuracy}
  if FLAGS.save_to:
    model.save(FLAGS.save_to)
    loaded = keras.models.load_model(FLAGS.save_to)
    difference = float(np.max(np.abs(
        loaded.predict(x[:FLAGS.batch_size], verbose=0) -
        model.predict(x[:FLAGS.batch_size], verbose=0))))
    print(f'reloaded: {FLAGS.save_to}, max difference {difference:.3g}')
    numbers['reload_max_difference'] = difference
  return numbers


if __name__ == '__main__':
  cli.Run('keras_example.py', {'train': Train}, (ExampleError,),
          'keras_example.py train --num_devices=4')
