r"""Runs Lingvo's own GPipe tests on lingvo_gpipe's drop-in classes.

Lingvo's `lingvo/core/gpipe_test.py` and `lingvo/core/layers_with_gpipe_test.py`
import `PipeliningLayer` and the GPipe Transformer stacks from Lingvo; this
tool runs them, unchanged, with those names bound to `lingvo_gpipe.stacks`
(`tools/lingvo_suite_plugin.py`), under pytest, one process per file.

The test files are not part of this repository: the tool reads them at run
time from a Lingvo source tree or git directory that you give it, e.g. a
clone of https://github.com/tensorflow/lingvo:

  git clone https://github.com/tensorflow/lingvo /tmp/lingvo
  python tools/lingvo_suite.py run --lingvo_src=/tmp/lingvo \
      [--lingvo_commit=REV] [--tests=gpipe_test] [--select=EXPR] [--reference]

or `make lingvo-suite LINGVO_SRC=/tmp/lingvo`. `--lingvo_src` (default: the
LINGVO_SRC environment variable) is a checkout (its working tree is read) or
a git directory, bare or not (with `--lingvo_commit`, default HEAD, or
LINGVO_COMMIT, the files are read from that commit). `--reference` runs the
same files on Lingvo's own classes, for comparison. It prints one line per
file, e.g.

  gpipe_test: 8 passed of 8 (drop-ins, lingvo 18571ef8211b..., 41 s)

and the failing cases by name; exit status 0 when every case passed, 1 if
any failed, 2 for a bad flag or an unreadable source.

Runs from any directory; tools/__init__.py says how it finds the repository.
The test processes get the repository root on PYTHONPATH (so they import
this checkout's lingvo_gpipe) and TF_ENABLE_ONEDNN_OPTS=0 unless the
environment sets it (oneDNN breaks some Lingvo layers inside while loops,
which Lingvo's own pipeline has; the summary lines say when it is on).
"""

import os
import sys

if __name__ == '__main__':  # Run as a script: see tools/__init__.py.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import subprocess
import tempfile
import time
from typing import Any, Dict, Optional, Sequence
from xml.etree import ElementTree

from absl import flags

from tools import cli
# pylint: enable=g-import-not-at-top,wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lingvo's test files this tool knows, by name (path in Lingvo's repository).
TESTS = {
    'gpipe_test': 'lingvo/core/gpipe_test.py',
    'layers_with_gpipe_test': 'lingvo/core/layers_with_gpipe_test.py',
}

flags.DEFINE_string(
    'lingvo_src', None, "A Lingvo source tree (its working tree is read) or "
    "git directory (files are read from --lingvo_commit) holding Lingvo's "
    'tests. Default: $LINGVO_SRC.')
flags.DEFINE_string(
    'lingvo_commit', None, 'With a git --lingvo_src: the commit to read the '
    'tests from. Default: $LINGVO_COMMIT, else HEAD.')
flags.DEFINE_list('tests', list(TESTS), f'Which files to run, of {list(TESTS)}.')
flags.DEFINE_string('select', None, "Only the cases matching this pytest -k "
                    'expression.')
flags.DEFINE_bool(
    'reference', False, "Run the tests on Lingvo's own classes instead of the "
    'drop-ins (for comparison).')
flags.DEFINE_integer('timeout', 1800, 'Seconds one file may take.',
                     lower_bound=1)


class SuiteError(Exception):
  """A flag or source that cannot work; printed on one line."""


def _IsGitDir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, 'HEAD')) and os.path.isdir(
      os.path.join(path, 'objects'))


def ResolveSource(src: Optional[str], commit: Optional[str]) -> Dict[str, str]:
  """Where the test files are read from.

  Args:
    src: A Lingvo source tree or git directory, or None for $LINGVO_SRC.
    commit: A commit of a git `src`, or None for $LINGVO_COMMIT or HEAD.

  Returns:
    {'src': path, 'git_dir': path or '', 'commit': full hash or ''}.

  Raises:
    SuiteError: if no source is given or it is neither a tree with Lingvo's
      tests nor a git directory with the commit.
  """
  src = src or os.environ.get('LINGVO_SRC')
  commit = commit or os.environ.get('LINGVO_COMMIT') or None
  if not src:
    raise SuiteError(
        "--lingvo_src is not set (nor LINGVO_SRC): give a clone of "
        'https://github.com/tensorflow/lingvo or its git directory, e.g. '
        '--lingvo_src=/tmp/lingvo after git clone '
        'https://github.com/tensorflow/lingvo /tmp/lingvo.')
  src = os.path.abspath(src)
  git_dir = ''
  if _IsGitDir(src):
    git_dir = src
  elif commit and _IsGitDir(os.path.join(src, '.git')):
    git_dir = os.path.join(src, '.git')
  if not git_dir:
    if commit:
      raise SuiteError(f'--lingvo_commit={commit} needs a git --lingvo_src; '
                       f'{src} is not a git directory or a checkout with .git.')
    missing = [p for p in TESTS.values()
               if not os.path.isfile(os.path.join(src, p))]
    if missing:
      raise SuiteError(f'--lingvo_src={src} has no {missing[0]}; give the '
                       'root of a Lingvo checkout or its git directory.')
    return {'src': src, 'git_dir': '', 'commit': ''}
  rev = commit or 'HEAD'
  result = subprocess.run(
      ['git', '--git-dir', git_dir, 'rev-parse', '--verify', '--quiet',
       rev + '^{commit}'], capture_output=True, text=True, check=False)
  if result.returncode:
    raise SuiteError(f'--lingvo_commit={rev} is not a commit of {git_dir}.')
  return {'src': src, 'git_dir': git_dir, 'commit': result.stdout.strip()}


def ReadTest(source: Dict[str, str], name: str) -> str:
  """The text of Lingvo's test file `name` (a key of TESTS) from `source`."""
  path = TESTS[name]
  if not source['git_dir']:
    with open(os.path.join(source['src'], path)) as f:
      return f.read()
  result = subprocess.run(
      ['git', '--git-dir', source['git_dir'], 'show',
       f'{source["commit"]}:{path}'], capture_output=True, text=True,
      check=False)
  if result.returncode:
    raise SuiteError(f'{source["git_dir"]} has no {path} at '
                     f'{source["commit"]}: {result.stderr.strip()}')
  return result.stdout


def _Counts(junit_xml: str) -> Dict[str, Any]:
  """Passed/failed/skipped case names from a pytest JUnit XML report."""
  cases = ElementTree.parse(junit_xml).getroot().iter('testcase')
  counts = {'passed': [], 'failed': [], 'skipped': []}
  for case in cases:
    name = case.get('name')
    if case.find('failure') is not None or case.find('error') is not None:
      counts['failed'].append(name)
    elif case.find('skipped') is not None:
      counts['skipped'].append(name)
    else:
      counts['passed'].append(name)
  return counts


def RunFile(name: str, text: str, workdir: str, reference: bool,
            select: Optional[str], timeout: int) -> Dict[str, Any]:
  """Runs one Lingvo test file under pytest; returns its case names by result.

  Args:
    name: The file's key in TESTS.
    text: Its contents.
    workdir: A scratch directory (the file, a pytest.ini and the report go
      there; it is pytest's rootdir, so no conftest of ours is read).
    reference: If True, on Lingvo's classes; else on the drop-ins.
    select: A pytest -k expression, or None.
    timeout: Seconds the run may take.

  Returns:
    {'passed': [...], 'failed': [...], 'skipped': [...], 'seconds': s,
    'log': path of pytest's output}.

  Raises:
    SuiteError: if pytest collected nothing or crashed without a report.
  """
  with open(os.path.join(workdir, f'{name}.py'), 'w') as f:
    f.write(text)
  with open(os.path.join(workdir, 'pytest.ini'), 'w') as f:
    f.write('[pytest]\npython_files = *_test.py\n')
  report = os.path.join(workdir, f'{name}.xml')
  log = os.path.join(workdir, f'{name}.log')
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      [ROOT] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  env.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  env['LINGVO_SUITE_REFERENCE'] = '1' if reference else '0'
  command = [sys.executable, '-m', 'pytest', '-p', 'tools.lingvo_suite_plugin',
             '-q', '-rf', '--rootdir', workdir, '-c',
             os.path.join(workdir, 'pytest.ini'), '-p', 'no:cacheprovider',
             f'--junitxml={report}', f'{name}.py']
  if select:
    command += ['-k', select]
  start = time.time()
  with open(log, 'w') as out:
    try:
      subprocess.run(command, cwd=workdir, env=env, stdout=out,
                     stderr=subprocess.STDOUT, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
      raise SuiteError(f'{name} took more than --timeout={timeout} s; its '
                       f'output is in {log}.') from e
  if not os.path.exists(report):
    raise SuiteError(f'{name}: pytest wrote no report; its output is in {log}.')
  counts = _Counts(report)
  if not any(counts.values()):
    raise SuiteError(f'{name}: no test case ran (--select={select!r}?); '
                     f'pytest output in {log}.')
  counts['seconds'] = round(time.time() - start, 1)
  counts['log'] = log
  return counts


def Run(argv: Sequence[str]) -> Dict[str, Any]:
  """`run`: every file of --tests, one pytest process each."""
  if argv:
    raise SuiteError(f'unexpected arguments {list(argv)}; cases are chosen '
                     'with --tests and --select.')
  f = flags.FLAGS
  unknown = [t for t in f.tests if t not in TESTS]
  if unknown or not f.tests:
    raise SuiteError(f'--tests={",".join(f.tests)}: give some of '
                     f'{",".join(TESTS)}.')
  source = ResolveSource(f.lingvo_src, f.lingvo_commit)
  texts = {name: ReadTest(source, name) for name in f.tests}
  kind = 'reference: Lingvo' if f.reference else 'drop-ins'
  onednn = os.environ.get('TF_ENABLE_ONEDNN_OPTS', '0')
  if onednn != '0':
    kind += f', TF_ENABLE_ONEDNN_OPTS={onednn}'
  origin = (f'lingvo {source["commit"][:12]}' if source['commit'] else
            f'lingvo tree {source["src"]}')
  workdir = tempfile.mkdtemp(prefix='lingvo_suite_')
  results = {}
  for name in f.tests:
    counts = RunFile(name, texts[name], workdir, f.reference, f.select,
                     f.timeout)
    results[name] = counts
    total = sum(len(counts[k]) for k in ('passed', 'failed', 'skipped'))
    print(f'{name}: {len(counts["passed"])} passed of {total} ({kind}, '
          f'{origin}, {counts["seconds"]:.0f} s)')
    for case in counts['failed']:
      print(f'  FAILED {case}')
    for case in counts['skipped']:
      print(f'  skipped {case}')
    sys.stdout.flush()
  failed = sum(len(c['failed']) for c in results.values())
  print(f'pytest output: {workdir}')
  numbers = {'source': source, 'reference': f.reference,
             'tf_enable_onednn_opts': onednn, 'results': results}
  if failed:
    _WriteJson(numbers)
    print(f'{failed} case(s) failed.')
    sys.exit(1)
  return numbers


def _WriteJson(numbers: Dict[str, Any]) -> None:
  """Writes --json_out before an exit that skips cli.Run's own writing."""
  if flags.FLAGS.json_out:
    import json  # pylint: disable=g-import-not-at-top
    with open(flags.FLAGS.json_out, 'w') as f:
      json.dump(numbers, f, indent=2)


SUBCOMMANDS = {'run': Run}

if __name__ == '__main__':
  cli.Run('lingvo_suite.py', SUBCOMMANDS, (SuiteError,),
          'lingvo_suite.py run --lingvo_src=/tmp/lingvo')
