"""Tests of planning.search_report: what plan.py auto prints of a search."""

from lingvo_gpipe.planning import predict
from lingvo_gpipe.planning import search
from lingvo_gpipe.planning import search_report
from planning_util import Profile
from planning_util import Shape
from planning_util import TWO_CELLS


def _Search(memory_per_device):
  """Two devices for `TWO_CELLS` (100 bytes of weights each)."""
  return search.Search(Profile(TWO_CELLS), num_devices=2,
                       memory_per_device=memory_per_device)


def testReasonNamesTheWinnerAndTheFasterOverBudget():
  result = _Search(150)
  text = search_report.Reason(result)
  assert "K=2 v=1 M=2 R=1 gpipe remat='never' [1, 1]" in text
  assert 'Faster but over budget: K=1' in text


def testNothingFits():
  result = _Search(50)
  message = search_report.NothingFits(result)
  assert 'nothing fits memory_per_device=50' in message
  assert 'the smallest predicted peak is 100 bytes' in message
  assert 'dominated by weights: 100 B (100%)' in message
  assert search_report.Reason(result) == message
  assert search_report.NothingFits(result, '1 KiB').startswith(
      'nothing fits 1 KiB: ')


def testOverrideLines():
  profile = Profile(TWO_CELLS, stack_path='task.stack',
                    stack_settings={'num_stages': 4,
                                    'micro_batch_size': None})
  c = predict.Predict(profile, Shape(2, 2, 'always'), [1, 1])
  assert search_report.OverrideLines(profile, c) == [
      'task.stack.num_stages: 2', 'task.stack.virtual_stages: 1',
      'task.stack.num_micro_batches: 2', 'task.stack.schedule: gpipe',
      'task.stack.remat: always', 'task.stack.partition: [1, 1]',
      'input.batch_size: 4'
  ]
  # micro_batch_size only where the model sets it: B / (R M).
  profile = Profile(TWO_CELLS, stack_settings={'micro_batch_size': 1})
  assert 'task.stack.micro_batch_size: 2' in search_report.OverrideLines(
      profile, c)


def testFormatTable():
  result = _Search(150)
  lines = search_report.FormatTable(result, top=2).splitlines()
  assert lines[0].split() == ['rank', 'K', 'v', 'M', 'R', 'schedule',
                              'remat', 'engine', 'step', 'ms', 'peak',
                              'fits', 'partition']
  assert lines[2].split() == ['0', '2', '1', '2', '1', 'gpipe', 'never',
                              'unrolled', '24000.00', '100', 'B', 'yes',
                              '[1,', '1]']
  assert lines[-1] == (f'({len(result.candidates) - 2} more; --json_out '
                       'lists every candidate)')


def testFormatBytes():
  assert search_report.FormatBytes(1000) == '1000 B'
  assert search_report.FormatBytes(1536) == '1.5 KiB'
  assert search_report.FormatBytes(3 * 2**30) == '3.0 GiB'
