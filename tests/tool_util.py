"""Helpers of the tests that run tools/ as subprocesses, as a user would.

The tools run from a scratch directory with the environment as it is (no
PYTHONPATH added), so the tests also check that a tool finds the repository
root by itself.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ToolCommand(tool):
  """The command line that runs tools/<tool> with this interpreter."""
  return [sys.executable, os.path.join(ROOT, 'tools', tool)]


def RunToolInParallel(tool, runs, tmp, timeout, env_changes=None):
  """Runs `python tools/<tool>` once per entry of `runs`, all at once.

  Args:
    tool: File name in tools/, e.g. 'plan.py'.
    runs: {name: argument list}; '{tmp}' in an argument becomes `tmp`.
    tmp: A scratch folder, also the tools' working directory.
    timeout: Seconds each run may take.
    env_changes: {variable: value, or None to remove it} applied to this
      environment (which has TF_CPP_MIN_LOG_LEVEL=2 unless set otherwise).

  Returns:
    {name: (exit code, stdout, stderr)} plus 'tmp': tmp.
  """
  env = dict(os.environ)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  for name, value in (env_changes or {}).items():
    if value is None:
      env.pop(name, None)
    else:
      env[name] = value
  procs = {
      name: subprocess.Popen(
          ToolCommand(tool) + [a.format(tmp=tmp) for a in args],
          cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True) for name, args in runs.items()
  }
  results = {'tmp': tmp}
  try:
    for name, proc in procs.items():
      stdout, stderr = proc.communicate(timeout=timeout)
      results[name] = (proc.returncode, stdout, stderr)
  finally:  # A run that timed out (or a failure here) leaves nothing behind.
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return results
