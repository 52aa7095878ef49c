"""Tests of planning.sizes: parameter counts and variable bytes per cell."""

import collections

from lingvo_gpipe.planning import sizes

Variable = collections.namedtuple('Variable', 'shape dtype trainable')


def testCountsAndBytes():
  cells = [
      [Variable((3, 5), 'float32', True), Variable((5,), 'float32', True)],
      [Variable((2, 2), 'float16', True), Variable((), 'int64', False)],
      [],
  ]
  itemsize = {'float32': 4, 'float16': 2, 'int64': 8}
  assert sizes.ParamCounts(cells) == [20.0, 4.0, 0.0]
  assert sizes.VariableBytes(cells, dtype_size=itemsize.get) == [
      80.0, 2 * 4 + 8, 0.0]
