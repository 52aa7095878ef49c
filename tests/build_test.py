"""The BUILD files declare every module, tool and test of the repository."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Rules that declare Python sources; pytest_test is tests/pytest.bzl's py_test.
_LIBRARIES = ('py_library', 'py_binary')
_TESTS = ('py_test', 'pytest_test')


def _Declared(rules):
  """{path from the root} of every .py source named in one of `rules`."""
  declared = set()
  for build in ROOT.rglob('BUILD'):
    if '.venv' in build.parts or 'third_party' in build.parts:
      continue
    text = build.read_text()
    for rule in rules:
      for body in re.findall(rf'^{rule}\((.*?)^\)', text, re.S | re.M):
        for src in re.findall(r'"([^"]+\.py)"', body):
          declared.add(str((build.parent / src).relative_to(ROOT)))
  return declared


def _Sources(pattern):
  return {str(p.relative_to(ROOT)) for p in ROOT.glob(pattern)}


def testEveryModuleIsALibraryOrBinary():
  declared = _Declared(_LIBRARIES)
  for pattern in ('lingvo_gpipe/**/*.py', 'params/*.py', 'benchmarks/*.py',
                  'glibc_compat/*.py', 'tools/*.py'):
    sources = _Sources(pattern)
    assert sources, pattern
    missing = sources - declared
    assert not missing, f'not in BUILD: {sorted(missing)}'


def testEveryTestIsAPyTest():
  tests = _Sources('tests/*_test.py')
  assert tests
  missing = tests - _Declared(_TESTS)
  assert not missing, f'not in BUILD: {sorted(missing)}'
  helpers = _Sources('tests/*.py') - tests
  assert not helpers - _Declared(_LIBRARIES), helpers
