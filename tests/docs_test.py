"""The commands and examples README.md and docs/ show run as written.

Every `python tools/plan.py partition|simulate|timeline ...` line of the
documentation's shell blocks runs here; the timelines, which train a real
step, at a small size (their size flags shrunk, everything else as written).
Placeholders such as `--num_stages=K` are left to the tests that run those
commands with values. The `>>>` examples of docs/schedules.md run as
doctests. (`plan.py auto` is run by plan_test.py, the benchmarks by
benchmark_test.py, training by train_test.py.)
"""

import doctest
import glob
import os
import re
import shlex

import pytest

import tool_util

# Documentation files whose commands must run.
_DOCS = ['README.md'] + sorted(
    os.path.relpath(p, tool_util.ROOT)
    for p in glob.glob(os.path.join(tool_util.ROOT, 'docs', '*.md')))
_SUBCOMMANDS = ('partition', 'simulate', 'timeline')
# Small sizes for a traced step: what a timeline trains does not matter here.
_SMALL = {'--fc_dim': '8', '--micro_batch_size': '1', '--cells_per_stage': '1',
          '--warmup_steps': '0'}


def _ShellLines(path):
  """The commands of a markdown file's ```sh blocks, continuations joined."""
  with open(os.path.join(tool_util.ROOT, path)) as f:
    text = f.read()
  lines = []
  for block in re.findall(r'```sh\n(.*?)```', text, re.DOTALL):
    for line in re.sub(r'\\\n\s*', ' ', block).splitlines():
      line = line.split('  #')[0].strip()
      if line:
        lines.append(line)
  return lines


def _PlanCommands():
  commands = []
  for path in _DOCS:
    for line in _ShellLines(path):
      if not line.startswith('python tools/plan.py '):
        continue
      words = shlex.split(line)
      if (words[:2] == ['python', 'tools/plan.py'] and len(words) > 2 and
          words[2] in _SUBCOMMANDS and
          not re.search(r'=[A-Z]\b', line)):  # No placeholders.
        commands.append((path, words[2:]))
  return commands


def _Small(args, tmp):
  """Output paths into tmp; a timeline's sizes shrunk."""
  result = []
  for arg in args:
    name, _, value = arg.partition('=')
    if value.startswith('/tmp/'):
      arg = f'{name}={tmp}/{os.path.basename(value)}'
    if args[0] == 'timeline' and name in _SMALL:
      continue
    result.append(arg)
  if args[0] == 'timeline':
    result += [f'{k}={v}' for k, v in _SMALL.items()]
  return result


COMMANDS = _PlanCommands()


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp('docs'))
  return tool_util.RunToolInParallel(
      'plan.py', {str(i): _Small(args, tmp) for i, (_, args) in
                  enumerate(COMMANDS)}, tmp, timeout=600)


def testTheDocsShowPlanCommands():
  shown = {args[0] for _, args in COMMANDS}
  assert shown == set(_SUBCOMMANDS), shown
  assert any('--virtual_stages=2' in args for _, args in COMMANDS)


@pytest.mark.slow
@pytest.mark.parametrize('index', range(len(COMMANDS)))
def testPlanCommandRunsAsWritten(runs, index):
  path, args = COMMANDS[index]
  code, stdout, stderr = runs[str(index)]
  assert code == 0, (path, args, stderr[-2000:])
  assert stdout, (path, args)
  for arg in args:  # Every file it was asked for was written.
    name, _, value = arg.partition('=')
    if name in ('--png_out', '--trace_out', '--json_out'):
      assert os.path.exists(os.path.join(runs['tmp'],
                                         os.path.basename(value))), arg


def testSchedulesDoctests():
  failures, tried = doctest.testfile(
      os.path.join(tool_util.ROOT, 'docs', 'schedules.md'),
      module_relative=False,
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert tried >= 2 and not failures, (failures, tried)
