"""Every example in lingvo_gpipe's docstrings runs, as a doctest.

An example is an indented block of a module, class or function docstring
outside its sections (Args:, Returns:, ...). Each must be a doctest (`>>>`
lines, then what they print), and each module's doctests run here: a block
that is not a doctest, or a doctest that `doctest.DocTestFinder` does not
reach (say, in a nested function), fails the module's test, so no example
can go stale unseen. Examples that need devices use the four logical CPU
devices of conftest.py.
"""

import ast
import doctest
import importlib
import pathlib
import re

import pytest

import lingvo_gpipe

_PACKAGE = pathlib.Path(lingvo_gpipe.__file__).parent
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Google-style sections whose indented lines are not examples.
_SECTION = re.compile(r'(Args|Arguments|Attributes|Raises|Returns|Yields):$')
# An indented block is an example from this many columns in.
_INDENT = 4


def _ModuleNames():
  """Every module of the package, from its files (nothing imported)."""
  names = []
  for path in sorted(_PACKAGE.rglob('*.py')):
    parts = path.relative_to(_PACKAGE.parent).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    names.append('.'.join(parts))
  return names


def _Path(module_name):
  path = _PACKAGE.parent.joinpath(*module_name.split('.'))
  return (path / '__init__.py' if path.is_dir() else
          path.with_suffix('.py'))


def _Docstrings(module_name):
  """(name, docstring) of the module and every class and function in it."""
  tree = ast.parse(_Path(module_name).read_text())
  found = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)):
      docstring = ast.get_docstring(node)
      if docstring:
        found.append((getattr(node, 'name', module_name), docstring))
  return found


def _Indent(line):
  return len(line) - len(line.lstrip(' '))


def _Blocks(docstring):
  """The example blocks of a docstring: lists of lines, indentation kept.

  A block starts at a line indented by _INDENT or more (the docstring's own
  indentation removed) after a blank line or a less indented line that ends
  in ':' (such as 'Example:'), outside an Args, Returns, ... section, and
  ends at the next line indented less.

  Args:
    docstring: A cleaned docstring (`ast.get_docstring`).

  Returns:
    The blocks, in order.
  """
  blocks, block, in_section, previous = [], None, False, ''
  for line in docstring.splitlines():
    indent = _Indent(line)
    if block is not None and line.strip() and indent < block[0]:
      blocks.append(block[1])
      block = None
    if block is not None:
      block[1].append(line)
    elif line.strip() and indent == 0:
      in_section = bool(_SECTION.match(line))
    elif (line.strip() and indent >= _INDENT and not in_section and
          (not previous.strip() or (_Indent(previous) < indent and
                                    previous.rstrip().endswith(':')))):
      block = (indent, [line])
    previous = line
  if block is not None:
    blocks.append(block[1])
  return blocks


def _Examples(module_name):
  """(blocks that are not doctests, doctest examples) of a module's source."""
  not_doctests, examples = [], 0
  for name, docstring in _Docstrings(module_name):
    for block in _Blocks(docstring):
      if not block[0].lstrip().startswith('>>>'):
        not_doctests.append(f'{name}: {block[0].strip()}')
    examples += len(doctest.DocTestParser().get_examples(docstring))
  return not_doctests, examples


_MODULES = _ModuleNames()


def testTheScanFindsTheExamples():
  """The package has examples, and every one is counted in some module."""
  assert 'lingvo_gpipe.engine.loop' in _MODULES, _MODULES
  with_examples = [m for m in _MODULES if _Examples(m)[1]]
  assert len(with_examples) >= 40, with_examples


def testBlocksOutsideSectionsAreExamples():
  docstring = ('Summary.\n\n    >>> 1 + 1\n    2\n\nText.\n\n'
               '    code()\n\nArgs:\n  x: An argument:\n\n'
               '    More about x.\n\nExample:\n    more_code()\n')
  assert _Blocks(docstring) == [['    >>> 1 + 1', '    2', ''],
                                ['    code()', ''], ['    more_code()']]


@pytest.mark.parametrize('module_name', _MODULES)
def testDoctests(module_name):
  """The module's examples are doctests, all found, and all pass."""
  not_doctests, examples = _Examples(module_name)
  assert not not_doctests, (
      f'{module_name}: examples that are not doctests (write them as `>>>` '
      f'lines with their output): {not_doctests}')
  module = importlib.import_module(module_name)
  tests = doctest.DocTestFinder(exclude_empty=True).find(module)
  found = sum(len(test.examples) for test in tests)
  assert found == examples, (
      f'{module_name}: its docstrings hold {examples} doctest examples, '
      f'doctest finds {found}; an example in a docstring doctest does not '
      'reach (e.g. of a nested function) does not run.')
  runner = doctest.DocTestRunner(optionflags=_FLAGS)
  report = []
  for test in tests:
    runner.run(test, out=report.append)
  results = runner.summarize(verbose=False)
  assert not results.failed, ''.join(report)
