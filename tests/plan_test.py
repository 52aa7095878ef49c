"""Tests of tools/plan.py, run as a subprocess like a user would."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> plan.py arguments ({tmp} is replaced by a temporary directory).
# Each run imports TensorFlow and Lingvo (seconds), so all start at once.
RUNS = {
    'costs': [
        'partition', '--costs=1,4,4,4,4,8', '--num_stages=3',
        '--memory=1,1,1,1,1,2', '--json_out={tmp}/costs.json'
    ],
    'transformer': [
        'partition', '--example=transformer', '--json_out={tmp}/tr.json'
    ],
    'bad_costs': ['partition', '--costs=1,x,3', '--num_stages=2'],
    'bad_float': ['partition', '--costs=1,2', '--num_stages=2',
                  '--memory_limit=abc'],
    'bad_subcommand': ['plot', '--costs=1,2', '--num_stages=2'],
}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp('plan'))
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      [ROOT] + [p for p in [env.get('PYTHONPATH')] if p])
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  procs = {
      name: subprocess.Popen(
          [sys.executable, 'tools/plan.py'] +
          [a.format(tmp=tmp) for a in args],
          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True) for name, args in RUNS.items()
  }
  results = {}
  for name, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=300)
    results[name] = (proc.returncode, stdout, stderr)
  results['tmp'] = tmp
  return results


def _Summary(stdout):
  """{K: (ours, lingvo)} from the 'K=..: imbalance ours .., Lingvo ..' lines."""
  return {
      int(k): (float(ours), float(lingvo)) for k, ours, lingvo in re.findall(
          r'^K=(\d+): imbalance ours ([\d.]+), Lingvo ([\d.]+)$', stdout,
          re.MULTILINE)
  }


def testCostList(runs):
  code, stdout, stderr = runs['costs']
  assert code == 0, stderr
  assert _Summary(stdout) == {3: (1.080, 1.440)}
  assert 'Partition [3, 2, 1]:' in stdout
  assert 'imbalance (largest stage / ideal): 1.080, largest stage memory: 3'\
      in stdout
  with open(os.path.join(runs['tmp'], 'costs.json')) as f:
    numbers = json.load(f)
  assert numbers['subcommand'] == 'partition'
  assert numbers['costs'] == [1, 4, 4, 4, 4, 8]
  (result,) = numbers['results']
  assert result['num_stages'] == 3
  assert result['ours']['partition'] == [3, 2, 1]
  assert result['ours']['stage_costs'] == [9, 8, 8]
  assert result['ours']['stage_memory'] == [3, 2, 2]
  assert result['ours']['cells'] == ['cell0 .. cell2', 'cell3 .. cell4',
                                     'cell5']
  assert result['ours']['imbalance'] == pytest.approx(9 / (25 / 3))
  assert result['lingvo']['partition'] == [2, 2, 2]  # Costs 5, 8, 12.


def testTransformerExample(runs):
  code, stdout, stderr = runs['transformer']
  assert code == 0, stderr
  # K = 4: ours is clearly better; K = 8: both are bounded by the softmax.
  assert _Summary(stdout) == {4: (1.005, 1.141), 8: (1.141, 1.141)}
  assert '  softmax' in stdout and 'embedding .. layer' in stdout
  with open(os.path.join(runs['tmp'], 'tr.json')) as f:
    numbers = json.load(f)
  assert numbers['source'] == 'transformer'
  assert len(numbers['costs']) == 26
  by_k = {r['num_stages']: r for r in numbers['results']}
  assert by_k[4]['ours']['imbalance'] == pytest.approx(1.00535, abs=1e-5)
  assert by_k[4]['lingvo']['imbalance'] == pytest.approx(1.14082, abs=1e-5)
  assert sum(by_k[8]['ours']['partition']) == 26


@pytest.mark.parametrize('name, message', [
    ('bad_costs', "--costs=1,x,3: 'x' is not a finite non-negative number"),
    ('bad_float', '--memory_limit=abc'),
    ('bad_subcommand', "subcommand 'plot' is not valid; use one of "
     "['partition']"),
])
def testErrors(runs, name, message):
  code, stdout, stderr = runs[name]
  assert code != 0
  errors = [l for l in stderr.splitlines() if l.startswith('plan.py: error:')]
  assert len(errors) == 1, stderr
  assert message in errors[0]
  assert 'Traceback' not in stderr
  assert not stdout
