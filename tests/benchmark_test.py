"""Tests of tools/benchmark.py, run as a subprocess like a user would.

One tiny end-to-end `memory` run (each configuration and budget probe is a
subprocess importing TensorFlow, several seconds each) plus error cases that
fail before any measurement. No timing or memory values are asserted. The
largest-model search is tested in-process on synthetic memory curves.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _LoadTool():
  """tools/benchmark.py as a module (it imports TensorFlow only in workers)."""
  spec = importlib.util.spec_from_file_location(
      'benchmark_tool', os.path.join(ROOT, 'tools', 'benchmark.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


benchmark = _LoadTool()

# Four configurations (plain + M=2 in every remat mode) of 4 FCLayers whose
# activations (1 MiB) are above the allocator statistics' 0.25 MiB
# resolution. Both 4-layer models fit the budget, so each search makes one
# probe (5 layers, the bound): the two run at once after the table.
TINY = [
    'memory', '--num_layers=4', '--dim=64', '--batch=4096', '--steps=1',
    '--micro_batches=2', '--remat=always,except_last,never',
    '--budget_micro_batches=2', '--budget_mib=100', '--budget_max_layers=5',
    '--parallel=4', '--json_out={tmp}/memory.json'
]

# name -> benchmark.py arguments ({tmp} is replaced by a temporary directory).
RUNS = {
    'tiny': TINY,
    'bad_subcommand': ['speedy', '--num_layers=4'],
    'no_subcommand': ['--num_layers=4'],
    'bad_layers': ['memory', '--num_layers=0'],
    'bad_remat': ['memory', '--remat=always,sometimes'],
    'bad_micro_batches': ['memory', '--batch=64', '--micro_batches=1,3'],
}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp('benchmark'))
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      [ROOT] + [p for p in [env.get('PYTHONPATH')] if p])
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  procs = {
      name: subprocess.Popen(
          [sys.executable, 'tools/benchmark.py'] +
          [a.format(tmp=tmp) for a in args],
          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True) for name, args in RUNS.items()
  }
  results = {}
  for name, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=600)
    results[name] = (proc.returncode, stdout, stderr)
  results['tmp'] = tmp
  return results


def testMemoryEndToEnd(runs):
  code, stdout, stderr = runs['tiny']
  assert code == 0, stderr
  assert 'model                       peak MiB  x plain   step s  x plain' \
      in stdout
  assert 'Largest model within 100.0 MiB' in stdout
  with open(os.path.join(runs['tmp'], 'memory.json')) as f:
    numbers = json.load(f)
  assert numbers['subcommand'] == 'memory'
  assert numbers['tf_version'].startswith('2.')
  assert numbers['flags']['num_layers'] == 4
  names = [row['name'] for row in numbers['rows']]
  assert names == [
      'plain', 'gpipe K=1 M=2 always', 'gpipe K=1 M=2 except_last',
      'gpipe K=1 M=2 never'
  ]
  for row in numbers['rows']:
    assert row['name'] in stdout
    assert row['peak_mib'] > 0 and row['step_s'] > 0, row
    assert row['peak_ratio'] > 0 and row['step_ratio'] > 0, row
    assert row['num_params'] == 4 * (64 * 64 + 64)
    assert len(row['runs']) == 1
  budget = numbers['budget']
  assert budget['budget_mib'] == 100
  assert budget['layer_ratio'] == 1 and budget['param_ratio'] == 1
  for name in ('plain', 'gpipe'):
    result = budget[name]
    assert result['num_layers'] == 5 and result['capped'], result
    assert result['num_params'] == 5 * (64 * 64 + 64)
    assert set(result['probes']) == {'4', '5'}, result
    assert result['probe_runs']['5']['peak_mib'] > 0
  assert f'{numbers["subprocesses"]} subprocesses' in stdout


@pytest.mark.parametrize('name, message', [
    ('bad_subcommand', "subcommand 'speedy' is not valid; use one of "
     "['memory']"),
    ('no_subcommand', 'subcommand none is not valid'),
    ('bad_layers', '--num_layers=0'),
    ('bad_remat', "--remat=always,sometimes: 'sometimes' is not one of"),
    ('bad_micro_batches', '--micro_batches: M=3 does not divide --batch=64'),
])
def testErrors(runs, name, message):
  code, stdout, stderr = runs[name]
  assert code != 0
  errors = [l for l in stderr.splitlines()
            if l.startswith('benchmark.py: error:')]
  assert len(errors) == 1, stderr
  assert message in errors[0]
  assert 'Traceback' not in stderr
  assert not stdout


def _Search(peak_fn, budget, max_layers, known=None):
  """LargestUnderBudget on a synthetic curve; returns (answer, probes)."""
  probes = []

  def Measure(n):
    assert 1 <= n <= max_layers and n not in probes, (n, probes)
    probes.append(n)
    return peak_fn(n)

  answer, points = benchmark.LargestUnderBudget(Measure, budget, max_layers,
                                                known or {})
  assert set(probes) <= set(points)
  return answer, probes


@pytest.mark.parametrize('peak_fn, budget, max_layers, known, expected, '
                         'max_probes', [
    # Linear, like measured memory (GPipe M=8: 46.5 MiB + 2.5 MiB per layer).
    (lambda n: 46.5 + 2.5 * n, 276, 256, {32: 126.5}, 91, 3),
    (lambda n: 8 + 17 * n, 276, 256, {32: 552}, 15, 3),
    (lambda n: 8 + 17 * n, 276, 256, None, 15, 4),
    # Not linear, quantized: galloping and bisection keep the probes
    # logarithmic.
    (lambda n: n * n, 1000, 256, None, 31, 12),
    (lambda n: 0.25 * math.ceil(n * n / 7), 300, 256, {200: 1e4}, 91, 12),
    (lambda n: 2 ** n, 1e6, 256, None, 19, 14),
    # Nothing fits; everything fits (capped by max_layers).
    (lambda n: 100 + n, 50, 256, None, 0, 3),
    (lambda n: 1 + n, 1e9, 64, {4: 5}, 64, 2),
    (lambda n: 1 + n, 1e9, 3, {4: 5}, 3, 0),
])
def testLargestUnderBudget(peak_fn, budget, max_layers, known, expected,
                           max_probes):
  answer, probes = _Search(peak_fn, budget, max_layers, known)
  assert answer == expected, probes
  assert len(probes) <= max_probes, probes
