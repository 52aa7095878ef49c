"""Reads the dynamic-linking parts of ELF shared objects; edits version needs.

Just enough of the ELF format (64-bit little-endian only) to answer what a
shared object needs from the host's libraries and to relax those needs:

    elf = ElfFile.FromPath('.venv/.../lingvo/core/ops/x_ops.so')
    [n.name for n in elf.VersionNeeds()]   # ['GLIBC_2.2.5', ..., 'GLIBC_2.38']
    WeakenVersions(path, [('libc.so.6', 'GLIBC_2.38')])

The sections read are the section headers, ``.dynsym`` with ``.gnu.version``
(which version each symbol is bound to), ``.gnu.version_r`` (the versions
needed from each library), ``.gnu.version_d`` (the versions a library defines)
and ``.dynamic`` (``DT_NEEDED``, ``DT_RUNPATH``). `WeakenVersions` edits flags
and symbol versions in place; adding ``DT_NEEDED`` entries changes the file's
layout and is left to ``patchelf``. Standard library only.
"""

import dataclasses
import itertools
import os
import struct
import tempfile
from typing import Iterable, Iterator, List, Optional, Tuple

# ELF constants (see elf.h).
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_SHT_DYNAMIC = 6
_SHT_DYNSYM = 11
_SHT_GNU_VERDEF = 0x6ffffffd
_SHT_GNU_VERNEED = 0x6ffffffe
_SHT_GNU_VERSYM = 0x6fffffff
_SHN_UNDEF = 0
_DT_NULL = 0
_DT_NEEDED = 1
_DT_RPATH = 15
_DT_RUNPATH = 29
_VER_FLG_BASE = 0x1
_VER_FLG_WEAK = 0x2
# The .gnu.version value of an unversioned (global) symbol.
VER_NDX_GLOBAL = 1
_VERSYM_HIDDEN = 0x8000


class ElfError(Exception):
  """Raised for files this module cannot parse as ELF."""


@dataclasses.dataclass(frozen=True)
class Section:
  """One ELF section header (the fields this module uses)."""
  name: str
  type: int
  offset: int
  size: int
  link: int
  entsize: int


@dataclasses.dataclass(frozen=True)
class VersionNeed:
  """One ``Elf64_Vernaux`` entry of ``.gnu.version_r``.

  Attributes:
    file: The library the version is needed from, e.g. ``libc.so.6``.
    name: The version name, e.g. ``GLIBC_2.38``.
    flags: ``vna_flags`` (``VER_FLG_WEAK`` = 0x2).
    index: ``vna_other``, the index used in ``.gnu.version``.
    offset: File offset of this ``Elf64_Vernaux`` entry.
  """
  file: str
  name: str
  flags: int
  index: int
  offset: int

  @property
  def weak(self) -> bool:
    """Whether the need is weak: the loader only warns if it is missing."""
    return bool(self.flags & _VER_FLG_WEAK)


@dataclasses.dataclass(frozen=True)
class DynamicSymbol:
  """One ``.dynsym`` entry with its ``.gnu.version`` value.

  Attributes:
    index: Index in ``.dynsym`` (and in ``.gnu.version``).
    name: Symbol name (mangled).
    undefined: Whether the symbol is undefined (``SHN_UNDEF``).
    versym: Raw ``.gnu.version`` value, or None without that section.
    versym_offset: File offset of the ``.gnu.version`` value, or None.
  """
  index: int
  name: str
  undefined: bool
  versym: Optional[int]
  versym_offset: Optional[int]

  @property
  def version_index(self) -> Optional[int]:
    """The version index (`VersionNeed.index`) without the hidden bit."""
    return None if self.versym is None else self.versym & ~_VERSYM_HIDDEN


class ElfFile:
  """Minimal read-only parser for 64-bit little-endian ELF shared objects.

  Attributes:
    path: The file's path (for messages).
    data: The whole file contents.
    machine: ``e_machine``, e.g. 62 for x86-64.
    sections: The section headers, in order.
  """

  def __init__(self, data: bytes, path: str = '<bytes>'):
    """Parses the ELF header and section headers.

    Args:
      data: The whole file contents.
      path: Used in error messages only.

    Raises:
      ElfError: If data is not a 64-bit little-endian ELF file.
    """
    self.path = path
    self.data = data
    if len(data) < 64 or data[:4] != b'\x7fELF':
      raise ElfError(f'{path}: not an ELF file')
    if data[4] != _ELFCLASS64 or data[5] != _ELFDATA2LSB:
      raise ElfError(f'{path}: only 64-bit little-endian ELF files are '
                     f'supported (EI_CLASS={data[4]}, EI_DATA={data[5]})')
    (self.machine,) = struct.unpack_from('<H', data, 18)
    shoff, = struct.unpack_from('<Q', data, 40)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', data, 58)
    if shoff == 0 or shnum == 0:
      raise ElfError(f'{path}: no section headers')
    if shentsize != 64 or shoff + shnum * shentsize > len(data):
      raise ElfError(f'{path}: malformed section header table')
    raw = []
    for i in range(shnum):
      (name, sh_type, _, _, offset, size, link, _, _,
       entsize) = struct.unpack_from('<IIQQQQIIQQ', data, shoff + i * 64)
      raw.append((name, sh_type, offset, size, link, entsize))
    strtab_offset = raw[shstrndx][2] if shstrndx < shnum else 0
    self.sections: List[Section] = [
        Section(self._CString(strtab_offset + r[0]) if strtab_offset else '',
                *r[1:]) for r in raw
    ]

  @classmethod
  def FromPath(cls, path: str) -> 'ElfFile':
    """Reads and parses the ELF file at path.

    Args:
      path: File to read.

    Returns:
      The parsed ElfFile.

    Raises:
      ElfError: If the file is not a supported ELF file.
      OSError: If it cannot be read.
    """
    with open(path, 'rb') as f:
      return cls(f.read(), path)

  def _CString(self, offset: int) -> str:
    end = self.data.index(b'\0', offset)
    return self.data[offset:end].decode('utf-8', 'replace')

  def _SectionOfType(self, sh_type: int) -> Optional[Section]:
    for section in self.sections:
      if section.type == sh_type:
        return section
    return None

  def _LinkedString(self, section: Section, offset: int) -> str:
    return self._CString(self.sections[section.link].offset + offset)

  def _Chain(self, pos: int, end: Optional[int],
             fmt: str) -> Iterator[Tuple[int, Tuple[int, ...]]]:
    """Yields (offset, fields) of records linked by their last field.

    The version sections chain their entries: the last field of each record
    is the distance to the next one, 0 after the last.

    Args:
      pos: Offset of the first record.
      end: Stop before this offset (None: follow the links only).
      fmt: The record's `struct` format; its last field is the link.
    """
    while end is None or pos < end:
      fields = struct.unpack_from(fmt, self.data, pos)
      yield pos, fields
      if not fields[-1]:
        return
      pos += fields[-1]

  def VersionNeeds(self) -> List[VersionNeed]:
    """Returns the entries of ``.gnu.version_r`` (empty if absent)."""
    section = self._SectionOfType(_SHT_GNU_VERNEED)
    if section is None:
      return []
    result = []
    # Elf64_Verneed: version, cnt, file, aux, next; Elf64_Vernaux: hash,
    # flags, other, name, next.
    for pos, (_, cnt, file_off, aux, _) in self._Chain(
        section.offset, section.offset + section.size, '<HHIII'):
      file_name = self._LinkedString(section, file_off)
      for aux_pos, (_, flags, other, name_off, _) in itertools.islice(
          self._Chain(pos + aux, None, '<IHHII'), cnt):
        result.append(
            VersionNeed(file_name, self._LinkedString(section, name_off),
                        flags, other, aux_pos))
    return result

  def VersionDefinitions(self) -> List[str]:
    """Returns the version names defined in ``.gnu.version_d``.

    The base definition (the file's own soname) is left out.
    """
    section = self._SectionOfType(_SHT_GNU_VERDEF)
    if section is None:
      return []
    result = []
    # Elf64_Verdef: version, flags, ndx, cnt, hash, aux, next.
    for pos, (_, flags, _, cnt, _, aux, _) in self._Chain(
        section.offset, section.offset + section.size, '<HHHHIII'):
      if cnt and not flags & _VER_FLG_BASE:
        name_off, = struct.unpack_from('<I', self.data, pos + aux)
        result.append(self._LinkedString(section, name_off))
    return result

  def DynamicSymbols(self) -> List[DynamicSymbol]:
    """Returns ``.dynsym`` with the matching ``.gnu.version`` values."""
    dynsym = self._SectionOfType(_SHT_DYNSYM)
    if dynsym is None:
      return []
    versym = self._SectionOfType(_SHT_GNU_VERSYM)
    result = []
    for i in range(dynsym.size // 24):
      name_off, _, _, shndx, _, _ = struct.unpack_from(
          '<IBBHQQ', self.data, dynsym.offset + i * 24)
      ver, ver_off = None, None
      if versym is not None and 2 * i < versym.size:
        ver_off = versym.offset + 2 * i
        ver, = struct.unpack_from('<H', self.data, ver_off)
      result.append(
          DynamicSymbol(i, self._LinkedString(dynsym, name_off),
                        shndx == _SHN_UNDEF, ver, ver_off))
    return result

  def _DynamicStrings(self, tag: int) -> List[str]:
    section = self._SectionOfType(_SHT_DYNAMIC)
    result = []
    if section is None:
      return result
    for pos in range(section.offset, section.offset + section.size, 16):
      d_tag, d_val = struct.unpack_from('<qQ', self.data, pos)
      if d_tag == _DT_NULL:
        break
      if d_tag == tag:
        result.append(self._LinkedString(section, d_val))
    return result

  def Needed(self) -> List[str]:
    """Returns the ``DT_NEEDED`` entries."""
    return self._DynamicStrings(_DT_NEEDED)

  def RunPaths(self) -> List[str]:
    """Returns the directories of ``DT_RUNPATH`` and ``DT_RPATH``."""
    paths = []
    for value in (self._DynamicStrings(_DT_RUNPATH) +
                  self._DynamicStrings(_DT_RPATH)):
      paths.extend(p for p in value.split(':') if p)
    return paths


def ReadVersionNeeds(path: str) -> List[VersionNeed]:
  """Returns the ``.gnu.version_r`` entries of the ELF file at path.

  Args:
    path: An ELF shared object.

  Returns:
    One VersionNeed per (library, version) pair the file requires.

  Raises:
    ElfError: If path is not a 64-bit little-endian ELF file.
  """
  return ElfFile.FromPath(path).VersionNeeds()


def ReadVersionDefinitions(path: str) -> List[str]:
  """Returns the version names an ELF shared object defines.

  Args:
    path: An ELF shared object, e.g. ``/lib/x86_64-linux-gnu/libc.so.6``.

  Returns:
    Version names such as ``GLIBC_2.36`` (without the soname base entry).

  Raises:
    ElfError: If path is not a 64-bit little-endian ELF file.
  """
  return ElfFile.FromPath(path).VersionDefinitions()


def WeakenVersions(path: str, version_names: Iterable[Tuple[str, str]]) -> int:
  """Marks version needs weak and unversions the symbols bound to them.

  Edits ``.gnu.version_r`` flags and ``.gnu.version`` entries in place (no
  sizes change), so that the dynamic linker accepts a host without those
  versions and may resolve the symbols from any loaded library. Idempotent.

  Args:
    path: The ELF file to edit.
    version_names: (library, version) pairs, e.g. ("libc.so.6", "GLIBC_2.38").

  Returns:
    The number of fields changed (0 if already done).

  Raises:
    ElfError: If path is not a supported ELF file.
  """
  wanted = set(version_names)
  elf = ElfFile.FromPath(path)
  data = bytearray(elf.data)
  changes = 0
  indices = set()
  for need in elf.VersionNeeds():
    if (need.file, need.name) not in wanted:
      continue
    indices.add(need.index)
    if not need.weak:
      struct.pack_into('<H', data, need.offset + 4, need.flags | _VER_FLG_WEAK)
      changes += 1
  for sym in elf.DynamicSymbols():
    if sym.undefined and sym.version_index in indices:
      struct.pack_into('<H', data, sym.versym_offset, VER_NDX_GLOBAL)
      changes += 1
  if changes:
    _AtomicWrite(path, bytes(data))
  return changes


def _AtomicWrite(path: str, data: bytes) -> None:
  """Replaces path with data, keeping its permissions."""
  mode = os.stat(path).st_mode & 0o7777
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix='.lc_')
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
