"""Helpers of the tests that run tools/ as subprocesses, as a user would.

The tools run from a scratch directory with the environment as it is (no
PYTHONPATH added), so the tests also check that a tool finds the repository
root by itself.
"""

import concurrent.futures
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ToolCommand(tool):
  """The command line that runs tools/<tool> with this interpreter."""
  return [sys.executable, os.path.join(ROOT, 'tools', tool)]


def RunToolInParallel(tool, runs, tmp, timeout, env_changes=None):
  """Runs `python tools/<tool>` once per entry of `runs`, a few at a time.

  As many runs at once as this process may use cores, in the order of
  `runs`: each imports TensorFlow and builds graphs, and a dozen of them at
  once on 2 cores took 40% more CPU time than one after the other (thread
  pools spinning against each other; train_test's runs: 209 s against 150).

  Args:
    tool: File name in tools/, e.g. 'plan.py'.
    runs: {name: argument list}; '{tmp}' in an argument becomes `tmp`.
    tmp: A scratch folder, also the tools' working directory.
    timeout: Seconds each run may take (it is killed after).
    env_changes: {variable: value, or None to remove it} applied to this
      environment (which has TF_CPP_MIN_LOG_LEVEL=2 unless set otherwise).

  Returns:
    {name: (exit code, stdout, stderr)} plus 'tmp': tmp.

  Raises:
    subprocess.TimeoutExpired: if a run takes longer than `timeout`.
  """
  env = dict(os.environ)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  for name, value in (env_changes or {}).items():
    if value is None:
      env.pop(name, None)
    else:
      env[name] = value

  def Run(args):
    proc = subprocess.run(
        ToolCommand(tool) + [a.format(tmp=tmp) for a in args], cwd=tmp,
        env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout, proc.stderr

  with concurrent.futures.ThreadPoolExecutor(
      len(os.sched_getaffinity(0))) as pool:
    futures = {name: pool.submit(Run, args) for name, args in runs.items()}
    results = {name: future.result() for name, future in futures.items()}
  results['tmp'] = tmp
  return results
