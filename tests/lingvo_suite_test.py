"""tools/lingvo_suite.py: Lingvo's own GPipe tests on our drop-ins.

Lingvo's test files are not in this repository and CI has no network, so
the harness is tested on a stand-in Lingvo tree whose "tests" check what the
harness promises (our classes where Lingvo's tests import theirs, absl
flags parsed, cases counted). Lingvo's real files run with
`make lingvo-suite LINGVO_SRC=...` (docs/from_lingvo.md).
"""

import os
import re
import subprocess

import pytest

from tools import lingvo_suite
import tool_util

# A stand-in for lingvo/core/gpipe_test.py: one case that passes on the
# drop-ins, one that always fails, one that passes only on Lingvo's classes.
_FAKE_GPIPE_TEST = '''
from absl import flags
from lingvo.core import layers_with_gpipe
from lingvo.core.gpipe import PipeliningLayer
import lingvo_gpipe


def testDropInsAreSwappedIn():
  assert flags.FLAGS.is_parsed()
  assert PipeliningLayer.__module__ == 'lingvo_gpipe.stacks'
  for name in ('GPipeTransformerStack', 'GPipeBatchMajorTransformerStack',
               'GPipeEvolvedTransformerStack'):
    assert getattr(layers_with_gpipe, name).__module__ == 'lingvo_gpipe.stacks'
  assert lingvo_gpipe.__file__.startswith({root!r})


def testFails():
  assert False


def testLingvosOwn():
  assert PipeliningLayer.__module__ == 'lingvo.core.gpipe'
'''


def _FakeLingvo(root, text=_FAKE_GPIPE_TEST):
  """A Lingvo tree with stand-in test files under root; returns root."""
  core = root / 'lingvo' / 'core'
  core.mkdir(parents=True, exist_ok=True)
  (core / 'gpipe_test.py').write_text(text.format(root=tool_util.ROOT))
  (core / 'layers_with_gpipe_test.py').write_text('def testNothing():\n  pass\n')
  return root


def _Git(*args, cwd):
  subprocess.run(['git', *args], cwd=cwd, check=True, capture_output=True,
                 env={**os.environ, 'GIT_AUTHOR_NAME': 't',
                      'GIT_AUTHOR_EMAIL': 't@t', 'GIT_COMMITTER_NAME': 't',
                      'GIT_COMMITTER_EMAIL': 't@t'})


def testReadsTheTestsFromATreeOrAGitCommit(tmp_path):
  tree = _FakeLingvo(tmp_path / 'tree')
  source = lingvo_suite.ResolveSource(str(tree), None)
  assert source == {'src': str(tree), 'git_dir': '', 'commit': ''}
  assert 'testFails' in lingvo_suite.ReadTest(source, 'gpipe_test')
  # A git checkout at an older commit: --lingvo_commit reads that one.
  _Git('init', '-q', cwd=tree)
  _Git('add', '.', cwd=tree)
  _Git('commit', '-qm', 'first', cwd=tree)
  (tree / 'lingvo/core/gpipe_test.py').write_text('changed')
  _Git('commit', '-qam', 'second', cwd=tree)
  source = lingvo_suite.ResolveSource(str(tree), 'HEAD~1')
  assert source['git_dir'] == str(tree / '.git')
  assert re.fullmatch('[0-9a-f]{40}', source['commit'])
  assert 'testFails' in lingvo_suite.ReadTest(source, 'gpipe_test')
  # The git directory itself (as a bare clone or a mirror is), at HEAD.
  source = lingvo_suite.ResolveSource(str(tree / '.git'), None)
  assert lingvo_suite.ReadTest(source, 'gpipe_test') == 'changed'


@pytest.mark.parametrize('src,commit,message', [
    (None, None, '--lingvo_src is not set (nor LINGVO_SRC): give a clone of '
                 'https://github.com/tensorflow/lingvo'),
    ('{tmp}', None, '--lingvo_src={tmp} has no lingvo/core/gpipe_test.py'),
    ('{tmp}', 'abc', '--lingvo_commit=abc needs a git --lingvo_src'),
    ('{git}', 'no_such_rev', '--lingvo_commit=no_such_rev is not a commit'),
])
def testBadSourcesSayWhatToGive(tmp_path, monkeypatch, src, commit, message):
  monkeypatch.delenv('LINGVO_SRC', raising=False)
  monkeypatch.delenv('LINGVO_COMMIT', raising=False)
  git = tmp_path / 'git'
  _FakeLingvo(git)
  _Git('init', '-q', cwd=git)
  paths = {'tmp': str(tmp_path), 'git': str(git)}
  message = message.format(**paths)
  with pytest.raises(lingvo_suite.SuiteError, match=re.escape(message)):
    lingvo_suite.ResolveSource(src and src.format(**paths), commit)


@pytest.mark.slow
def testRunsTheFilesOnTheDropInsAndCounts(tmp_path):
  """The stand-in cases see our classes (or Lingvo's with --reference)."""
  tree = _FakeLingvo(tmp_path / 'lingvo_src')
  runs = tool_util.RunToolInParallel('lingvo_suite.py', {
      'ours': ['run', f'--lingvo_src={tree}', '--json_out={tmp}/ours.json'],
      'reference': ['run', f'--lingvo_src={tree}', '--reference',
                    '--tests=gpipe_test', '--select=Lingvos'],
  }, str(tmp_path), timeout=600, env_changes={'TF_ENABLE_ONEDNN_OPTS': None})
  code, stdout, stderr = runs['ours']
  assert code == 1, stderr[-3000:]
  lines = stdout.splitlines()
  assert re.fullmatch(r'gpipe_test: 1 passed of 3 \(drop-ins, lingvo tree '
                      r'\S+, \d+ s\)', lines[0]), stdout
  assert sorted(lines[1:3]) == ['  FAILED testFails',
                                '  FAILED testLingvosOwn']
  assert lines[3].startswith('layers_with_gpipe_test: 1 passed of 1')
  assert lines[-1] == '2 case(s) failed.'
  assert (tmp_path / 'ours.json').exists()
  code, stdout, stderr = runs['reference']
  assert code == 0, stdout + stderr[-3000:]
  assert stdout.startswith('gpipe_test: 1 passed of 1 (reference: Lingvo, ')
