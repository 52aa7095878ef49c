"""The Keras code of README.md and docs/keras.md runs as written.

Each runs in a fresh interpreter: docs/keras.md creates logical devices,
which TensorFlow allows only before it starts.
"""

import os
import re
import subprocess
import sys

import pytest

import tool_util

# Subprocesses that import TensorFlow and train for a few steps.
pytestmark = pytest.mark.slow


def _PythonBlocks(document, section=None):
  """The ```python blocks of `document` (under `section` if given)."""
  with open(os.path.join(tool_util.ROOT, document)) as f:
    text = f.read()
  if section is not None:
    text = text.split(f'\n## {section}\n', 1)[1].split('\n## ', 1)[0]
  return re.findall(r'```python\n(.*?)```', text, re.S)


def _Run(source, tmp_path):
  """Runs `source` as a script from a scratch folder; returns its stdout."""
  script = tmp_path / 'example.py'
  script.write_text(source)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  env['PYTHONPATH'] = os.pathsep.join(
      [tool_util.ROOT] + [p for p in [env.get('PYTHONPATH')] if p])
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def testKerasGuideRunsInOrder(tmp_path):
  blocks = _PythonBlocks('docs/keras.md')
  assert len(blocks) >= 2
  stdout = _Run('\n'.join(blocks), tmp_path)
  assert ("['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', "
          "'/device:CPU:3'] [6, 6, 6, 6]") in stdout


def testReadmeKerasExampleRuns(tmp_path):
  (block,) = _PythonBlocks('README.md', 'Keras')
  assert 'GPipeSequential' in block
  _Run(block, tmp_path)
