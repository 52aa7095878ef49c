"""Lingvo imports on this host; tests of the glibc_compat package.

lingvo 0.14.2's prebuilt ops need glibc 2.38 / GCC 13's libstdc++; on older
hosts ``python -m glibc_compat --venv .venv`` (run by `make setup`) patches
them. These tests check that the current interpreter (the project's venv) can
import and use lingvo, and unit-test the package's ELF reading, host
detection and patching.
"""

import ctypes
import importlib.util
import os
import pathlib
import shutil
import struct
import sys

import pytest

from glibc_compat import __main__ as glibc_main
from glibc_compat import elf
from glibc_compat import host
from glibc_compat import patcher


def _OpsDir():
  """Returns lingvo's core/ops directory in the current interpreter."""
  spec = importlib.util.find_spec('lingvo')
  assert spec is not None and spec.origin, 'lingvo is not installed'
  return pathlib.Path(spec.origin).parent / 'core' / 'ops'


def _Machine():
  """ELF e_machine of the running interpreter."""
  return elf.ElfFile.FromPath(os.path.realpath(sys.executable)).machine


def testLingvoImportsAndNestedMapWorks():
  from lingvo.core import base_layer  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  nested = py_utils.NestedMap(a=1, b=py_utils.NestedMap(c=2))
  assert nested.a == 1
  assert nested.b.c == 2
  assert nested.Flatten() == [1, 2]
  assert sorted(nested.FlattenItems()) == [('a', 1), ('b.c', 2)]
  assert hasattr(base_layer, 'BaseLayer')


def testXOpsOpRuns():
  from lingvo import compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import ops  # pylint: disable=g-import-not-at-top

  # Graph mode, so this works whether or not eager execution is enabled.
  with tf.Graph().as_default():
    perm = ops.random_permutation_sequence(num=5, batch=5, seed=1)
    with tf.Session() as sess:
      values = sess.run(perm)
  assert sorted(values.tolist()) == [0, 1, 2, 3, 4]


def testHostLibcVersionDefinitions():
  libc = host.FindHostLibrary('libc.so.6', _Machine())
  assert libc is not None
  versions = elf.ReadVersionDefinitions(libc)
  assert f'GLIBC_{host.GlibcVersion()}' in versions
  assert not any(v.startswith('libc.so') for v in versions)  # No base entry.
  assert len(versions) == len(set(versions))


def testHostLibmVersionNeeds():
  libm = host.FindHostLibrary('libm.so.6', _Machine())
  assert libm is not None
  needs = elf.ReadVersionNeeds(libm)
  # libm only depends on libc (e.g. GLIBC_PRIVATE), never on libstdc++.
  assert needs
  assert {n.file for n in needs} <= {'libc.so.6', 'ld-linux-x86-64.so.2',
                                     'ld-linux-aarch64.so.1'}
  assert all(n.index >= 2 for n in needs)


def testVersionKeyOrdersNumerically():
  names = ['GLIBCXX_3.4.9', 'GLIBCXX_3.4.32', 'GLIBCXX_3.4.30']
  assert sorted(names, key=host.VersionKey) == [
      'GLIBCXX_3.4.9', 'GLIBCXX_3.4.30', 'GLIBCXX_3.4.32']


def testXOpsVersionNeeds():
  needs = elf.ReadVersionNeeds(str(_OpsDir() / 'x_ops.so'))
  by_file = {}
  for need in needs:
    by_file.setdefault(need.file, set()).add(need.name)
  # lingvo 0.14.2's x_ops.so was built with glibc 2.38 / GCC 13 (whether or
  # not it has been patched: patching only marks these needs weak).
  assert 'GLIBC_2.38' in by_file['libc.so.6']
  assert {'GLIBCXX_3.4.32', 'CXXABI_1.3.15'} <= by_file['libstdc++.so.6']
  assert len({n.index for n in needs}) == len(needs)


def testXOpsIsLoadableOnThisHost():
  """Host provides every non-weak need; weak ones are covered by the shim.

  On a host with glibc >= 2.38 (e.g. Debian 13) nothing is missing and
  nothing was patched; the patching itself runs on every host in
  testMainRepairsAndRestoresAVenv.
  """
  path = str(_OpsDir() / 'x_ops.so')
  report = patcher.AnalyzeLibrary(path, host.HostVersions())
  if host.VersionKey(host.GlibcVersion()) >= (2, 38):
    assert not report.missing, report
    assert patcher.SHIM_NAME not in elf.ElfFile.FromPath(path).Needed()
    return
  assert {n.name for n in report.missing} == {
      'GLIBC_2.38', 'GLIBCXX_3.4.32', 'CXXABI_1.3.15'}
  assert report.patched, report
  library = elf.ElfFile.FromPath(path)
  assert patcher.SHIM_NAME in library.Needed()
  assert '$ORIGIN' in library.RunPaths()
  shim = elf.ElfFile.FromPath(str(_OpsDir() / patcher.SHIM_NAME))
  defined = {s.name for s in shim.DynamicSymbols() if not s.undefined}
  missing_indices = {n.index for n in report.missing}
  for sym in library.DynamicSymbols():
    if sym.name in patcher.SHIM_SYMBOLS and sym.undefined:
      assert sym.versym == elf.VER_NDX_GLOBAL, sym  # Unversioned.
      assert sym.name in defined
    if sym.undefined:
      assert sym.version_index not in missing_indices, sym
  assert '__isoc23_strtol' in defined
  lib = ctypes.CDLL(str(_OpsDir() / patcher.SHIM_NAME))
  strtol = lib.__isoc23_strtol
  strtol.restype = ctypes.c_long
  strtol.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
  assert strtol(b'  -42xyz', None, 10) == -42
  assert strtol(b'ff', None, 16) == 255


@pytest.mark.slow
def testRepairAgainChangesNothing():
  """`make setup` runs the repair on every rebuild: a second run is a no-op."""
  libraries = patcher.ListLibraries(str(_OpsDir().parent.parent))
  before = {p: pathlib.Path(p).read_bytes() for p in libraries}
  message = patcher.Repair(sys.prefix)
  assert message.startswith('glibc_compat: '), message
  assert ('already patched (2 libraries' in message or
          'nothing to do' in message), message
  assert {p: pathlib.Path(p).read_bytes() for p in libraries} == before


@pytest.mark.slow
def testRepairIsANoOpWhenTheHostHasEveryVersion(monkeypatch):
  """What a glibc >= 2.38 host (e.g. Debian 13) sees: nothing to patch."""

  class NewHost(host.HostVersions):

    def Provides(self, soname, machine):
      versions = super().Provides(soname, machine)
      return None if versions is None else versions | {
          'GLIBC_2.38', 'GLIBCXX_3.4.32', 'CXXABI_1.3.15'}

  monkeypatch.setattr(host, 'HostVersions', NewHost)
  message = patcher.Repair(sys.prefix)
  assert message == (f'glibc_compat: lingvo ops load on this host (glibc '
                     f'{host.GlibcVersion()}); nothing to do')


def _OldHostVersions():
  """HostVersions of a host without the three versions lingvo's ops need."""

  class OldHost(host.HostVersions):

    def Provides(self, soname, machine):
      versions = super().Provides(soname, machine)
      return None if versions is None else versions - {
          'GLIBC_2.38', 'GLIBCXX_3.4.32', 'CXXABI_1.3.15'}

  return OldHost


def _VenvWithOriginalLingvoOps(venv):
  """A venv whose lingvo has the ops as shipped, before any repair.

  Its lingvo package mirrors this interpreter's: symbolic links to every file
  except the shared objects, which are copies of the originals (the backups
  of an earlier repair, if any). Its bin/python runs this interpreter with
  that lingvo first on the path, so the repair's own check imports it.

  Args:
    venv: A pathlib.Path to create the venv at.

  Returns:
    {path of a shared object in the venv: its original bytes}.
  """
  site = venv / 'lib' / 'python3.11' / 'site-packages'
  source = _OpsDir().parent.parent
  originals = {}
  for root, _, files in os.walk(source):
    target_dir = site / 'lingvo' / os.path.relpath(root, source)
    target_dir.mkdir(parents=True, exist_ok=True)
    for name in files:
      path = pathlib.Path(root) / name
      if name == patcher.SHIM_NAME or name.endswith(patcher.BACKUP_SUFFIX):
        continue
      if not name.endswith('.so'):
        (target_dir / name).symlink_to(path)
        continue
      backup = pathlib.Path(str(path) + patcher.BACKUP_SUFFIX)
      data = (backup if backup.exists() else path).read_bytes()
      (target_dir / name).write_bytes(data)
      originals[str(target_dir / name)] = data
  python = venv / 'bin' / 'python'
  python.parent.mkdir()
  python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
  python.chmod(0o755)
  return originals


@pytest.mark.slow
def testMainRepairsAndRestoresAVenv(tmp_path, monkeypatch, capsys):
  """`python -m glibc_compat --venv V` patches V's lingvo; --restore undoes it.

  Runs on a copy of lingvo's original ops, on any host: the host is made to
  lack the three versions (on glibc < 2.38 it does anyway); the repair's
  check imports the copy and runs an op of the patched x_ops.so.

  Args:
    tmp_path: pytest's scratch folder.
    monkeypatch: pytest's, for the host's versions.
    capsys: pytest's output capture.
  """
  monkeypatch.setattr(host, 'HostVersions', _OldHostVersions())
  venv = tmp_path / 'venv'
  originals = _VenvWithOriginalLingvoOps(venv)
  lingvo_dir = venv / 'lib' / 'python3.11' / 'site-packages' / 'lingvo'
  patched = ['core/ops/x_ops.so', 'tasks/car/ops/car_ops.so']

  assert glibc_main.Main(['--venv', str(venv)]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f'glibc_compat: patched 2 libraries '
                        f'({", ".join(patched)}) (missing: CXXABI_1.3.15, '
                        'GLIBC_2.38, GLIBCXX_3.4.32; shimmed: '), out
  assert out.endswith('); lingvo imports\n'), out
  for name in patched:
    path = lingvo_dir / name
    assert patcher.SHIM_NAME in elf.ElfFile.FromPath(str(path)).Needed()
    assert (path.parent / patcher.SHIM_NAME).exists()
    backup = pathlib.Path(str(path) + patcher.BACKUP_SUFFIX)
    assert backup.read_bytes() == originals[str(path)]
  changed = {p for p, data in originals.items()
             if pathlib.Path(p).read_bytes() != data}
  assert changed == {str(lingvo_dir / name) for name in patched}

  assert glibc_main.Main(['--venv', str(venv)]) == 0
  assert capsys.readouterr().out.startswith(
      'glibc_compat: already patched (2 libraries, missing: CXXABI_1.3.15, '
      'GLIBC_2.38, GLIBCXX_3.4.32); lingvo imports')

  assert glibc_main.Main(['--venv', str(venv), '--restore']) == 0
  assert capsys.readouterr().out == (
      f'glibc_compat: restored 2 original libraries in {lingvo_dir}\n')
  for path, data in originals.items():
    assert pathlib.Path(path).read_bytes() == data, path
  leftovers = [p for p in lingvo_dir.rglob('*')
               if p.name == patcher.SHIM_NAME or
               p.name.endswith(patcher.BACKUP_SUFFIX)]
  assert not leftovers


def testMainFailsInOneLineWithoutAVenv(tmp_path, capsys):
  """A folder that is not a venv: exit status 1 and one line on stderr."""
  assert glibc_main.Main(['--venv', str(tmp_path)]) == 1
  assert capsys.readouterr().err == (
      f'glibc_compat: no python found in {tmp_path}/bin\n')


def testWeakenVersionsIsIdempotent(tmp_path):
  src = _OpsDir() / ('x_ops.so' + patcher.BACKUP_SUFFIX)
  if not src.exists():
    src = _OpsDir() / 'x_ops.so'
  copy = tmp_path / 'x_ops.so'
  shutil.copyfile(src, copy)
  assert elf.WeakenVersions(str(copy), [('libc.so.6', 'GLIBC_2.38')]) > 0
  library = elf.ElfFile.FromPath(str(copy))
  need = [n for n in library.VersionNeeds() if n.name == 'GLIBC_2.38']
  assert len(need) == 1 and need[0].weak
  others = [n for n in library.VersionNeeds() if n.name == 'GLIBCXX_3.4.29']
  assert others and not others[0].weak
  strtol = [s for s in library.DynamicSymbols()
            if s.name == '__isoc23_strtol']
  assert strtol and strtol[0].versym == elf.VER_NDX_GLOBAL
  assert elf.WeakenVersions(str(copy), [('libc.so.6', 'GLIBC_2.38')]) == 0


def testRejectsNonElfAnd32Bit(tmp_path):
  text = tmp_path / 'not_elf.so'
  text.write_bytes(b'hello world' * 10)
  with pytest.raises(elf.ElfError, match='not an ELF'):
    elf.ElfFile.FromPath(str(text))
  elf32 = tmp_path / 'elf32.so'
  elf32.write_bytes(b'\x7fELF' + struct.pack('<BB', 1, 1) + b'\0' * 58)
  with pytest.raises(elf.ElfError, match='64-bit little-endian'):
    elf.ElfFile.FromPath(str(elf32))
