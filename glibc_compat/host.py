"""What the host's system libraries provide: glibc and libstdc++ versions.

Finds a system library as the dynamic loader would (``LD_LIBRARY_PATH``, the
``ldconfig`` cache, the usual directories) and reads the symbol versions it
defines, so that a prebuilt library's version needs can be checked against
this host:

    host = HostVersions()
    'GLIBC_2.38' in host.Provides('libc.so.6', machine)   # False on Debian 12

Standard library only.
"""

import os
import subprocess
from typing import Dict, List, Optional, Set, Tuple

from glibc_compat import elf

_LIBRARY_DIRS = ('/lib/x86_64-linux-gnu', '/usr/lib/x86_64-linux-gnu',
                 '/lib/aarch64-linux-gnu', '/usr/lib/aarch64-linux-gnu',
                 '/lib64', '/usr/lib64', '/lib', '/usr/lib')


def _LdconfigPaths(soname: str) -> List[str]:
  """Returns the paths ``ldconfig -p`` lists for soname."""
  for ldconfig in ('ldconfig', '/sbin/ldconfig', '/usr/sbin/ldconfig'):
    try:
      out = subprocess.run([ldconfig, '-p'],
                           capture_output=True,
                           text=True,
                           check=False).stdout
    except OSError:
      continue
    paths = []
    for line in out.splitlines():
      parts = line.strip().split(' => ')
      if len(parts) == 2 and parts[0].split(' ')[0] == soname:
        paths.append(parts[1].strip())
    return paths
  return []


def FindHostLibrary(soname: str, machine: int) -> Optional[str]:
  """Finds the host's copy of a system library, as the loader would.

  Args:
    soname: E.g. ``libc.so.6``.
    machine: ELF ``e_machine`` the library must have (that of its user).

  Returns:
    The path, or None if not found.
  """
  candidates = []
  for directory in os.environ.get('LD_LIBRARY_PATH', '').split(':'):
    if directory:
      candidates.append(os.path.join(directory, soname))
  candidates.extend(_LdconfigPaths(soname))
  candidates.extend(os.path.join(d, soname) for d in _LIBRARY_DIRS)
  for candidate in candidates:
    if not os.path.isfile(candidate):
      continue
    try:
      if elf.ElfFile.FromPath(candidate).machine == machine:
        return os.path.realpath(candidate)
    except (elf.ElfError, OSError):
      continue
  return None


class HostVersions:
  """Caches the version definitions of host libraries."""

  def __init__(self):
    self._cache: Dict[Tuple[str, int], Optional[Set[str]]] = {}

  def Provides(self, soname: str, machine: int) -> Optional[Set[str]]:
    """Returns the versions the host's soname defines.

    Args:
      soname: E.g. ``libstdc++.so.6``.
      machine: ELF ``e_machine`` of the library that needs it.

    Returns:
      A set of version names, or None if the library is not a host library
      (not found, e.g. ``libtensorflow_framework.so.2``).
    """
    key = (soname, machine)
    if key not in self._cache:
      path = FindHostLibrary(soname, machine)
      versions = None
      if path is not None:
        try:
          versions = set(elf.ReadVersionDefinitions(path))
        except elf.ElfError:
          versions = None
      self._cache[key] = versions
    return self._cache[key]


def GlibcVersion() -> str:
  """Returns the host's glibc version, e.g. ``2.36`` (or ``unknown``)."""
  try:
    value = os.confstr('CS_GNU_LIBC_VERSION') or ''
  except (ValueError, OSError):
    value = ''
  return value.split()[-1] if value else 'unknown'


def VersionKey(name: str) -> Tuple[int, ...]:
  """Sort key of a version name: ``GLIBCXX_3.4.30`` -> (3, 4, 30)."""
  tail = name.split('_', 1)[-1]
  return tuple(int(p) if p.isdigit() else 0 for p in tail.split('.'))


def GlibcxxVersion(host: HostVersions, machine: int) -> str:
  """Returns the newest GLIBCXX_* version of the host's libstdc++."""
  versions = host.Provides('libstdc++.so.6', machine) or set()
  best = max((v for v in versions if v.startswith('GLIBCXX_3')),
             key=VersionKey,
             default=None)
  return best or 'no libstdc++'
