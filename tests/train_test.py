"""tools/train.py: Lingvo's runner trains the registered LM on 4 local devices.

The launcher runs as a subprocess like a user would (graph and eager mode,
eval and decode jobs, a run killed and restarted, bad input); placement is
checked in-process on the launcher's own cluster and server.
"""

import collections
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from unittest import mock

from absl.testing import flagsaver
import numpy as np
import pytest
from lingvo import compat as tf
from lingvo.core import cluster_factory
from lingvo.core import py_utils
from tensorflow.python.eager import context  # pylint: disable=g-direct-tensorflow-import

from lingvo_gpipe.engine import placement
import engine_util
import launcher_util
import tool_util
from tools import train

MODEL = launcher_util.MODEL
STEPS = 20
# The launcher's initial weights are the same in every run (its default
# --stateless_vars_init), so two runs can be compared.
COMMON = [f'--model={MODEL}', '--num_devices=4', '--log_every=1']
_TWO_STAGES = launcher_util.TWO_STAGES
_LOOP = '--model_params_override=task.stack.engine: "loop"'
RUNS = {
    'graph': COMMON + ['--logdir={tmp}/graph', f'--max_steps={STEPS}'],
    'eager': COMMON + ['--logdir={tmp}/eager', '--max_steps=6', '--use_eager'],
    # 2 data-parallel replicas (Lingvo towers) of a 2-stage pipeline.
    'replicas': COMMON + ['--logdir={tmp}/replicas', '--max_steps=6',
                          '--split_size=2', _TWO_STAGES],
    # The loop engine through Lingvo's runner in eager mode ('gpipe_loop'
    # below runs it in graph mode).
    'loop_eager': COMMON + ['--logdir={tmp}/loop_eager', '--max_steps=6',
                            '--use_eager', _LOOP],
    # The same LM with its loss in the last cell, run by 1F1B (the loop
    # engine), and the GPipe model on the loop engine for 20 steps.
    '1f1b': [f'--model={MODEL}1F1B'] + COMMON[1:] + [
        '--logdir={tmp}/1f1b', f'--max_steps={STEPS}'],
    'gpipe_loop': COMMON + ['--logdir={tmp}/gpipe_loop',
                            f'--max_steps={STEPS}', _LOOP],
    # A 2-stage model on a 4-device split: stages on the split's CPU:0, 1.
    'two_stages': COMMON + ['--logdir={tmp}/two_stages', '--max_steps=2',
                            _TWO_STAGES],
    'bad_model': ['--model=lm.NoSuchModel', '--logdir={tmp}/bad'],
    'bad_value': [f'--model={MODEL}', '--num_devices=0', '--logdir={tmp}/bad'],
    'too_few_devices': [f'--model={MODEL}', '--num_devices=2',
                        '--logdir={tmp}/bad'],
}
AFTER = {
    'restarted': COMMON + ['--logdir={tmp}/killed', f'--max_steps={STEPS}'],
    # Lingvo's evaler and decoder on the same checkpoint, in one process.
    'eval_decode': COMMON + ['--logdir={tmp}/graph',
                             '--job=evaler_dev,decoder_dev'],
    # Lingvo's evaler waits for checkpoints until max_steps is reached.
    'eager_eval': COMMON + ['--logdir={tmp}/eager', '--job=evaler_dev',
                            '--use_eager', '--max_steps=6'],
    # The graph-mode evaler on the same checkpoint as 'eager_eval', in a
    # logdir of its own (`runs` copies the checkpoints there): an evaler
    # skips the checkpoints another evaler of its logdir recorded as done.
    'graph_eval_of_eager': COMMON + ['--logdir={tmp}/eager_graph_eval',
                                     '--job=evaler_dev', '--max_steps=6'],
    # 'replicas' again: its checkpoint is at max_steps already.
    'again': RUNS['replicas'],
    # The GPipe model's evaler on the 1F1B model's checkpoint.
    'eval_1f1b': COMMON + ['--logdir={tmp}/1f1b', '--job=evaler_dev'],
}
# As `make train` runs the launcher: it chooses TensorFlow's C++ log level.
ENV_CHANGES = {'TF_CPP_MIN_LOG_LEVEL': None}


def _Checkpoint(logdir):
  return tf.train.latest_checkpoint(os.path.join(logdir, 'train'))


def _KillAfterFirstCheckpoint(tmp):
  """Starts a long run in {tmp}/killed and SIGKILLs it after a checkpoint.

  Args:
    tmp: The scratch folder.

  Returns:
    A thread to join; afterwards {tmp}/killed holds the checkpoints written.
  """
  args = [a.format(tmp=tmp) for a in COMMON] + [
      f'--logdir={tmp}/killed', '--max_steps=100000']
  proc = subprocess.Popen(
      tool_util.ToolCommand('train.py') + args, cwd=tmp,
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

  def Watch():
    # Only a guard against a run that hangs: on a loaded 2-core host the
    # first checkpoints have taken over 300 s.
    deadline = time.time() + 1200
    while time.time() < deadline and proc.poll() is None:
      ckpt = _Checkpoint(f'{tmp}/killed')
      if ckpt and int(ckpt.rsplit('-', 1)[1]) > 1:
        break
      time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

  thread = threading.Thread(target=Watch)
  thread.start()
  return thread


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp('train'))
  watcher = _KillAfterFirstCheckpoint(tmp)
  results = tool_util.RunToolInParallel('train.py', RUNS, tmp, timeout=600,
                                        env_changes=ENV_CHANGES)
  watcher.join()
  results['killed_at'] = _Checkpoint(f'{tmp}/killed')
  shutil.copytree(f'{tmp}/eager/train', f'{tmp}/eager_graph_eval/train')
  results.update(
      tool_util.RunToolInParallel('train.py', AFTER, tmp, timeout=600,
                                  env_changes=ENV_CHANGES))
  return results


def _ProgressSteps(stdout):
  return [int(s) for s in re.findall(r'^step +(\d+) +loss', stdout, re.M)]


@pytest.mark.slow
@pytest.mark.parametrize('name,steps', [('graph', STEPS), ('eager', 6),
                                        ('replicas', 6), ('gpipe_loop', STEPS),
                                        ('loop_eager', 6)])
def testTrainsAndLossDecreases(runs, name, steps):
  model, last_step, first, last, rate, ckpt = launcher_util.Trained(runs, name)
  assert (model, int(last_step)) == (MODEL, steps)
  assert float(last) < float(first) - 0.5  # Starts near log(256) = 5.5.
  assert float(rate) > 0
  assert ckpt.endswith(f'ckpt-{steps:08d}') and os.path.exists(ckpt + '.index')
  stdout = runs[name][1]
  assert _ProgressSteps(stdout) == list(range(1, steps + 1))
  # The first step's rate is unknown (it includes building the graph): the
  # line says how long start-up took instead.
  assert re.search(r'^step +1  loss [\d.]+  first step [\d.]+ s after start '
                   r'\(building, restoring\)$', stdout, re.MULTILINE), stdout
  assert 'nan' not in stdout


@pytest.mark.slow
@pytest.mark.parametrize('name', ['graph', 'eager', 'loop_eager',
                                  'eval_decode', 'eager_eval'])
def testNoCppErrorLines(runs, name):
  """TensorFlow's import-time C++ errors do not reach the launcher's user."""
  code, _, stderr = runs[name]
  assert code == 0, stderr[-3000:]
  assert not re.findall(r'^E\d{4} .*$', stderr, re.MULTILINE)


@pytest.mark.slow
def testTensorBoardSummaries(runs):
  """Loss, learning rate, examples/s and the bubble fraction, every step."""
  (events,) = [os.path.join(runs['tmp'], 'graph', 'train', f)
               for f in os.listdir(os.path.join(runs['tmp'], 'graph', 'train'))
               if f.startswith('events.')]
  values = collections.defaultdict(dict)
  for event in tf.compat.v1.train.summary_iterator(events):
    for value in event.summary.value:
      values[value.tag][event.step] = value.simple_value
  for tag in ('loss', 'learning_rate/loss', 'examples/sec', 'bubble_fraction'):
    assert sorted(values[tag]) == list(range(1, STEPS + 1)), tag
  # Tiny LM: K = 4 stages, M = 2 micro-batches: (K - 1) / (M + K - 1).
  assert list(values['bubble_fraction'].values()) == [pytest.approx(3 / 5)
                                                     ] * STEPS


def _StepLosses(stdout):
  return [float(l) for l in re.findall(r'^step +\d+ +loss ([\d.]+)', stdout,
                                       re.M)]


@pytest.mark.slow
@pytest.mark.parametrize('name,reference,rtol', [('eager', 'graph', 5e-3),
                                                 ('gpipe_loop', 'graph', 1e-4),
                                                 ('loop_eager', 'eager', 1e-4)])
def testSameLossAtEveryStep(runs, name, reference, rtol):
  """Same weights and batches: the same loss at each of the first 6 steps.

  The loop engine against the unrolled one in the same mode: equal to the 4
  printed decimals (later, Adam amplifies their float round-off: 1.4e-4 at
  step 20, testOneFOneBTrainsAsGPipe). Eager against graph mode: the same for
  2 steps, then apart by float round-off (TensorFlow optimizes the two graphs
  differently), which Adam amplifies in weights with tiny gradients:
  measured 1.7e-3 relative at step 6, where one step's progress is 3%.

  Args:
    runs: The fixture.
    name: A run of 6 steps or more.
    reference: The run it must agree with.
    rtol: The relative tolerance.
  """
  losses = _StepLosses(runs[name][1])[:6]
  expected = _StepLosses(runs[reference][1])[:6]
  assert len(losses) == 6
  np.testing.assert_allclose(losses, expected, rtol=rtol)


@pytest.mark.slow
def testKilledRunResumesWithIdenticalVariables(runs):
  killed_at = runs['killed_at']
  assert killed_at, 'the killed run wrote no checkpoint'
  saved_step = int(killed_at.rsplit('-', 1)[1])
  assert 1 < saved_step < STEPS
  _, stdout, _ = runs['restarted']
  assert _ProgressSteps(stdout)[0] == saved_step + 1
  # Killed-and-restarted and uninterrupted runs end with the same variables.
  restarted = tf.train.load_checkpoint(launcher_util.Trained(runs, 'restarted')[5])
  uninterrupted = tf.train.load_checkpoint(launcher_util.Trained(runs, 'graph')[5])
  names = restarted.get_variable_to_shape_map()
  assert set(names) == set(uninterrupted.get_variable_to_shape_map())
  assert len(names) > 50  # Weights, Adam slots, global step.
  for name in names:
    engine_util.AssertTransparent([restarted.get_tensor(name)],
                                [uninterrupted.get_tensor(name)], tol=1e-6)


def _Metrics(runs, job, prefix, step):
  """{metric: value} of the one result line of eval or decode run `job`."""
  code, stdout, stderr = runs[job]
  assert code == 0, stderr[-3000:]
  (line,) = re.findall(rf'^{prefix} {MODEL} at step {step}: (.*)$', stdout,
                       re.MULTILINE)
  return {k: float(v) for k, v in re.findall(r'(\S+) ([\d.]+)', line)}


# After 20 steps next-byte accuracy beats chance (1/256) clearly.
@pytest.mark.slow
@pytest.mark.parametrize('prefix', ['eval_dev', 'decoder_dev'])
def testEvalAndDecodeOnHeldOutText(runs, prefix):
  values = _Metrics(runs, 'eval_decode', prefix, STEPS)
  assert values['fraction_of_correct_next_step_preds'] >= 0.05
  if prefix == 'eval_dev':  # Perplexity below uniform guessing.
    assert 2.0 < values['log_pplx'] < np.log(256)


@pytest.mark.slow
def testEagerEvalEqualsGraphEvalOfTheSameCheckpoint(runs):
  """Lingvo's eager evaler scores the 6-step checkpoint as the graph one.

  After 6 steps accuracy need not beat chance; the eager eval path is checked
  against the graph-mode evaler on the same checkpoint and held-out text.
  """
  eager = _Metrics(runs, 'eager_eval', 'eval_dev', 6)
  graph = _Metrics(runs, 'graph_eval_of_eager', 'eval_dev', 6)
  assert set(eager) == {'fraction_of_correct_next_step_preds', 'log_pplx',
                        'loss'}
  assert set(graph) == set(eager)
  for name, value in eager.items():
    assert value == pytest.approx(graph[name], abs=2e-4), name
  assert 2.0 < eager['log_pplx'] < np.log(256)


@pytest.mark.slow
def testRerunAtMaxStepsHasNothingToDo(runs):
  """The same command again after the last step: one line, no training."""
  code, stdout, stderr = runs['again']
  assert code == 0, stderr[-3000:]
  checkpoint = os.path.join(runs['tmp'], 'replicas', 'train',
                            'ckpt-00000006')
  assert stdout.splitlines() == [
      f'trained {MODEL}: nothing to do, checkpoint {checkpoint} is at or past '
      'max_steps']


@pytest.mark.slow
@pytest.mark.parametrize('name,message', [
    ('bad_model', "--model='lm.NoSuchModel' is not a registered model; "
                  'registered: image.ShapesResNet, image.ShapesResNetTiny, '
                  'image.ShapesUNet, image.ShapesUNetTiny, lm.GPipeCharLm, '
                  'lm.GPipeCharLm1F1B, lm.GPipeCharLmTiny, '
                  'lm.GPipeCharLmTiny1F1B, mt.ReverseTransformer, '
                  'mt.ReverseTransformerTiny.'),
    ('bad_value', 'flag --num_devices=0: 0 is not a positive integer'),
    ('too_few_devices', 'task.stack.num_stages=4 needs a model split of at '
                        'least 4 devices; got 2 (--num_devices, --split_size)'),
])
def testBadInputIsOneLine(runs, name, message):
  code, stdout, stderr = runs[name]
  assert code == 2
  errors = [l for l in stderr.splitlines() if l.startswith('train.py: error')]
  assert len(errors) == 1 and message in errors[0], stderr[-2000:]
  assert 'Traceback' not in stderr and 'trained' not in stdout


@contextlib.contextmanager
def _LauncherParams(logdir, use_eager=False, split_size=None,
                    num_stages=None):
  """The trainer's params as the launcher sets them up, in its flags.

  Args:
    logdir: --logdir.
    use_eager: --use_eager (Lingvo's eager mode flag while inside; the test
      process runs TensorFlow eagerly, with graphs where a test builds one).
    split_size: --split_size (None: all 4 devices in one split, 4 stages; 2:
      two towers of 2 stages).
    num_stages: The LM's K (default: the split size, 4 without one).

  Yields:
    The model params of the trainer job; in graph mode the launcher's local
    server is FLAGS.tf_master.
  """
  num_stages = num_stages or split_size
  override = f'task.stack.num_stages: {num_stages}' if num_stages else ''
  eager = py_utils.IsEagerMode()
  with flagsaver.flagsaver(model=MODEL, logdir=logdir, split_size=split_size,
                           use_eager=use_eager, model_params_override=override,
                           **train.LAUNCHER_DEFAULTS):
    manager = train.LocalDevicesRunnerManager(MODEL)
    manager.MaybeConfigRunLocally()
    # Lingvo's flag only: the launcher's SetEagerMode would also switch
    # TensorFlow's eager execution for the rest of the process.
    py_utils.SetEagerMode(use_eager, test_mode=True)
    try:
      yield manager.GetParamsForDataset('trainer_client', 'Train')
    finally:
      py_utils.SetEagerMode(eager, test_mode=True)


def _TraceOneLauncherStep(logdir, split_size=None, num_stages=None):
  """One training step built like the launcher's trainer, with step stats.

  Args:
    logdir: --logdir.
    split_size: --split_size, see `_LauncherParams`.
    num_stages: The LM's K, see `_LauncherParams`.

  Returns:
    (RunMetadata, the LM task).
  """
  with _LauncherParams(logdir, split_size=split_size,
                       num_stages=num_stages) as cfg:
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(
        flagsaver.flags.FLAGS.tf_master) as sess:
      return launcher_util.TraceTrainStep(cfg, sess)


@pytest.mark.slow
def testStageKRunsOnDeviceK(tmp_path):
  """On the launcher's cluster and 4-device server, stage k ran on CPU:k.

  Tiny LM cells: [embedding, layer0, layer1, softmax], one per stage.
  """
  metadata, task = _TraceOneLauncherStep(str(tmp_path))
  assert task.stack.partition == [1, 1, 1, 1]
  kinds = collections.defaultdict(set)
  stage_calls = collections.defaultdict(set)
  for dev in metadata.step_stats.dev_stats:
    device = int(re.search(r'CPU:(\d+)$', dev.device).group(1))
    for node in dev.node_stats:
      for kind, pattern in launcher_util.CELL_KERNELS.items():
        if re.search(pattern, node.node_name):
          grad = '-grad' if node.node_name.startswith('gradients/') else ''
          kinds[device].add(kind + grad)
      call = launcher_util.StageCall(node)
      if call:
        stage_calls[call[1]].add(device)
  transformer = {'attention', 'attention-grad', 'feedforward',
                 'feedforward-grad'}
  assert dict(kinds) == {0: {'embedding'}, 1: transformer, 2: transformer,
                         3: {'softmax', 'softmax-grad'}}
  assert dict(stage_calls) == {k: {k} for k in range(4)}


@pytest.mark.slow
def testTwoReplicasOfTwoStagesRunOnTheirOwnDevices(tmp_path):
  """--split_size=2 on 4 devices: tower r's stage k ran on CPU:2r+k."""
  metadata, task = _TraceOneLauncherStep(str(tmp_path), split_size=2)
  assert task.stack.num_stages == 2
  calls = collections.defaultdict(set)
  for dev in metadata.step_stats.dev_stats:
    device = int(re.search(r'CPU:(\d+)$', dev.device).group(1))
    for node in dev.node_stats:
      call = launcher_util.StageCall(node)
      if call:
        calls[call].add(device)
  assert dict(calls) == {
      (r, k): {2 * r + k} for r in range(2) for k in range(2)}


@pytest.mark.slow
def testTwoStagesOnAFourDeviceSplitAreLogged(runs):
  """The launcher's log names the split's devices 0 and 1 for the 2 stages."""
  code, _, stderr = runs['two_stages']
  assert code == 0, stderr[-3000:]
  with open(os.path.join(runs['tmp'], 'two_stages', 'train_log.txt')) as f:
    (placement,) = re.findall(r'stack: stage devices (.*)$', f.read(), re.M)
  devices = [f'/job:localhost/replica:0/task:0/device:CPU:{k}' for k in (0, 1)]
  assert placement.startswith(f'{devices} for partition [')
  assert placement.endswith('] (model split of 4 devices)')


@pytest.mark.slow
def testTwoStagesOnAFourDeviceSplitRunOnCpu0And1(tmp_path):
  """--num_devices=4, a 2-stage LM: stage k on CPU:k, CPU:2-3 stay idle.

  The launcher's process has one local CPU device outside its session (this
  test process has 4), so only the model split can place stage 1 on CPU:1.
  """
  with mock.patch.object(placement, 'LocalDevices', return_value=None):
    metadata, task = _TraceOneLauncherStep(str(tmp_path), num_stages=2)
  assert task.stack.num_stages == 2
  calls = collections.defaultdict(set)
  busy = set()
  for dev in metadata.step_stats.dev_stats:
    device = int(re.search(r'CPU:(\d+)$', dev.device).group(1))
    for node in dev.node_stats:
      if any(re.search(p, node.node_name) for p in launcher_util.CELL_KERNELS.values()):
        busy.add(device)
      call = launcher_util.StageCall(node)
      if call:
        calls[call[1]].add(device)
  assert dict(calls) == {0: {0}, 1: {1}}
  assert busy == {0, 1}


def testEagerLauncherRunsStageKOnCpuK(tmp_path):
  """--use_eager: the launcher's cluster puts stage k's kernels on CPU:k.

  The eager context has the 4 CPU devices (conftest.py creates them as the
  launcher does); the partition graphs TensorFlow ran for one tf.function
  step of the tiny LM hold stage k's forward kernels on CPU:k only.

  Args:
    tmp_path: pytest's scratch folder (--logdir).
  """
  with _LauncherParams(str(tmp_path), use_eager=True) as cfg:
    with cluster_factory.Cluster(cfg.cluster):
      task = cfg.Instantiate().GetTask()
      assert task.stack.StageDevices() == engine_util.CPUS

      @tf.function(autograph=False)
      def Step():
        with tf.GradientTape() as tape:
          metrics, _ = task.FPropDefaultTheta()
        return tape.gradient(metrics['loss'][0], task.vars.Flatten())

      context.enable_run_metadata()
      try:
        Step()
        metadata = context.export_run_metadata()
      finally:
        context.disable_run_metadata()
  stages = collections.defaultdict(set)
  for function in metadata.function_graphs:
    for partition in function.partition_graphs:
      for node in partition.node:
        call = re.search(
            r'/gpipe/chunk(\d)_mb\d+(_\d+)?/StatefulPartitionedCall/',
            node.name)
        if call and node.op not in launcher_util.TRANSFER_OPS:
          stages[node.device].add(int(call.group(1)))
  assert dict(stages) == {device: {k}
                          for k, device in enumerate(engine_util.CPUS)}


@pytest.mark.parametrize('argv,flag_values,message', [
    (['train.py', 'now'], {}, "unexpected arguments ['now']; every setting is "
     'a flag.'),
    (['train.py'], dict(model=None), '--model is required, e.g. '
     '--model=lm.GPipeCharLm.'),
    (['train.py'], dict(logdir=''), '--logdir is required, e.g. '
     '--logdir=/tmp/lm.'),
    (['train.py'], dict(num_devices=4, split_size=3), '--split_size=3 must '
     'divide --num_devices=4.'),
])
def testLauncherErrorsAreOneLine(tmp_path, capsys, argv, flag_values,
                                 message):
  """Mistakes in the command line: one line, exit status 2, nothing made."""
  logdir = str(tmp_path / 'logdir')
  with flagsaver.flagsaver(**{'model': MODEL, 'logdir': logdir,
                              **flag_values}):
    with pytest.raises(SystemExit) as exit_info:
      train.main(argv)
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == f'train.py: error: {message}\n'
  assert not os.path.exists(logdir)


def _TrainRecord(step, loss, created):
  """A log record as Lingvo's trainer logs a step (what Progress reads)."""
  record = logging.LogRecord(
      'absl', logging.INFO, __file__, 0,
      f'step: {step:6d}, steps/sec: 1.00, examples/sec: 8.00 loss:{loss} '
      'num_samples_in_batch:8', None, None)
  record.created = created
  return record


def testProgressLinesNameStartUpThenTheRate(capsys):
  """The first line has no rate yet (no 'nan'): it says when step 1 came."""
  progress = train.Progress(log_every=2, eager_eval_job='', start=100.0)
  for step, created in [(1, 106.5), (2, 107.0), (3, 107.5), (4, 108.0)]:
    progress.emit(_TrainRecord(step, 5.0 - step, created))
  assert capsys.readouterr().out.splitlines() == [
      'step      1  loss 4.0000  first step 6.5 s after start (building, '
      'restoring)',
      'step      2  loss 3.0000       16.0 examples/s',
      'step      4  loss 1.0000       16.0 examples/s']
  assert progress.ExamplesPerSecond() == 16.0


@pytest.mark.slow
def testOneFOneBTrainsAsGPipe(runs):
  """lm.GPipeCharLmTiny1F1B: the loss in the pipeline, the same training.

  Same seeds, data and variables: its losses at each of 20 steps equal the
  GPipe model's on the same (loop) engine within 1e-5 (measured 2.3e-7;
  against the unrolled engine, float round-off amplified by Adam reaches
  1.4e-4 at step 20). Its checkpoint restores into the GPipe model, whose
  evaler scores it.

  Args:
    runs: The fixture.
  """
  model, last_step, _, _, _, ckpt = launcher_util.Trained(runs, '1f1b')
  assert (model, int(last_step)) == (MODEL + '1F1B', STEPS)
  one_f_one_b = launcher_util.SummaryLosses(runs, '1f1b')
  gpipe = launcher_util.SummaryLosses(runs, 'gpipe_loop')
  assert sorted(one_f_one_b) == sorted(gpipe) == list(range(1, STEPS + 1))
  for step in gpipe:
    assert abs(one_f_one_b[step] - gpipe[step]) <= 1e-5 * gpipe[step], step
  weights = tf.train.load_checkpoint(ckpt)
  reference = tf.train.load_checkpoint(launcher_util.Trained(runs, 'gpipe_loop')[5])
  assert (weights.get_variable_to_shape_map() ==
          reference.get_variable_to_shape_map())
  values = _Metrics(runs, 'eval_1f1b', 'eval_dev', STEPS)
  assert 2.0 < values['log_pplx'] < np.log(256)
