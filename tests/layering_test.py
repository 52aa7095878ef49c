"""The package's layers: planning needs no TensorFlow, the engine no Lingvo.

Each import runs in a fresh interpreter, so that what the test process has
loaded already does not hide an import.
"""

import ast
import os
import pkgutil
import subprocess
import sys

import pytest

import lingvo_gpipe
from lingvo_gpipe import engine
from lingvo_gpipe import planning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.dirname(lingvo_gpipe.__file__)


def _Modules(package):
  return [f'{package.__name__}.{m.name}'
          for m in pkgutil.iter_modules(package.__path__)]


def _LoadedAfterImport(modules):
  """The top-level packages a fresh interpreter has loaded after `modules`."""
  code = ('import sys\n' + ''.join(f'import {m}\n' for m in modules) +
          "print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))")
  # `python -c` imports from its working directory, the repository root.
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                       capture_output=True, text=True, check=True).stdout
  return set(out.split())


@pytest.mark.slow
def testPlanningImportsNeitherTensorFlowNorLingvo():
  modules = _Modules(planning) + ['lingvo_gpipe.partition']
  assert len(modules) >= 6
  loaded = _LoadedAfterImport(modules)
  assert 'lingvo_gpipe' in loaded
  assert not loaded & {'tensorflow', 'lingvo', 'keras'}, loaded


@pytest.mark.slow
def testEngineImportsNoLingvo():
  modules = _Modules(engine)
  assert len(modules) >= 7
  loaded = _LoadedAfterImport(modules)
  assert 'tensorflow' in loaded
  assert 'lingvo' not in loaded, loaded


@pytest.mark.slow
def testKerasFrontEndImportsNoLingvo():
  """`import lingvo_gpipe.keras` serves Keras users who have no Lingvo."""
  # Listed from the folder: importing it here would hide what it loads.
  modules = ['lingvo_gpipe.keras'] + [
      f'lingvo_gpipe.keras.{m.name}'
      for m in pkgutil.iter_modules([os.path.join(PACKAGE_DIR, 'keras')])]
  assert len(modules) >= 5
  loaded = _LoadedAfterImport(modules)
  assert {'tensorflow', 'keras'} <= loaded
  assert 'lingvo' not in loaded, loaded


@pytest.mark.slow
def testPackageImportLoadsNeither():
  loaded = _LoadedAfterImport(['lingvo_gpipe'])
  assert not loaded & {'tensorflow', 'lingvo'}, loaded


def _ImportedLingvoGpipeModules(path):
  """The lingvo_gpipe modules that the file at `path` imports."""
  tree = ast.parse(open(path).read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module.startswith('lingvo_gpipe')):
      for alias in node.names:
        candidate = f'{node.module}.{alias.name}'
        found.add(candidate if _IsModule(candidate) else node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names
                   if a.name.startswith('lingvo_gpipe'))
  return found


def _IsModule(name):
  relative = name.split('.')[1:]
  base = os.path.join(PACKAGE_DIR, *relative)
  return os.path.exists(base + '.py') or os.path.isdir(base)


def _ModuleGraph():
  graph = {}
  for folder, _, files in os.walk(PACKAGE_DIR):
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(folder, f)
        rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3]
        name = rel.replace(os.sep, '.').removesuffix('.__init__')
        graph[name] = _ImportedLingvoGpipeModules(path)
  return graph


def testNoImportCycles():
  graph = _ModuleGraph()
  assert 'lingvo_gpipe.engine.pipeline' in graph
  state = {}

  def Visit(name, path):
    if state.get(name) == 'done':
      return
    if state.get(name) == 'open':
      pytest.fail(f'import cycle: {" -> ".join(path + [name])}')
    state[name] = 'open'
    for dep in sorted(graph.get(name, ())):
      Visit(dep, path + [name])
    state[name] = 'done'

  for name in sorted(graph):
    Visit(name, [])


@pytest.mark.parametrize('lower,upper', [
    ('lingvo_gpipe.planning', 'lingvo_gpipe.engine'),
    ('lingvo_gpipe.planning', 'lingvo_gpipe.layers'),
    ('lingvo_gpipe.engine', 'lingvo_gpipe.layers'),
    ('lingvo_gpipe.engine', 'lingvo_gpipe.cells'),
    ('lingvo_gpipe.engine', 'lingvo_gpipe.keras'),
    ('lingvo_gpipe.planning', 'lingvo_gpipe.keras'),
    # The Keras front end shares engine/ and planning/, never the Lingvo one.
    ('lingvo_gpipe.keras', 'lingvo_gpipe.layers'),
    ('lingvo_gpipe.keras', 'lingvo_gpipe.cells'),
    ('lingvo_gpipe.keras', 'lingvo_gpipe.costs'),
    ('lingvo_gpipe.keras', 'lingvo_gpipe.batchnorm'),
    ('lingvo_gpipe.keras', 'lingvo_gpipe.stacks'),
])
def testArrowsPointDown(lower, upper):
  graph = _ModuleGraph()
  for name, deps in graph.items():
    if name.startswith(lower):
      assert not any(d.startswith(upper) for d in deps), (name, deps)
