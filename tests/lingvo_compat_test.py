"""Tests that lingvo imports on this host and of tools/lingvo_compat.py.

lingvo 0.14.2's prebuilt ops need glibc 2.38 / GCC 13's libstdc++; on older
hosts ``tools/lingvo_compat.py --venv .venv`` patches them. These tests check
that the current interpreter (the project's venv) can import and use lingvo,
and unit-test the script's ELF parsing and patching helpers.
"""

import ctypes
import importlib.util
import os
import pathlib
import shutil
import struct
import sys

import pytest

_SCRIPT = pathlib.Path(__file__).parent.parent / 'tools' / 'lingvo_compat.py'


def _load_script():
  """Imports tools/lingvo_compat.py as a module."""
  spec = importlib.util.spec_from_file_location('lingvo_compat', _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


lingvo_compat = _load_script()


def _ops_dir():
  """Returns lingvo's core/ops directory in the current interpreter."""
  spec = importlib.util.find_spec('lingvo')
  assert spec is not None and spec.origin, 'lingvo is not installed'
  return pathlib.Path(spec.origin).parent / 'core' / 'ops'


def _machine():
  """ELF e_machine of the running interpreter."""
  return lingvo_compat.ElfFile.from_path(os.path.realpath(
      sys.executable)).machine


def test_lingvo_imports_and_nested_map_works():
  from lingvo.core import base_layer  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  nested = py_utils.NestedMap(a=1, b=py_utils.NestedMap(c=2))
  assert nested.a == 1
  assert nested.b.c == 2
  assert nested.Flatten() == [1, 2]
  assert sorted(nested.FlattenItems()) == [('a', 1), ('b.c', 2)]
  assert hasattr(base_layer, 'BaseLayer')


def test_x_ops_op_runs():
  from lingvo import compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import ops  # pylint: disable=g-import-not-at-top

  # Graph mode, so this works whether or not eager execution is enabled.
  with tf.Graph().as_default():
    perm = ops.random_permutation_sequence(num=5, batch=5, seed=1)
    with tf.Session() as sess:
      values = sess.run(perm)
  assert sorted(values.tolist()) == [0, 1, 2, 3, 4]


def test_host_libc_version_definitions():
  libc = lingvo_compat.find_host_library('libc.so.6', _machine())
  assert libc is not None
  versions = lingvo_compat.read_version_definitions(libc)
  glibc = lingvo_compat.host_glibc_version()
  assert f'GLIBC_{glibc}' in versions
  assert not any(v.startswith('libc.so') for v in versions)  # No base entry.
  assert len(versions) == len(set(versions))


def test_host_libm_version_needs():
  libm = lingvo_compat.find_host_library('libm.so.6', _machine())
  assert libm is not None
  needs = lingvo_compat.read_version_needs(libm)
  # libm only depends on libc (e.g. GLIBC_PRIVATE), never on libstdc++.
  assert needs
  assert {n.file for n in needs} <= {'libc.so.6', 'ld-linux-x86-64.so.2',
                                     'ld-linux-aarch64.so.1'}
  assert all(n.index >= 2 for n in needs)


def test_x_ops_version_needs():
  needs = lingvo_compat.read_version_needs(str(_ops_dir() / 'x_ops.so'))
  by_file = {}
  for need in needs:
    by_file.setdefault(need.file, set()).add(need.name)
  # lingvo 0.14.2's x_ops.so was built with glibc 2.38 / GCC 13 (whether or
  # not it has been patched: patching only marks these needs weak).
  assert 'GLIBC_2.38' in by_file['libc.so.6']
  assert {'GLIBCXX_3.4.32', 'CXXABI_1.3.15'} <= by_file['libstdc++.so.6']
  assert len({n.index for n in needs}) == len(needs)


def test_x_ops_is_loadable_on_this_host():
  """Host provides every non-weak need; weak ones are covered by the shim."""
  path = str(_ops_dir() / 'x_ops.so')
  report = lingvo_compat.analyze_library(path, lingvo_compat.HostVersions())
  if not report.missing:
    return  # A new enough host (e.g. glibc >= 2.38): nothing was patched.
  assert report.patched, report
  elf = lingvo_compat.ElfFile.from_path(path)
  assert lingvo_compat.SHIM_NAME in elf.needed()
  assert '$ORIGIN' in elf.run_paths()
  shim = lingvo_compat.ElfFile.from_path(
      str(_ops_dir() / lingvo_compat.SHIM_NAME))
  defined = {s.name for s in shim.dynamic_symbols() if not s.undefined}
  missing_indices = {n.index for n in report.missing}
  for sym in elf.dynamic_symbols():
    if sym.name in lingvo_compat.SHIM_SYMBOLS and sym.undefined:
      assert sym.versym == 1, sym  # Unversioned.
      assert sym.name in defined
    if sym.undefined and sym.versym is not None:
      assert sym.versym & 0x7fff not in missing_indices, sym
  if '__isoc23_strtol' in defined:
    lib = ctypes.CDLL(str(_ops_dir() / lingvo_compat.SHIM_NAME))
    strtol = lib.__isoc23_strtol
    strtol.restype = ctypes.c_long
    strtol.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
    assert strtol(b'  -42xyz', None, 10) == -42
    assert strtol(b'ff', None, 16) == 255


def test_weaken_versions_is_idempotent(tmp_path):
  src = _ops_dir() / ('x_ops.so' + lingvo_compat.BACKUP_SUFFIX)
  if not src.exists():
    src = _ops_dir() / 'x_ops.so'
  copy = tmp_path / 'x_ops.so'
  shutil.copyfile(src, copy)
  lingvo_compat.weaken_versions(str(copy), [('libc.so.6', 'GLIBC_2.38')])
  elf = lingvo_compat.ElfFile.from_path(str(copy))
  need = [n for n in elf.version_needs() if n.name == 'GLIBC_2.38']
  assert len(need) == 1 and need[0].weak
  others = [n for n in elf.version_needs() if n.name == 'GLIBCXX_3.4.29']
  assert others and not others[0].weak
  strtol = [s for s in elf.dynamic_symbols() if s.name == '__isoc23_strtol']
  assert strtol and strtol[0].versym == 1
  assert lingvo_compat.weaken_versions(str(copy),
                                       [('libc.so.6', 'GLIBC_2.38')]) == 0


def test_rejects_non_elf_and_32_bit(tmp_path):
  text = tmp_path / 'not_elf.so'
  text.write_bytes(b'hello world' * 10)
  with pytest.raises(lingvo_compat.ElfError, match='not an ELF'):
    lingvo_compat.ElfFile.from_path(str(text))
  elf32 = tmp_path / 'elf32.so'
  elf32.write_bytes(b'\x7fELF' + struct.pack('<BB', 1, 1) + b'\0' * 58)
  with pytest.raises(lingvo_compat.ElfError, match='64-bit little-endian'):
    lingvo_compat.ElfFile.from_path(str(elf32))
