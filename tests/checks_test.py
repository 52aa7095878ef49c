"""Tests of planning.checks: the argument checks every front end shares."""

import pytest

from lingvo_gpipe.planning import checks


def testCheckPositiveInt():
  checks.CheckPositiveInt('num_stages', 1)
  for value in (0, -2, 2.0, True, '2', None):
    with pytest.raises(ValueError, match=f'num_stages={value!r} must be a '
                       'positive int'):
      checks.CheckPositiveInt('num_stages', value)


def testCheckBatchDim():
  checks.CheckBatchDim(0)
  checks.CheckBatchDim(2)
  for value in (-1, 1.0, False):
    with pytest.raises(ValueError, match=f'batch_dim={value!r} must be an '
                       'int >= 0'):
      checks.CheckBatchDim(value)


def testPositiveInts():
  assert checks.PositiveInts('--stages', '2, 4,8') == [2, 4, 8]
  assert checks.PositiveInts('--stages', ['1', '16']) == [1, 16]
  with pytest.raises(ValueError, match='--stages is empty'):
    checks.PositiveInts('--stages', [])
  for values in ('2,0', '2,x', '2,,4', '1.5'):
    with pytest.raises(ValueError, match='--stages'):
      checks.PositiveInts('--stages', values)
