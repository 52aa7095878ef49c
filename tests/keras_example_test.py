"""tools/keras_example.py trains a Keras model with model.fit, as documented."""

import json
import re

import pytest

import tool_util

# Starts the tool in subprocesses (TensorFlow import and a short fit each).
pytestmark = pytest.mark.slow

RUNS = {
    # The documented command at a small size: 2 stages, 4 micro-batches.
    'small': [
        'train', '--num_devices=2', '--num_micro_batches=4',
        '--num_blocks=2', '--dim=16', '--samples=512', '--batch_size=64',
        '--epochs=2', '--save_to={tmp}/pipe.keras',
        '--json_out={tmp}/numbers.json'
    ],
    # The command of README.md and docs/keras.md, exactly.
    'documented': ['train'],
    'bad_batch': ['train', '--batch_size=60'],
    'bad_save': ['train', '--save_to={tmp}/pipe.h5'],
}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  return tool_util.RunToolInParallel(
      'keras_example.py', RUNS, str(tmp_path_factory.mktemp('keras_example')),
      timeout=600)


def testTrainsOnTwoDevicesAndReloads(runs):
  code, stdout, stderr = runs['small']
  assert code == 0, stderr
  lines = stdout.strip().splitlines()
  trained = [line for line in lines if line.startswith('trained:')]
  assert len(trained) == 1, stdout
  assert re.fullmatch(
      r"trained: K=2 M=4 devices \['/device:CPU:0', '/device:CPU:1'\] "
      r'partition \[3, 3\]: loss [\d.]+ -> [\d.]+, accuracy [\d.]+ '
      r'\(chance 0\.10\)', trained[0]), trained[0]
  with open(f'{runs["tmp"]}/numbers.json') as f:
    numbers = json.load(f)
  assert numbers['stage_devices'] == ['/device:CPU:0', '/device:CPU:1']
  assert numbers['partition'] == [3, 3]
  assert len(numbers['loss']) == 2
  assert numbers['loss'][1] < numbers['loss'][0]
  assert numbers['reload_max_difference'] == 0.0
  assert re.search(r'reloaded: .*pipe\.keras, max difference 0\n', stdout)


def testDocumentedCommandLearns(runs):
  code, stdout, stderr = runs['documented']
  assert code == 0, stderr
  match = re.search(
      r"trained: K=4 M=8 devices \['/device:CPU:0', '/device:CPU:1', "
      r"'/device:CPU:2', '/device:CPU:3'\] partition \[6, 6, 6, 6\]: "
      r'loss ([\d.]+) -> ([\d.]+), accuracy ([\d.]+)', stdout)
  assert match, stdout
  first, last, accuracy = (float(g) for g in match.groups())
  assert last < first
  assert accuracy > 0.2  # Chance is 0.1.


@pytest.mark.parametrize('name,message', [
    ('bad_batch', '--num_micro_batches=8 must divide --batch_size=60.'),
    ('bad_save', r"--save_to='.*pipe\.h5' must end in \.keras\."),
])
def testBadFlagsFailOnOneLine(runs, name, message):
  code, stdout, stderr = runs[name]
  assert code == 2
  assert not stdout
  last = stderr.strip().splitlines()[-1]
  assert re.fullmatch(f'keras_example.py: error: train: {message}', last), last
