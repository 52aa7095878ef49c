r"""Converts a checkpoint between Lingvo's GPipe variable names and ours.

Lingvo's PipeliningLayer and its stacks name a layer's variables after the
cell (device) that holds it, `<parent>/cell_<k>/<layer>/...`; the same model
on lingvo_gpipe.stacks names them `<parent>/<stack name>/<layer>/...` for any
split. Given the model (a registered model built with lingvo_gpipe.stacks),
this tool writes a copy of a checkpoint with the other names:

  # A Lingvo checkpoint, to continue training on lingvo_gpipe:
  python tools/convert_checkpoint.py --model=mt.ReverseTransformer \
      --to=ours --input=/lingvo_run/train --output=/ours/train/ckpt-00010000
  # And back, for Lingvo's own stack with the split of the model's params:
  python tools/convert_checkpoint.py --model=mt.ReverseTransformer \
      --to=lingvo --input=/ours/train --output=/lingvo_run2/train/ckpt-00010000

--to=ours reads which cell held each layer from the checkpoint, so any split
converts; --to=lingvo writes the split of the model's params (change it with
--model_params_override='task.stack.splits: [2, 4]'). Optimizer slots move
with their variables; global_step and other layers' variables are copied
as they are. The tool refuses, naming them, variables inside a pipeline
that no layer of the model explains and model variables the checkpoint
lacks, and never writes over an existing checkpoint or its input. The output
directory's `checkpoint` file is pointed at the output, so that Lingvo's
trainer (tools/train.py --logdir=<dir above train/>) restores from it.

Runs from any directory; tools/__init__.py says how it finds the repository.

Its one line of output:

  converted <input> -> <output> (to=<ours|lingvo>): <n> variables renamed, \
<m> unchanged
"""

import os
import sys

if __name__ == '__main__':  # Run as a script: see tools/__init__.py.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
from absl import logging
from lingvo import compat as tf
from lingvo import model_registry

from lingvo_gpipe import checkpoints
import params  # pylint: disable=unused-import  # Registers the models.
from tools import cli
# pylint: enable=g-import-not-at-top,wrong-import-position

flags.DEFINE_string(
    'model', None, 'Registered model whose pipelines are lingvo_gpipe.stacks '
    "layers (e.g. mt.ReverseTransformer); Lingvo's --model_params_override "
    'applies.')
flags.DEFINE_enum(
    'to', None, list(checkpoints.DIRECTIONS), "Naming to write: 'ours' "
    "(the input has Lingvo's cell_<k> names) or 'lingvo'.")
flags.DEFINE_string(
    'input', None, 'Checkpoint to read: a prefix (.../ckpt-00001000) or a '
    'directory, whose latest checkpoint is read.')
flags.DEFINE_string(
    'output', None, 'Prefix of the checkpoint to write; must not exist.')

FLAGS = flags.FLAGS
PROG = 'convert_checkpoint.py'


def _InputPrefix(path):
  """`path` if it is a checkpoint prefix, else the latest one in it."""
  if tf.io.gfile.isdir(path):
    latest = tf.train.latest_checkpoint(path)
    if latest is None:
      cli.Fail(PROG, f'--input={path!r} is a directory without a checkpoint.')
    return latest
  if not tf.io.gfile.exists(path + '.index'):
    cli.Fail(PROG, f'--input={path!r} is neither a checkpoint prefix (no '
             f'{os.path.basename(path)}.index) nor a directory.')
  return path


def main(argv):
  if len(argv) > 1:
    cli.Fail(PROG, f'unexpected arguments {argv[1:]}; every setting is a flag.')
  for name in ('model', 'to', 'input', 'output'):
    if not FLAGS[name].value:
      cli.Fail(PROG, f'--{name} is required; see --help.')
  logging.set_verbosity(logging.WARNING)  # Not Lingvo's params dumps.
  cli.CheckRegisteredModel(PROG, FLAGS.model)
  input_prefix = _InputPrefix(FLAGS.input)
  with tf.Graph().as_default():  # The model's variables are only named.
    model = model_registry.GetParams(FLAGS.model, 'Train').Instantiate()
  try:
    renames = checkpoints.ConvertCheckpoint(model, input_prefix, FLAGS.output,
                                            to=FLAGS.to)
  except ValueError as e:
    cli.Fail(PROG, e)
  moved = sum(old != new for old, new in renames.items())
  print(f'converted {input_prefix} -> {FLAGS.output} (to={FLAGS.to}): '
        f'{moved} variables renamed, {len(renames) - moved} unchanged')


if __name__ == '__main__':
  app.run(main, flags_parser=cli.FlagsParser(PROG))
