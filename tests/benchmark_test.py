"""Tests of tools/benchmark.py and the benchmarks package.

tools/benchmark.py runs as a subprocess like a user would: one tiny
end-to-end `memory`, `speed` and `scale` run each and a `schedules` run of
two of its comparisons (each configuration and budget probe is a worker
process importing TensorFlow, several seconds each) plus error cases that
fail before any measurement. Times are not compared
with bounds; the tables' ratios and rates are checked against the measured
numbers, re-materialization against no re-materialization in memory, and
HLO line counts, which are deterministic, against each other. The
largest-model search (`benchmarks.memory`) is tested in-process on synthetic
memory curves.
"""

import json
import math
import os

import pytest

from benchmarks import host
from benchmarks import memory
import tool_util

# Four configurations (plain + M=8 in every remat mode) of 4 FCLayers whose
# activations (1 MiB) are above the allocator statistics' 0.25 MiB
# resolution. M=8: a micro-batch's recompute may overlap the backward of the
# next (both kept), so at M=2 remat's saving was within the step's spread
# (7.1 to 9.1 MiB 'always' against 8.5 to 9.1 'never'); at M=8 it is 5.9
# against 8.2 to 8.7. Both 4-layer models fit the budget, so each search
# makes one probe (5 layers, the bound): the two run at once after the table.
TINY = [
    'memory', '--num_layers=4', '--dim=64', '--batch=4096', '--steps=1',
    '--micro_batches=8', '--remat=always,except_last,never',
    '--budget_micro_batches=8', '--budget_mib=100', '--budget_max_layers=5',
    '--parallel=4', '--json_out={tmp}/memory.json'
]

# One shape, K = 2 and M = 4: 7 worker processes (each engine in graph,
# function and XLA mode, and Lingvo), two at a time. That the loop's HLO does
# not grow with M is tested in-process (loop_test.py).
TINY_SCALE = [
    'scale', '--num_layers=2', '--dim=8', '--batch=8', '--scale_stages=2',
    '--scale_micro_batches=4', '--steps=1', '--parallel=2',
    '--png_out={tmp}/scale.png', '--json_out={tmp}/scale.json'
]

# Five configurations (plain, GPipe remat='never' at K=1, M=1, and GPipe,
# Lingvo and GPipe in tf.function at K=2, M=2), two at a time.
TINY_SPEED = [
    'speed', '--num_layers=2', '--dim=16', '--batch=16', '--speed_stages=2',
    '--speed_micro_batches=2', '--steps=1', '--repeats=1', '--parallel=2'
]

# name -> benchmark.py arguments ({tmp} is replaced by a temporary directory).
RUNS = {
    'tiny': TINY,
    'speed': TINY_SPEED + ['--json_out={tmp}/speed.json'],
    'scale': TINY_SCALE,
    'bad_engines': ['memory', '--engines=unrolled,fast'],
    'bad_scale_stages': ['scale', '--num_layers=2', '--scale_stages=3'],
    'bad_subcommand': ['speedy', '--num_layers=4'],
    'no_subcommand': ['--num_layers=4'],
    'bad_layers': ['memory', '--num_layers=0'],
    'bad_remat': ['memory', '--remat=always,sometimes'],
    'bad_micro_batches': ['memory', '--batch=64', '--micro_batches=1,3'],
    'bad_speed_micro_batches': ['speed', '--batch=64',
                                '--speed_micro_batches=1,3'],
    'bad_speed_stages': ['speed', '--num_layers=2', '--speed_stages=1,4'],
    # The zb1p peak against 1F1B's at tiny sizes, each stage in a pinned
    # server process: 2 configurations, 1 round.
    'schedules': ['schedules', '--schedules_small',
                  "--schedules_match=zb1p / 1F1B peak, K=2 M=8 ('never', a "
                  'process', '--repeats=1', '--parallel=2',
                  '--json_out={tmp}/schedules.json'],
    'bad_schedules_match': ['schedules', '--schedules_match=K=3 M=5'],
}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  return tool_util.RunToolInParallel(
      'benchmark.py', RUNS, str(tmp_path_factory.mktemp('benchmark')),
      timeout=600)


@pytest.mark.slow
def testMemoryEndToEnd(runs):
  code, stdout, stderr = runs['tiny']
  assert code == 0, stderr
  assert ('model                               peak MiB  x plain   step s  '
          'x plain') in stdout
  assert 'Largest model within 100.0 MiB' in stdout
  with open(os.path.join(runs['tmp'], 'memory.json')) as f:
    numbers = json.load(f)
  assert numbers['subcommand'] == 'memory'
  assert numbers['tf_version'].startswith('2.')
  # What the figures depend on, as the workers saw it: this process runs with
  # the workers' environment (conftest.py), so it sees the same oneDNN.
  assert numbers['host'] == {
      'cpu': host.CpuModel(), 'cores': os.cpu_count(),
      'onednn': host.OneDnnEnabled(), 'allocator': 'bfc'}
  assert f'Measured on {host.Summary(numbers["host"])}.' in stdout
  assert numbers['flags']['num_layers'] == 4
  rows = {row['name']: row for row in numbers['rows']}
  assert list(rows) == [
      'plain', 'gpipe unrolled K=1 M=8 always',
      'gpipe unrolled K=1 M=8 except_last', 'gpipe unrolled K=1 M=8 never'
  ]
  plain = rows['plain']
  # 4 layers of 4096 x 64 floats (1 MiB each): the plain step holds them all.
  assert plain['peak_mib'] > 4
  for row in rows.values():
    assert row['name'] in stdout
    assert row['step_s'] > 0, row
    # The ratios in the table are those of the measured numbers.
    assert row['peak_ratio'] == pytest.approx(row['peak_mib'] /
                                              plain['peak_mib'])
    assert row['step_ratio'] == pytest.approx(row['step_s'] / plain['step_s'])
    assert row['num_params'] == 4 * (64 * 64 + 64)
    assert len(row['runs']) == 1
  # Without re-materialization a step keeps 4 layers' activations of all 8
  # micro-batches (4 MiB); with it, the 8 inputs (1 MiB) and the activations
  # of at most 2 micro-batches (1 MiB): at least 1 MiB less.
  assert (rows['gpipe unrolled K=1 M=8 always']['peak_mib'] + 1 <=
          rows['gpipe unrolled K=1 M=8 never']['peak_mib']), rows
  budget = numbers['budget']
  assert budget['budget_mib'] == 100
  assert budget['layer_ratio'] == 1 and budget['param_ratio'] == 1
  for name in ('plain', 'gpipe'):
    result = budget[name]
    assert result['num_layers'] == 5 and result['capped'], result
    assert result['num_params'] == 5 * (64 * 64 + 64)
    assert set(result['probes']) == {'4', '5'}, result
    # The answer's measured peak is within the budget.
    assert 0 < result['probes']['5'] <= budget['budget_mib'], result
    assert result['probes']['5'] == result['probe_runs']['5']['peak_mib']
  assert f'{numbers["subprocesses"]} subprocesses' in stdout


@pytest.mark.slow
def testSpeedEndToEnd(runs):
  code, stdout, stderr = runs['speed']
  assert code == 0, stderr
  assert ('  K   M  ours s Lingvo s ours/Lingvo ours/plain ours build Lingvo '
          'build build ratio  tf.fn s ours MiB Lingvo MiB tf.fn MiB'
         ) in stdout
  assert 'ours K=1 M=1 remat=never: step' in stdout
  with open(os.path.join(runs['tmp'], 'speed.json')) as f:
    numbers = json.load(f)
  assert numbers['subcommand'] == 'speed'
  assert numbers['flags']['num_layers'] == 2
  assert numbers['flags']['speed_stages'] == [2]
  assert [(r['stages'], r['micro_batches']) for r in numbers['rows']] == [
      (2, 2)]
  assert numbers['subprocesses'] == 5
  measured = [numbers['plain'], numbers['gpipe_never']]
  for row in numbers['rows']:
    # The ratios and rates in the table are those of the measured times.
    gpipe, lingvo = row['gpipe'], row['lingvo']
    assert row['step_ratio_lingvo'] == pytest.approx(gpipe['step_s'] /
                                                     lingvo['step_s'])
    assert row['step_ratio_plain'] == pytest.approx(
        gpipe['step_s'] / numbers['plain']['step_s'])
    assert row['build_ratio_lingvo'] == pytest.approx(gpipe['build_s'] /
                                                      lingvo['build_s'])
    for variant in ('gpipe', 'lingvo', 'gpipe_function'):
      measured.append(row[variant])
      assert row['examples_per_s'][variant] == pytest.approx(
          16 / row[variant]['step_s'])  # --batch=16.
  assert [m['name'] for m in measured] == [
      'plain', 'gpipe unrolled K=1 M=1 never',
      'gpipe unrolled K=2 M=2 always', 'lingvo K=2 M=2',
      'gpipe unrolled K=2 M=2 always function'
  ]
  for m in measured:
    for key in ('step_s', 'warmup_s', 'build_s'):
      assert m[key] > 0, m
    # The peak is the allocator's high mark after a reset to what was in use
    # (the resident bytes); during the step, at least the first layer's
    # output on the batch (16 x 16 floats) is allocated beside them.
    assert m['peak_mib'] >= m['resident_mib'] + 16 * 16 * 4 / 2**20, m
  for m in numbers['measurements']:
    assert m['num_params'] == 2 * (16 * 16 + 16)
    assert len(m['runs']) == 1


@pytest.mark.slow
def testScaleEndToEnd(runs):
  """Both engines and Lingvo: the table, the picture and the targets."""
  code, stdout, stderr = runs['scale']
  assert code == 0, stderr
  assert ' K    M |     HLO lines | tf.fn first s |' in stdout
  assert 'Targets:' in stdout and '<= 1 at every (K, M)' in stdout
  assert os.path.getsize(os.path.join(runs['tmp'], 'scale.png')) > 10000
  with open(os.path.join(runs['tmp'], 'scale.json')) as f:
    numbers = json.load(f)
  assert numbers['subprocesses'] == 7
  rows = numbers['rows']
  assert [(r['stages'], r['micro_batches']) for r in rows] == [(2, 4)]
  for row in rows:
    assert row['auto_engine'] == 'unrolled'  # M < 16.
    assert row['best_engine'] in ('unrolled', 'loop')
    assert row['auto_cost_ratio'] >= 1.0
    for impl in ('unrolled', 'loop', 'lingvo'):
      assert row[impl]['step_s'] > 0 and row[impl]['build_s'] > 0, row
    for engine in ('unrolled', 'loop'):  # Its tf.function and XLA runs.
      measured = row[engine]
      assert measured['function_trace_first_s'] > 0, row
      assert measured['xla_first_s'] > 0 and measured['hlo_lines'] > 100, row
  assert {t['target'] for t in numbers['targets']} >= {
      'loop graph build / Lingvo <= 1 at every (K, M)',
      'loop step / Lingvo <= 1 at every (K, M)'}


@pytest.mark.slow
def testSchedulesMeasuresTheMatchingComparisons(runs):
  code, stdout, stderr = runs['schedules']
  assert code == 0, stderr[-2000:]
  with open(os.path.join(runs['tmp'], 'schedules.json')) as f:
    numbers = json.load(f)
  name = ("zb1p / 1F1B peak, K=2 M=8 ('never', a process per stage: the "
          'largest)')
  assert [r['name'] for r in numbers['rows']] == [name]
  assert numbers['repeats'] == 1
  (row,) = numbers['rows']
  assert row['target'] == 1.10
  assert name in stdout
  # Each stage in a server of its own, whose allocator the server reads: the
  # peak is the largest server's in the step where it is largest.
  assert [m['name'] for m in numbers['measured']] == [
      f'gpipe {s} K=2 M=8 never a process per stage' for s in ('zb1p', '1f1b')]
  for measured, value in zip(numbers['measured'],
                             (row['value'], row['reference'])):
    assert measured['config']['processes'] and measured['step_s'] > 0
    (run,) = measured['runs']
    device_peaks = run['device_peaks_mib']
    assert len(device_peaks) == 3 and all(len(s) == 2 for s in device_peaks)
    # Weights and the optimizer's state stay between steps; a step's
    # activations come on top.
    assert min(min(s) for s in device_peaks) > run['resident_mib'] > 0, run
    assert run['peak_mib'] == max(max(s) for s in device_peaks) == value
  assert ('gpipe zb1p K=2 M=8 never a process per stage, 8 layers: peak '
          in stderr)  # The progress lines.


@pytest.mark.slow
@pytest.mark.parametrize('name, message', [
    ('bad_subcommand', "subcommand 'speedy' is not valid; use one of "
     "['keras', 'memory', 'scale', 'schedules', 'speed']"),
    ('bad_engines', "--engines=unrolled,fast: 'fast' is not one of "
     "['unrolled', 'loop']"),
    ('bad_scale_stages', 'scale: --scale_stages: K=3 is more than '
     '--num_layers=2'),
    ('no_subcommand', 'subcommand none is not valid'),
    ('bad_layers', '--num_layers=0'),
    ('bad_remat', "--remat=always,sometimes: 'sometimes' is not one of"),
    ('bad_micro_batches', '--micro_batches: M=3 does not divide --batch=64'),
    ('bad_speed_micro_batches',
     'speed: --speed_micro_batches: M=3 does not divide --batch=64'),
    ('bad_speed_stages', 'speed: --speed_stages: K=4 is more than '
     '--num_layers=2'),
    ('bad_schedules_match', "--schedules_match='K=3 M=5' is in no "
     "comparison's name; the names are ['loop / unrolled step, K=4 M=64"),
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

  answer, points = memory.LargestUnderBudget(Measure, budget, max_layers,
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


def _Node(step_stats, device, name, inputs, start, end, ptr, size,
          allocations=()):
  """Adds a traced node with one output (buffer `ptr` of `size` bytes)."""
  dev = next((d for d in step_stats.dev_stats if d.device == device), None)
  if dev is None:
    dev = step_stats.dev_stats.add(device=device)
  node = dev.node_stats.add(
      node_name=name, all_start_micros=start, all_end_rel_micros=end - start,
      timeline_label=f'{name} = Op({", ".join(inputs)})')
  description = node.output.add().tensor_description.allocation_description
  description.ptr, description.allocated_bytes = ptr, size
  if allocations:
    memory = node.memory.add(allocator_name='cpu')
    for micros, size_or_release in allocations:
      memory.allocation_records.add(alloc_micros=micros,
                                    alloc_bytes=size_or_release)


def testDevicePeaksHoldACopyOfWhatADeviceReadsFromAnother():
  # pylint: disable=g-import-not-at-top
  from tensorflow.core.framework import step_stats_pb2
  from benchmarks import plan_worker
  # pylint: enable=g-import-not-at-top
  stats = step_stats_pb2.StepStats()
  cpu0, cpu1 = '/device:CPU:0', '/device:CPU:1'
  # CPU:0 makes buffer 0x10 (100 bytes), frees it at t=90; CPU:1 reads it
  # through a view from t=10 to t=50, and allocates 30 bytes of its own.
  _Node(stats, cpu0, 'x', [], 0, 5, 0x10, 100, [(0, 100), (90, -100)])
  _Node(stats, cpu1, 'view', ['x'], 10, 12, 0x10, 100)
  _Node(stats, cpu1, 'use', ['view'], 40, 50, 0x20, 30, [(40, 30), (60, -30)])
  # Later the allocator gives address 0x10 to CPU:1's own 40 bytes: no copy.
  _Node(stats, cpu1, 'own', [], 100, 101, 0x10, 40, [(100, 40), (110, -40)])
  _Node(stats, cpu1, 'reuse', ['own'], 105, 108, 0x30, 8, [(105, 8), (108, -8)])
  # CPU:1's 20 bytes at 0x70 are released at t=125; at t=130 a node of
  # CPU:0 outputs that address without an allocation of its own (another
  # node allocated it): not a copy of CPU:1's buffer.
  _Node(stats, cpu1, 'gone', [], 120, 122, 0x70, 20, [(120, 20), (125, -20)])
  _Node(stats, cpu0, 'reused', [], 130, 135, 0x70, 20)
  peaks = plan_worker.DevicePeaks(stats)
  assert peaks[cpu0] == {'peak': 100.0, 'allocated': 100.0, 'end': 0.0,
                         'received': 0.0}
  assert peaks[cpu1] == {'peak': 130.0, 'allocated': 198.0, 'end': 0.0,
                         'received': 100.0}


def testPinnedStagesHoldTheirOwnWeights():
  """zbv's V: cells 0-1 and 6-7 on stage 0, cells 2-5 on stage 1."""
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  from benchmarks import models
  from benchmarks import runner
  # pylint: enable=g-import-not-at-top
  config = runner.Config('gpipe', 8, 16, 32, 1, 4, 'never', stages=2,
                         schedule='zbv', virtual_stages=2)
  devices = ['/device:CPU:0', '/device:CPU:1']
  with tf.Graph().as_default():
    model = models.BuildModelWithWeightsOnStages(config, devices)
    placed = {v.name: v.device for v in model.vars.Flatten()}
  assert placed == {
      f'model/fc{i}/{w}/var:0': devices[1 if 2 <= i < 6 else 0]
      for i in range(8) for w in ('w', 'b')}
