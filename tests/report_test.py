"""planning.report: the partition table next to Lingvo's heuristic."""

import pytest

from lingvo_gpipe.planning import report


def testPartitionReport():
  text = report.PartitionReport([1, 4, 4, 4, 8], [3, 2],
                               memory=[1, 1, 1, 1, 3],
                               names=['emb', 'l0', 'l1', 'l2', 'out'],
                               memory_limit=3.5)
  lines = text.splitlines()
  assert lines[0] == ('5 cells, 2 stages, total cost 21, ideal stage cost '
                      '10.5.')
  assert lines[1] == 'Partition [3, 2]:'
  assert lines[3].split() == ['0', 'emb', '..', 'l1', '3', '9', '42.9%', '3']
  assert lines[4].split() == [
      '1', 'l2', '..', 'out', '2', '12', '57.1%', '4', 'over', 'memory_limit'
  ]
  assert lines[5].strip() == ('imbalance (largest stage / ideal): 1.143, '
                              'largest stage memory: 4')
  assert "Lingvo's heuristic (PartitionSequentialLayers) [3, 2]:" in text


def testPartitionReportShowsEmptyLingvoStages():
  text = report.PartitionReport([1, 100, 1], [1, 1, 1])
  lingvo = text[text.index("Lingvo's"):].splitlines()
  assert lingvo[0].endswith('[1, 0, 2]:')
  assert lingvo[3].split() == ['1', '(empty)', '0', '0', '0.0%']
  assert lingvo[-1].endswith('1 empty stage(s)')
  assert 'cell1' in text  # Default names.


def testPartitionReportErrors():
  with pytest.raises(ValueError, match=r'partition=\[2, 2\] sums to 4'):
    report.PartitionReport([1, 2, 3], [2, 2])
  with pytest.raises(ValueError, match='names has 2 entries'):
    report.PartitionReport([1, 2, 3], [2, 1], names=['a', 'b'])
  with pytest.raises(ValueError, match='memory has 1 entries'):
    report.PartitionReport([1, 2, 3], [2, 1], memory=[1])
  assert 'undefined (all costs are zero)' in report.PartitionReport([0, 0],
                                                                   [1, 1])
