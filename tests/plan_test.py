"""Tests of tools/plan.py, run as a subprocess like a user would."""

import json
import os
import re

import pytest

from benchmarks import host
from lingvo_gpipe.planning import schedule
from lingvo_gpipe.planning import simulate
import tool_util

# Every test reads the runs of plan.py subprocesses.
pytestmark = pytest.mark.slow


# name -> plan.py arguments ({tmp} is replaced by a temporary directory).
# The cores the tools may run on (--processes pins a stage to each).
_CORES = len(os.sched_getaffinity(0))
# Each run imports TensorFlow and Lingvo (seconds): they run side by side.
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
    'simulate': [
        'simulate', '--forward_costs=1', '--num_stages=4',
        '--num_micro_batches=8', '--json_out={tmp}/sim.json',
        '--png_out={tmp}/sim.png', '--trace_out={tmp}/sim_trace.json'
    ],
    'simulate_uneven': [
        'simulate', '--forward_costs=1,3', '--backward_costs=2,4',
        '--num_micro_batches=2', '--remat=never', '--input_memory=10',
        '--activation_memory=100,300'
    ],
    # Transfers that occupy both stages (simulate_test's hand-made case).
    'simulate_busy': [
        'simulate', '--forward_costs=1', '--backward_costs=2',
        '--num_stages=2', '--num_micro_batches=2', '--remat=never',
        '--transfer_cost=0.5', '--transfers_busy'
    ],
    # ZB-V's per-device loops (a TF1 graph) with busy transfers, timed as
    # dataflow.
    'simulate_zbv_per_device': [
        'simulate', '--schedule=zbv', '--num_stages=2', '--virtual_stages=2',
        '--num_micro_batches=4', '--remat=never', '--forward_costs=15',
        '--backward_costs=23', '--weight_costs=11.5', '--transfer_cost=2',
        '--transfers_busy', '--executor=per_device',
        '--json_out={tmp}/zbv.json'
    ],
    # A real traced step: 2 stages on 2 CPU devices, 3 micro-batches.
    'timeline': [
        'timeline', '--num_stages=2', '--num_micro_batches=3',
        '--cells_per_stage=1', '--fc_dim=8', '--micro_batch_size=2',
        '--warmup_steps=1', '--png_out={tmp}/timeline.png',
        '--trace_out={tmp}/timeline.json', '--json_out={tmp}/tl_numbers.json'
    ],
    # Circular: 4 chunks on 2 devices, each half a stage.
    'simulate_circular': [
        'simulate', '--forward_costs=0.5', '--num_stages=2',
        '--virtual_stages=2', '--num_micro_batches=2', '--engine=loop',
        '--json_out={tmp}/circular.json', '--trace_out={tmp}/circular.json.trace'
    ],
    # The loop engine, and a circular step on it.
    'timeline_loop': [
        'timeline', '--num_stages=2', '--num_micro_batches=16',
        '--engine=loop', '--cells_per_stage=1', '--fc_dim=8',
        '--micro_batch_size=1', '--warmup_steps=1',
        '--json_out={tmp}/tl_loop.json'
    ],
    'timeline_circular': [
        'timeline', '--num_stages=2', '--virtual_stages=2',
        '--num_micro_batches=4', '--engine=loop', '--cells_per_stage=1',
        '--fc_dim=8', '--micro_batch_size=2', '--warmup_steps=1',
        '--json_out={tmp}/tl_circular.json'
    ],
    # 1F1B: the loss in a last cell, forwards and backwards in one pass;
    # each stage in a process of its own, pinned to a core.
    'timeline_1f1b': [
        'timeline', '--num_stages=2', '--num_micro_batches=4',
        '--schedule=1f1b', '--remat=never', '--cells_per_stage=1',
        '--fc_dim=8', '--micro_batch_size=2', '--warmup_steps=1',
        '--processes', '--json_out={tmp}/tl_1f1b.json'
    ],
    'simulate_no_m': ['simulate', '--forward_costs=1,2'],
    'simulate_mismatch': ['simulate', '--forward_costs=1,2', '--num_stages=3',
                          '--num_micro_batches=2'],
    'simulate_bad_remat': ['simulate', '--forward_costs=1',
                           '--num_micro_batches=2', '--remat=sometimes'],
    'simulate_executor_unrolled': [
        'simulate', '--forward_costs=1', '--num_stages=2',
        '--num_micro_batches=2', '--executor=per_device'],
    'simulate_tick_dataflow': [
        'simulate', '--forward_costs=1', '--num_stages=2',
        '--num_micro_batches=2', '--engine=loop', '--executor=per_device',
        '--tick_overhead=0.5'],
    'simulate_busy_lockstep': [
        'simulate', '--forward_costs=1', '--num_stages=2',
        '--num_micro_batches=8', '--schedule=1f1b', '--remat=never',
        '--transfer_cost=0.5', '--transfers_busy'],
    'simulate_weight_unsplit': [
        'simulate', '--forward_costs=1', '--num_stages=2',
        '--num_micro_batches=2', '--weight_costs=1'],
    'timeline_no_k': ['timeline', '--num_micro_batches=2'],
    'timeline_too_many_processes': [
        'timeline', f'--num_stages={_CORES + 1}', '--num_micro_batches=2',
        '--processes'
    ],
    # The planner on registered models: profile, search, verify the best.
    'auto_lm': [
        'auto', '--model=lm.GPipeCharLmTiny', '--num_devices=2',
        '--memory_per_device=64MiB', '--verify=1', '--verify_steps=2',
        '--top=5', '--json_out={tmp}/auto_lm.json'
    ],
    'auto_fc': [
        'auto', '--model=benchmarks.fc_model.FcStackTiny', '--num_devices=2',
        '--memory_per_device=20KiB', '--baselines',
        '--json_out={tmp}/auto_fc.json', '--profile_out={tmp}/fc_prof.json'
    ],
    'auto_bad_memory': [
        'auto', '--model=lm.GPipeCharLmTiny', '--num_devices=2',
        '--memory_per_device=lots'
    ],
    'auto_no_model': ['auto', '--num_devices=2', '--memory_per_device=1GiB'],
}
# Runs that read what a run of RUNS wrote, started when those have ended.
AFTER = {
    # auto_fc's saved profile, reused (no worker): the same model and devices
    # with a budget nothing fits.
    'auto_nothing_fits': [
        'auto', '--model=benchmarks.fc_model.FcStackTiny', '--num_devices=2',
        '--memory_per_device=1KiB', '--profile_in={tmp}/fc_prof.json',
        '--json_out={tmp}/auto_none.json'
    ],
}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp('plan'))
  results = tool_util.RunToolInParallel('plan.py', RUNS, tmp, timeout=300)
  results.update(tool_util.RunToolInParallel('plan.py', AFTER, tmp,
                                             timeout=300))
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
     "['auto', 'partition', 'simulate', 'timeline']"),
    ('simulate_no_m', '--num_micro_batches (M) is required'),
    ('simulate_mismatch', '--forward_costs has 2 entries but there are 3 '
     'chunks (K x --virtual_stages)'),
    ('simulate_bad_remat', '--remat'),
    ('simulate_executor_unrolled', '--executor=per_device says how the loop '
     'engine runs its loops; the unrolled engine runs none (its calls are '
     'timed as dataflow). Drop it or use --engine=loop.'),
    ('simulate_tick_dataflow', '--tick_overhead=0.5 is the cost of a lockstep '
     'tick; the step is timed as dataflow here (the loop engine, '
     '--executor=per_device). Drop it or use --engine=loop '
     '--executor=lockstep.'),
    ('simulate_busy_lockstep', '--transfers_busy times transfers as dataflow; '
     'a lockstep tick counts a transfer in its own time. Add '
     '--executor=per_device or drop it.'),
    ('simulate_weight_unsplit', "--weight_costs: schedule 'gpipe' does not "
     "split the backward; only 'zb1p' and 'zbv' run weight gradients apart."),
    ('timeline_no_k', '--num_stages (K) is required'),
    ('timeline_too_many_processes', '--processes pins stage k to a core of '
     f'its own, and --num_stages={_CORES + 1} is more than the {_CORES} cores '
     'this process may run on'),
    ('auto_bad_memory', '--memory_per_device=lots: give a positive number of '
     "bytes, optionally with a unit of ['B', 'KiB', 'MiB', 'GiB']"),
    ('auto_no_model', '--model is required'),
])
def testErrors(runs, name, message):
  code, stdout, stderr = runs[name]
  assert code != 0
  errors = [l for l in stderr.splitlines() if l.startswith('plan.py: error:')]
  assert len(errors) == 1, stderr
  assert message in errors[0]
  assert 'Traceback' not in stderr
  assert not stdout


def _TraceEvents(path):
  """{(stage, micro-batch, phase): (start, end)} of a Chrome trace, in us."""
  with open(path) as f:
    trace = json.load(f)
  events = {}
  for e in trace['traceEvents']:
    if e['ph'] == 'X':
      args = e['args']
      assert e['tid'] == args['stage']
      assert e['name'] == f'{args["phase"]} {args["micro_batch"]}'
      assert args['chunk'] == args['stage']
      key = (args['stage'], args['micro_batch'], args['phase'])
      assert key not in events
      events[key] = (e['ts'], e['ts'] + e['dur'])
  names = [e['args']['name'] for e in trace['traceEvents']
           if e['name'] == 'thread_name']
  return events, names


def _IsPng(path):
  with open(path, 'rb') as f:
    return f.read(8) == b'\x89PNG\r\n\x1a\n'


def testSimulate(runs):
  code, stdout, stderr = runs['simulate']
  assert code == 0, stderr
  assert 'step time: 44 (forwards end at 11)' in stdout
  assert ('bubble fraction: 0.2727 (closed form (K-1)/(M v+K-1) = 0.2727'
          in stdout)
  rows = re.findall(r'^\s+(\d+)\s+(\d+)\s+0.727\s+1  8 inputs \+ '
                    r'activations of 1 call$', stdout, re.MULTILINE)
  assert rows == [('0', '0'), ('1', '1'), ('2', '2'), ('3', '3')]
  # Peak memory says its unit.
  assert ("peak memory in units of one call's activations (inputs count 0); "
          'give --input_memory and --activation_memory, e.g. in MiB, for '
          'sizes\n') in stdout
  with open(os.path.join(runs['tmp'], 'sim.json')) as f:
    numbers = json.load(f)
  assert numbers['subcommand'] == 'simulate'
  assert numbers['forward_costs'] == [1] * 4
  assert numbers['backward_costs'] == [2] * 4
  assert numbers['bubble_fraction'] == pytest.approx(3 / 11)
  assert numbers['closed_form_bubble_fraction'] == pytest.approx(3 / 11)
  assert numbers['peak_inputs'] == [8] * 4
  assert _IsPng(os.path.join(runs['tmp'], 'sim.png'))
  events, names = _TraceEvents(os.path.join(runs['tmp'], 'sim_trace.json'))
  assert names == ['stage 0', 'stage 1', 'stage 2', 'stage 3']
  assert len(events) == 4 * 8 * 3
  # Seconds in, microseconds out: stage 3 starts micro-batch 0 at t = 3.
  assert events[3, 0, 'forward'] == (3e6, 4e6)


def testSimulateUnevenStages(runs):
  code, stdout, stderr = runs['simulate_uneven']
  assert code == 0, stderr
  # Hand-computed in schedule_test.testSimulateUnevenStagesByHand.
  assert 'step time: 17 (forwards end at 7)' in stdout
  assert 'bubble fraction: 0.4118' in stdout
  # Without remat every call keeps its input (10) and activations.
  assert re.search(r'^\s+1\s+1\s+0.824\s+620  2 inputs \+ activations '
                   r'of 2 calls$', stdout, re.MULTILINE), stdout
  assert ('peak memory in the unit of --input_memory and --activation_memory '
          '(defaults 0 and 1)\n') in stdout


def testSimulateBusyTransfers(runs):
  """Hand-computed in simulate_test.testBusyTransfersOccupyTheSenderAndThe
  Receiver."""
  code, stdout, stderr = runs['simulate_busy']
  assert code == 0, stderr
  assert 'transfer cost 0.5 (busy on both stages)' in stdout
  assert 'step time: 12 (forwards end at 4.5)' in stdout


def testSimulatePerDeviceLoopsAsDataflow(runs):
  """--executor=per_device times the loop engine's table as dataflow."""
  code, stdout, stderr = runs['simulate_zbv_per_device']
  assert code == 0, stderr
  assert stdout.startswith(
      'Simulated zbv step: K=2, v=2, M=4, remat=never, loop engine '
      '(per_device loops), transfer cost 2 (busy on both stages)\n')
  expected = simulate.Simulate(
      schedule.BuildTable('zbv', 2, 4, 2), [15] * 4, [23] * 4, 'never', 2.0,
      lockstep=False, weight_costs=[11.5] * 4, transfers_busy=True)
  lockstep = simulate.Simulate(
      schedule.BuildTable('zbv', 2, 4, 2), [15] * 4, [23] * 4, 'never', 2.0,
      lockstep=True, weight_costs=[11.5] * 4)
  assert expected.step_time != lockstep.step_time
  assert f'step time: {expected.step_time:.6g} (' in stdout
  with open(os.path.join(runs['tmp'], 'zbv.json')) as f:
    numbers = json.load(f)
  assert (numbers['engine'], numbers['executor']) == ('loop', 'per_device')
  assert numbers['step_time'] == pytest.approx(expected.step_time)


def testSimulateCircular(runs):
  """K = 2, v = 2, M = 2: 5 ticks of 0.5 + 1.5 a phase; bubble 1/5."""
  code, stdout, stderr = runs['simulate_circular']
  assert code == 0, stderr
  assert 'step time: 10 (forwards end at 2.5)' in stdout
  assert 'bubble fraction: 0.2000 (closed form (K-1)/(M v+K-1) = 0.2000' in (
      stdout)
  assert re.findall(r'^\s+(\d)\s+(\d,\d)\s+0.800', stdout,
                    re.MULTILINE) == [('0', '0,2'), ('1', '1,3')]
  with open(os.path.join(runs['tmp'], 'circular.json')) as f:
    numbers = json.load(f)
  assert (numbers['engine'], numbers['virtual_stages']) == ('loop', 2)
  with open(os.path.join(runs['tmp'], 'circular.json.trace')) as f:
    names = [e['name'] for e in json.load(f)['traceEvents']
             if e['ph'] == 'X' and e['tid'] == 0]
  assert names[:4] == ['forward 0.0', 'forward 0.1', 'forward 2.0',
                       'forward 2.1']


def testTimelineOfARealStep(runs):
  code, stdout, stderr = runs['timeline']
  assert code == 0, stderr
  assert 'stage 0: F0.0 F0.1 F0.2 R0.2 B0.2' in stdout
  assert 'stage 1: F1.0 F1.1 F1.2 R1.2 B1.2' in stdout
  assert _IsPng(os.path.join(runs['tmp'], 'timeline.png'))
  events, names = _TraceEvents(os.path.join(runs['tmp'], 'timeline.json'))
  assert names == ['stage 0', 'stage 1']
  num_stages, num_micro = 2, 3
  for phase in ('forward', 'recompute', 'backward'):  # remat='always'.
    assert sorted((k, m) for k, m, p in events if p == phase) == [
        (k, m) for k in range(num_stages) for m in range(num_micro)]
  # The forward pass ran as the GPipe table says: each stage takes
  # its micro-batches in order, and stage k starts micro-batch m only after
  # stage k - 1 has finished it.
  for k in range(num_stages):
    starts = [events[k, m, 'forward'][0] for m in range(num_micro)]
    assert starts == sorted(starts), (k, starts)
    for m in range(num_micro):
      assert events[k, m, 'forward'][0] <= events[k, m, 'forward'][1]
      if k:
        assert events[k, m, 'forward'][0] >= (
            events[k - 1, m, 'forward'][1] - 1e-3), (k, m)
  with open(os.path.join(runs['tmp'], 'tl_numbers.json')) as f:
    numbers = json.load(f)
  assert numbers['subcommand'] == 'timeline'
  assert numbers['host'] == host.Describe()
  assert f'Measured on {host.Summary(numbers["host"])}.' in stdout
  assert 0 < numbers['bubble_fraction'] < 1
  assert numbers['devices'] == {'0': [_Cpu(0)], '1': [_Cpu(1)]}
  assert len(numbers['events']) == num_stages * num_micro * 3
  # The simulator replays the measured mean call times, one device per stage.
  assert 0 < numbers['simulated_step_time']
  assert 0 < numbers['simulated_bubble_fraction'] < 1
  assert re.search(r'^simulated from the mean call times \(unrolled engine\): '
                   r'step [\d.]+ \w+, bubble fraction [\d.]+; measured / '
                   r'simulated step: [\d.]+$', stdout, re.MULTILINE)


@pytest.mark.parametrize('name, order', [
    ('timeline_loop', ['F0.0', 'F0.1', 'F0.2']),
    ('timeline_circular', ['F0.0', 'F0.1', 'F2.0', 'F2.1', 'F0.2']),
    # 1F1B interleaves after K - 1 = 1 warm-up forward (GPipe's order would
    # be F0.0 F0.1 F0.2 F0.3 B0.3 ...).
    ('timeline_1f1b', ['F0.0', 'F0.1', 'B0.0', 'F0.2', 'B0.1', 'F0.3', 'B0.2',
                       'B0.3']),
])
def testTimelineOfTheLoopEngine(runs, name, order):
  """Loop steps are traced as training runs them; calls follow the table."""
  code, stdout, stderr = runs[name]
  assert code == 0, stderr
  # In a TF1 graph the layer's executor='auto' runs per-device loops.
  assert 'loop engine, per_device executor (loops lowered)' in stdout
  assert re.search(r'^  stage 0: ' + ' '.join(order) + r'( |$)', stdout,
                   re.MULTILINE), stdout
  with open(os.path.join(runs['tmp'], f'tl_{name[9:]}.json')) as f:
    numbers = json.load(f)
  assert (numbers['engine'], numbers['executor']) == ('loop', 'per_device')
  table = schedule.BuildTable(numbers['schedule'], 2,
                              numbers['num_micro_batches'],
                              numbers['virtual_stages'])
  # Every call of the table, once per phase (a recompute unless remat is
  # 'never'; these tables do not split the backward, so no weight phase).
  phases = ('forward', 'backward') if numbers['remat'] == 'never' else (
      'forward', 'recompute', 'backward')
  calls = sorted((e['chunk'], e['micro_batch'], e['phase'])
                 for e in numbers['events'])
  assert calls == sorted(
      (c, m, p) for c in range(table.num_chunks)
      for m in range(table.num_micro_batches) for p in phases)
  for k in range(2):  # Each device ran its calls in table order.
    ran = [(e['phase'], e['chunk'], e['micro_batch'])
           for e in numbers['events']
           if e['stage'] == k and e['phase'] != 'recompute']
    assert ran == [tuple(a) for a in table.device_orders[k]]
  assert re.search(r'^simulated from the mean call times \(loop engine, '
                   r'per_device executor\): step', stdout, re.MULTILINE)
  # Stage k on logical device k, or in server process k, where a transfer
  # costs both processes time (measured, then simulated so).
  task = numbers['processes']
  assert task == (name == 'timeline_1f1b')
  assert (numbers['transfer_s'] > 0) == task
  assert ('a transfer of one micro-batch between the processes costs each '
          in stdout) == task
  assert numbers['devices'] == {
      str(k): [f'/job:worker/replica:0/task:{k}/device:CPU:0' if task else
               _Cpu(k)] for k in range(2)}


def _Cpu(k):
  return f'/job:localhost/replica:0/task:0/device:CPU:{k}'


_CANDIDATE_KEYS = ('num_stages', 'num_micro_batches', 'schedule',
                   'virtual_stages', 'remat', 'partition', 'replicas',
                   'predicted_step_s', 'predicted_peak_bytes', 'fits',
                   'measured_step_s', 'measured_peak_bytes')


def _Ranked(candidates):
  """Whether fitting candidates come first by step, the others by peak."""
  keys = [(0, c['predicted_step_s']) if c['fits'] else
          (1, c['predicted_peak_bytes']) for c in candidates]
  return keys == sorted(keys)


def testAutoVerifiesTheBest(runs):
  code, stdout, stderr = runs['auto_lm']
  assert code == 0, stderr
  with open(os.path.join(runs['tmp'], 'auto_lm.json')) as f:
    numbers = json.load(f)
  candidates = numbers['candidates']
  assert numbers['chosen'] == 0 and numbers['num_devices'] == 2
  # The profiling worker's host, as this process (same environment) sees it.
  assert numbers['host'] == numbers['profile']['host'] == host.Describe()
  assert f'Profiled on {host.Summary(numbers["host"])}.' in stdout
  assert numbers['memory_per_device'] == 64 * 2**20
  for c in candidates:
    assert set(_CANDIDATE_KEYS) <= set(c), c
    assert c['num_stages'] * c['replicas'] == 2
    assert sum(c['partition']) == 4  # Embedding, 2 layers, softmax.
    assert len(c['partition']) == c['num_stages'] * c['virtual_stages']
    assert c['fits'] == (c['predicted_peak_bytes'] <= 64 * 2**20)
  assert _Ranked(candidates)
  # K=1 (R=2, 4 examples each): M in {1, 2, 4}; K=2 (R=1): M in {1, 2, 4,
  # 8} and v in {1, 2}; 3 remat modes each.
  assert len(candidates) == 3 * (3 + 4 * 2)
  best = candidates[0]
  assert best['measured_step_s'] > 0 and best['measured_peak_bytes'] > 0
  assert all(c['measured_step_s'] is None for c in candidates[1:])
  assert len(best['measured_device_peak_bytes']) == best['num_stages']
  assert f"task.stack.num_micro_batches: {best['num_micro_batches']}" in (
      numbers['overrides'])
  assert 'Chosen: K=' in stdout and 'Select it with:' in stdout
  assert "--model_params_override='task.stack.num_stages: " in stdout
  assert ('Verifying 1 configuration(s), each 3 + 2 training steps in 1 '
          'fresh worker(s)') in stdout
  # What the measured data-parallel step held beyond its prediction is
  # charged to every configuration with replicas, and only to those.
  extra = numbers['profile']['replica_overhead_bytes']
  replicated = numbers['profile']['replica_step']
  assert replicated['replicas'] == 2 and replicated['num_stages'] == 1
  assert extra == max(replicated['measured_peak_bytes'] -
                      replicated['predicted_peak_bytes'], 0.0)
  for c in candidates:
    assert c['peak_terms']['replicas'] == (extra if c['replicas'] > 1 else 0)
  assert re.search(r'^#0 .* device 0: peak predicted', stdout,
                   re.MULTILINE | re.DOTALL)


def testAutoRanksEveryCandidateAndBaselines(runs):
  code, stdout, stderr = runs['auto_fc']
  assert code == 0, stderr
  with open(os.path.join(runs['tmp'], 'auto_fc.json')) as f:
    numbers = json.load(f)
  candidates = numbers['candidates']
  assert _Ranked(candidates)
  assert numbers['chosen'] == 0 and candidates[0]['fits']
  assert any(not c['fits'] for c in candidates)  # 20 KiB is tight.
  assert all(c['measured_step_s'] is None for c in candidates)
  labels = [b['label'] for b in numbers['baselines']]
  assert labels[0] == 'defaults'
  defaults = numbers['baselines'][0]
  assert (defaults['num_stages'], defaults['num_micro_batches'],
          defaults['remat'], defaults['partition']) == (2, 1, 'always',
                                                        [2, 2])
  assert 'Baselines (predicted):' in stdout
  # The profile is reusable: testAutoNothingFits reads it (--profile_in).
  with open(os.path.join(runs['tmp'], 'fc_prof.json')) as f:
    profile = json.load(f)
  assert [c['name'] for c in profile['cells']] == ['fc0', 'fc1', 'fc2', 'fc3']
  assert profile['cells'][0]['weight_bytes'] == (16 * 16 + 16) * 4
  assert profile['cells'][0]['slot_bytes'] == 2 * (16 * 16 + 16) * 4  # Adam.
  assert profile['stack_path'] == 'task.stack'


def testAutoNothingFits(runs):
  code, stdout, stderr = runs['auto_nothing_fits']
  assert code == 1, stderr
  errors = [l for l in stderr.splitlines() if l.startswith('plan.py: auto:')]
  assert len(errors) == 1, stderr
  assert ('nothing fits 922 B (memory_per_device=1024, 1.0 KiB, less '
          '--memory_margin=0.1): the smallest predicted peak is') in errors[0]
  assert 'dominated by' in errors[0]
  assert 'Traceback' not in stderr
  with open(os.path.join(runs['tmp'], 'auto_none.json')) as f:
    numbers = json.load(f)
  assert numbers['chosen'] is None and numbers['candidates']
  assert not any(c['fits'] for c in numbers['candidates'])
  smallest = min(c['predicted_peak_bytes'] for c in numbers['candidates'])
  assert f'the smallest predicted peak is {smallest:.0f} bytes' in errors[0]
  assert 'rank' in stdout  # The table is printed all the same.
  # The profile came from auto_fc's --profile_out, not from a worker, and
  # predicts what it predicted there for every configuration. With no room
  # at all, every partition is the fastest one; where the fastest did not fit
  # auto_fc's 20 KiB, it partitioned again under a memory limit (which of
  # them did depends on the profiled times).
  assert 'Profiling' not in stdout
  with open(os.path.join(runs['tmp'], 'fc_prof.json')) as f:
    assert numbers['profile'] == json.load(f)
  with open(os.path.join(runs['tmp'], 'auto_fc.json')) as f:
    reference = json.load(f)['candidates']
  assert {c['partition_rule'] for c in numbers['candidates']} == {'fastest'}
  assert _Shapes(numbers['candidates']) == _Shapes(reference)
  fastest = [c for c in reference if c['partition_rule'] == 'fastest']
  assert fastest and _Predictions(fastest).items() <= _Predictions(
      numbers['candidates']).items()


def _Shapes(candidates):
  """The candidates' configurations without their partitions."""
  return sorted(json.dumps([c[k] for k in _CANDIDATE_KEYS[:7] if
                            k != 'partition']) for c in candidates)


def _Predictions(candidates):
  """{candidate's configuration: (predicted step, predicted peak)}."""
  return {
      json.dumps([c[k] for k in _CANDIDATE_KEYS[:7]]): (
          c['predicted_step_s'], c['predicted_peak_bytes'])
      for c in candidates
  }
