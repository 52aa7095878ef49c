"""Command line of the lingvo glibc repair: `python -m glibc_compat --venv DIR`.

Prints one line saying what was done (nothing, already patched, or which
libraries were patched with which symbols). Errors are one line on stderr;
the exit status is 1 for a failed repair, 2 for a missing compiler or
patchelf, 3 for symbols the shim cannot provide. argparse, not absl: the
repair runs before (and independently of) the packages it repairs.
"""

import argparse
import sys
from typing import Optional, Sequence

import glibc_compat
from glibc_compat import patcher


def Main(argv: Optional[Sequence[str]] = None) -> int:
  """Parses the command line and repairs or restores the venv.

  Args:
    argv: Command line arguments without the program name (None: sys.argv).

  Returns:
    The exit status.
  """
  parser = argparse.ArgumentParser(
      prog='python -m glibc_compat',
      description=glibc_compat.__doc__.split('\n\n')[0])
  parser.add_argument(
      '--venv', default='.venv',
      help='the virtualenv whose lingvo package to repair (default: .venv)')
  parser.add_argument(
      '--restore', action='store_true',
      help='undo an earlier repair: put the original libraries back and '
      'remove the shim')
  args = parser.parse_args(argv)
  try:
    print(patcher.Restore(args.venv) if args.restore else
          patcher.Repair(args.venv))
  except patcher.CompatError as e:
    print(e, file=sys.stderr)
    return e.exit_code
  return 0


if __name__ == '__main__':
  sys.exit(Main())
