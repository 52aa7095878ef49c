"""BUILD declares every module, tool and test of the repository."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _Declared(rule):
  """{(package dir, source file)} of every `rule` in every BUILD file."""
  declared = set()
  for build in ROOT.rglob('BUILD'):
    if '.venv' in build.parts:
      continue
    text = build.read_text()
    for body in re.findall(rf'^{rule}\((.*?)^\)', text, re.S | re.M):
      for src in re.findall(r'"([^"]+\.py)"', body):
        declared.add(str((build.parent / src).relative_to(ROOT)))
  return declared


def _Sources(pattern):
  return {str(p.relative_to(ROOT)) for p in ROOT.glob(pattern)}


def testEveryModuleIsALibraryOrBinary():
  declared = _Declared('py_library') | _Declared('py_binary')
  for pattern in ('lingvo_gpipe/*.py', 'params/*.py', 'tools/*.py'):
    missing = _Sources(pattern) - declared
    assert not missing, f'not in BUILD: {sorted(missing)}'


def testEveryTestIsAPyTest():
  missing = _Sources('tests/*_test.py') - _Declared('py_test')
  assert not missing, f'not in BUILD: {sorted(missing)}'
  helpers = _Sources('tests/*.py') - _Sources('tests/*_test.py')
  assert not helpers - _Declared('py_library'), helpers
