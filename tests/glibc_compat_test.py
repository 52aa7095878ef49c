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
  """Host provides every non-weak need; weak ones are covered by the shim."""
  path = str(_OpsDir() / 'x_ops.so')
  report = patcher.AnalyzeLibrary(path, host.HostVersions())
  if host.VersionKey(host.GlibcVersion()) >= (2, 38):  # E.g. Debian 13.
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


def testRepairAgainChangesNothing():
  """`make setup` runs the repair on every rebuild: a second run is a no-op."""
  libraries = patcher.ListLibraries(str(_OpsDir().parent.parent))
  before = {p: pathlib.Path(p).read_bytes() for p in libraries}
  message = patcher.Repair(sys.prefix)
  assert message.startswith('glibc_compat: '), message
  assert ('already patched (2 libraries' in message or
          'nothing to do' in message), message
  assert {p: pathlib.Path(p).read_bytes() for p in libraries} == before


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
