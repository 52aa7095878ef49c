"""Plumbing shared by the tools: subcommands, one-line errors, JSON output.

Every tool is an absl app whose first positional argument names a subcommand
(a function of the remaining arguments returning a JSON-ready dict, or None).
Bad flags and errors the tool expects print one line and exit with status 2.

    SUBCOMMANDS = {'partition': Partition, 'simulate': Simulate}
    if __name__ == '__main__':
      cli.Run('plan.py', SUBCOMMANDS, (PlanError,), 'plan.py partition ...')
"""

import json
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

from absl import app
from absl import flags

from lingvo_gpipe.planning import checks

Subcommand = Callable[[Sequence[str]], Optional[Dict[str, Any]]]


def Fail(prog: str, message: str) -> None:
  """Prints `prog: error: message` on one line and exits with status 2."""
  print(f'{prog}: error: {" ".join(str(message).split())}', file=sys.stderr)
  sys.exit(2)


def CheckRegisteredModel(prog: str, name: str) -> None:
  """A one-line error unless `name` is a model in Lingvo's registry."""
  from lingvo import model_registry  # pylint: disable=g-import-not-at-top
  try:
    model_registry.GetClass(name)
  except LookupError:
    known = sorted(model_registry.GetAllRegisteredClasses())
    Fail(prog, f'--model={name!r} is not a registered model; registered: '
         f'{", ".join(k for k in known if not k.startswith("test."))}.')


def FlagsParser(prog: str) -> Callable[[List[str]], List[str]]:
  """An absl `flags_parser` that turns a bad flag into a one-line error."""

  def ParseFlags(argv: List[str]) -> List[str]:
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      Fail(prog, e)

  return ParseFlags


def PositiveIntsFlag(name: str,
                     error: Type[Exception]) -> Optional[List[int]]:
  """The list flag `--name` as positive ints (`checks.PositiveInts`).

  Args:
    name: The flag's name, e.g. 'num_stages'.
    error: The tool's error type, raised instead of checks' ValueError so that
      `Run` prints it on one line.

  Returns:
    The ints, or None if the flag is not set.

  Raises:
    error: naming the flag, its value and the entry that is not a positive
      int (or saying that the list is empty).
  """
  values = flags.FLAGS[name].value
  if values is None:
    return None
  try:
    return checks.PositiveInts(f'--{name}', values)
  except ValueError as e:
    raise error(str(e)) from e


def Run(prog: str, subcommands: Dict[str, Subcommand],
        errors: Tuple[Type[Exception], ...], example: str) -> None:
  """Parses flags, runs the named subcommand and writes --json_out.

  Args:
    prog: The tool's name in messages, e.g. 'plan.py'.
    subcommands: Name -> function; names starting with '_' are internal and
      not listed in the error for an unknown subcommand.
    errors: Exception types that become one-line errors.
    example: An example command line for the unknown-subcommand error.
  """
  flags.DEFINE_string(
      'json_out', None, 'If set, also write the numbers the subcommand '
      'computed or measured (every row, event and setting) as JSON there.')

  def Main(argv: List[str]) -> None:
    public = sorted(name for name in subcommands if not name.startswith('_'))
    if len(argv) < 2 or argv[1] not in subcommands:
      given = repr(argv[1]) if len(argv) > 1 else 'none'
      Fail(prog, f'subcommand {given} is not valid; use one of {public}, '
           f'e.g. {example}.')
    try:
      numbers = subcommands[argv[1]](argv[2:])
    except errors as e:
      Fail(prog, f'{argv[1]}: {e}')
    if numbers is not None and flags.FLAGS.json_out:
      with open(flags.FLAGS.json_out, 'w') as f:
        json.dump(numbers, f, indent=2)
      print(f'Wrote {flags.FLAGS.json_out}')

  app.run(Main, flags_parser=FlagsParser(prog))
