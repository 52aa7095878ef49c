"""The speed benchmark: GPipeSequentialLayer against Lingvo's PipeliningLayer.

Step time, first-step time, graph build time and peak memory of one training
step of a stack of Lingvo FCLayers (gradients colocated with their ops, as
Lingvo's trainer does) on K logical CPU devices, one per stage, placed by
Lingvo's cluster model split, for every K and M: GPipeSequentialLayer
(remat='always'), Lingvo's gpipe.PipeliningLayer (which always recomputes)
and GPipeSequentialLayer in an eager tf.function (GradientTape), plus the
plain SequentialLayer and GPipe with remat='never' at K=1, M=1 as
references. Every measurement is a worker process (see `runner`).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks import runner as runner_lib

# Warm-up steps of every configuration: the first builds and optimizes.
WARMUPS = 2
# The variants measured at every (K, M), in this order after the references.
_VARIANTS = ('gpipe', 'lingvo', 'gpipe_function')
# Every GPipe configuration of this benchmark uses the unrolled engine (the
# scale benchmark compares the engines).
_ENGINE = 'unrolled'


def Configs(num_layers: int, dim: int, batch: int, steps: int,
            shapes: Sequence[Tuple[int, int]]) -> List[Dict[str, Any]]:
  """The references (plain, GPipe K=1 M=1 'never'), then 3 variants a shape.

  Args:
    num_layers: FCLayers in every model.
    dim: Their size.
    batch: The mini-batch size.
    steps: Measured steps after `WARMUPS` warm-up steps.
    shapes: (K, M) pairs.

  Returns:
    The configurations, in the order `Rows` expects.
  """

  def Config(model, k=1, m=1, remat=None, mode='graph'):
    return runner_lib.Config(model, num_layers, dim, batch, steps, m, remat,
                             stages=k, warmups=WARMUPS, mode=mode,
                             engine=_ENGINE)

  configs = [Config('plain', m=None), Config('gpipe', remat='never')]
  for k, m in shapes:
    configs += [
        Config('gpipe', k, m, 'always'),
        Config('lingvo', k, m),
        Config('gpipe', k, m, 'always', mode='function')
    ]
  return configs


def Summary(row: Dict[str, Any]) -> Dict[str, Any]:
  """The medians of one measured configuration (a `MeasureTable` row)."""
  return {
      key: row[key]
      for key in ('name', 'step_s', 'warmup_s', 'build_s', 'peak_mib',
                  'resident_mib')
  }


def Rows(measured: List[Dict[str, Any]], shapes: Sequence[Tuple[int, int]],
         batch: int) -> List[Dict[str, Any]]:
  """One row per (K, M): the three variants and their ratios.

  Args:
    measured: `runner.MeasureTable` of `Configs(..., shapes)`.
    shapes: The same (K, M) pairs.
    batch: The mini-batch size (for examples/s).

  Returns:
    JSON-ready rows: stages, micro_batches, the `Summary` of each variant,
    ours / Lingvo step and build ratios, ours / plain step ratio, examples/s.
  """
  plain = measured[0]
  rows = []
  for i, (k, m) in enumerate(shapes):
    ours, lingvo, func = measured[2 + 3 * i:5 + 3 * i]
    rows.append({
        'stages': k,
        'micro_batches': m,
        'gpipe': Summary(ours),
        'lingvo': Summary(lingvo),
        'gpipe_function': Summary(func),
        'step_ratio_lingvo': runner_lib.Ratio(ours['step_s'],
                                              lingvo['step_s']),
        'step_ratio_plain': runner_lib.Ratio(ours['step_s'], plain['step_s']),
        'build_ratio_lingvo': runner_lib.Ratio(ours['build_s'],
                                               lingvo['build_s']),
        'examples_per_s': {
            name: runner_lib.Ratio(batch, row['step_s'])
            for name, row in zip(_VARIANTS, (ours, lingvo, func))
        },
    })
  return rows


def FormatReferences(plain: Dict[str, Any], never: Dict[str, Any],
                     batch: int) -> str:
  """The plain model's and GPipe K=1 M=1 remat='never' lines."""
  ratio = runner_lib.FormatRatio(
      runner_lib.Ratio(never['step_s'], plain['step_s']))
  return (f'  plain SequentialLayer: step {plain["step_s"]:.3f} s '
          f'({batch / plain["step_s"]:.0f} examples/s), build '
          f'{plain["build_s"]:.2f} s, peak {plain["peak_mib"]:.1f} MiB\n'
          f'  ours K=1 M=1 remat=never: step {never["step_s"]:.3f} s = '
          f'{ratio}x plain, build {never["build_s"]:.2f} s, peak '
          f'{never["peak_mib"]:.1f} MiB')


def FormatTable(rows: List[Dict[str, Any]]) -> str:
  """The speed table: one fixed-width line per (K, M) of `Rows`."""

  def Num(value: Optional[float], width: int, digits: int) -> str:
    if value is None:
      return f'{"n/a":>{width}}'
    return f'{value:>{width}.{digits}f}'

  columns = [('K', 3), ('M', 4), ('ours s', 8), ('Lingvo s', 9),
             ('ours/Lingvo', 12), ('ours/plain', 11), ('ours build', 11),
             ('Lingvo build', 13), ('build ratio', 12), ('tf.fn s', 9),
             ('ours MiB', 9), ('Lingvo MiB', 11), ('tf.fn MiB', 10)]
  lines = [''.join(f'{name:>{width}}' for name, width in columns)]
  lines.append('-' * len(lines[0]))
  for row in rows:
    ours, lingvo, func = row['gpipe'], row['lingvo'], row['gpipe_function']
    lines.append(
        f'{row["stages"]:>3}{row["micro_batches"]:>4}'
        f'{Num(ours["step_s"], 8, 3)}{Num(lingvo["step_s"], 9, 3)}'
        f'{Num(row["step_ratio_lingvo"], 12, 2)}'
        f'{Num(row["step_ratio_plain"], 11, 2)}'
        f'{Num(ours["build_s"], 11, 2)}{Num(lingvo["build_s"], 13, 2)}'
        f'{Num(row["build_ratio_lingvo"], 12, 2)}{Num(func["step_s"], 9, 3)}'
        f'{Num(ours["peak_mib"], 9, 1)}{Num(lingvo["peak_mib"], 11, 1)}'
        f'{Num(func["peak_mib"], 10, 1)}')
  return '\n'.join(lines)
