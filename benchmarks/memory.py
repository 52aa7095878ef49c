"""The memory benchmark: peak memory of one training step, plain vs. GPipe.

One training step (forward, gradients, SGD update) of a deep stack of Lingvo
FCLayers: the plain `SequentialLayer` and GPipeSequentialLayer with one stage
for every engine, re-materialization mode and number of micro-batches M, in
a TF1 graph and session or compiled by XLA (`MeasureRows`); then the largest
number of layers whose graph-mode step fits a memory budget, plain vs. GPipe
(`CompareLargest`). Every measurement is a worker process (see `runner`).
"""

import concurrent.futures
import math
from typing import Any, Callable, Dict, List, Sequence, Tuple

from benchmarks import runner as runner_lib

# The GPipe paper's largest AmoebaNet on one 8 GB core: 318M parameters with
# GPipe (re-materialization) against 82M without.
PAPER_RATIO = 318.0 / 82.0


# The engine of the largest-model search's GPipe model.
_BUDGET_ENGINE = 'unrolled'


def Configs(num_layers: int,
            dim: int,
            batch: int,
            steps: int,
            micro_batches: Sequence[int],
            remats: Sequence[str],
            engines: Sequence[str] = ('unrolled',),
            modes: Sequence[str] = ('graph',)) -> List[Dict[str, Any]]:
  """The table: per mode, plain, then GPipe (K=1) per engine, remat and M.

  The loop engine always re-materializes: other remat modes are not listed
  for it.

  Args:
    num_layers: FCLayers in every model.
    dim: Their size.
    batch: The mini-batch size.
    steps: Measured steps per configuration.
    micro_batches: The numbers of micro-batches M.
    remats: Re-materialization modes.
    engines: GPipeSequentialLayer engines ('unrolled', 'loop').
    modes: `runner.MODES` to measure in ('graph', 'xla').

  Returns:
    The configurations, each mode's plain model first.
  """
  configs = []
  for mode in modes:
    configs.append(runner_lib.Config('plain', num_layers, dim, batch, steps,
                                     mode=mode))
    for engine in engines:
      configs += [
          runner_lib.Config('gpipe', num_layers, dim, batch, steps, m, remat,
                            mode=mode, engine=engine)
          for remat in remats
          for m in micro_batches
      ]
  return configs


def MeasureRows(runner: runner_lib.Runner, configs: List[Dict[str, Any]],
                repeats: int) -> List[Dict[str, Any]]:
  """Measures the table; adds each row's peak and step ratio to its plain.

  Args:
    runner: Runs the workers.
    configs: `Configs`, each mode's plain model first.
    repeats: Runs per configuration (medians are reported).

  Returns:
    The rows of `runner.MeasureTable` with peak_ratio and step_ratio against
    the plain model of the same mode.
  """
  rows = runner_lib.MeasureTable(runner, configs, repeats)
  plain = {}
  for row in rows:
    mode = row['config']['mode']
    if row['config']['model'] == 'plain':
      plain[mode] = row
    row['peak_ratio'] = runner_lib.Ratio(row['peak_mib'],
                                         plain[mode]['peak_mib'])
    row['step_ratio'] = runner_lib.Ratio(row['step_s'], plain[mode]['step_s'])
  return rows


def _NextProbe(points: Dict[int, float], budget: float, lo: int, hi: int,
               bisect: bool, open_above: bool) -> int:
  """The next number of layers to try in `LargestUnderBudget`.

  Peak memory grows about linearly with the number of layers, so the next
  probe is where the line through the measured points nearest the budget
  meets it (with one point: a line through the origin), clamped into the open
  interval (lo, hi) and, while no model is known to fail, to at most 4 lo
  (galloping, so a convex curve cannot send the search to the bound);
  `bisect` halves the interval instead.

  Args:
    points: Measured {num_layers: peak MiB}.
    budget: The budget in MiB.
    lo: The largest number of layers known to fit (0: none).
    hi: The smallest number known not to fit (or the search bound + 1).
    bisect: Whether to bisect instead of interpolating.
    open_above: Whether no probed model above lo failed (hi is the bound).

  Returns:
    An int in (lo, hi).
  """
  if bisect:
    return (lo + hi) // 2
  nearest = sorted(points, key=lambda n: abs(points[n] - budget))[:2]
  if len(nearest) == 2 and points[nearest[0]] != points[nearest[1]]:
    (n0, p0), (n1, p1) = [(n, points[n]) for n in nearest]
    guess = n0 + (budget - p0) * (n1 - n0) / (p1 - p0)
  elif nearest:
    guess = nearest[0] * budget / max(points[nearest[0]], 1e-9)
  else:
    guess = lo + 1
  if open_above and lo > 0:
    guess = min(guess, 4 * lo)
  return min(max(int(math.floor(guess)), lo + 1), hi - 1)


def LargestUnderBudget(measure: Callable[[int], float], budget: float,
                       max_layers: int,
                       known: Dict[int, float]) -> Tuple[int, Dict[int, float]]:
  """The largest number of layers whose peak stays within `budget`.

  Safeguarded interpolation: each probe is the linear estimate of where the
  peak reaches the budget; if a probe fails to halve the bracket, the next one
  bisects, so the search takes O(log max_layers) probes at worst and about
  three when memory is linear in the number of layers.

  Args:
    measure: Maps a number of layers to the peak MiB of one training step.
    budget: The budget in MiB.
    max_layers: Larger models are not tried.
    known: Already measured {num_layers: peak MiB}, used as free probes.

  Returns:
    (num_layers, points): the answer (0 if even one layer does not fit) and
    every {num_layers: peak MiB} known at the end.
  """
  points = dict(known)
  width, bisect = None, False
  while True:
    lo = min(max((n for n, p in points.items() if p <= budget), default=0),
             max_layers)
    fails = [n for n, p in points.items() if p > budget]
    hi = min(fails + [max_layers + 1])
    if hi - lo <= 1:
      return lo, points
    # Bisect when the last interpolated probe did not halve a closed bracket.
    closed = bool(fails) and lo > 0
    bisect = (closed and not bisect and width is not None and
              hi - lo > width / 2)
    width = hi - lo if closed else None
    n = _NextProbe(points, budget, lo, hi, bisect, open_above=not fails)
    points[n] = measure(n)


def _SearchLargest(runner: runner_lib.Runner,
                   config_fn: Callable[[int], Dict[str, Any]], budget: float,
                   known: Dict[int, float], max_layers: int) -> Dict[str, Any]:
  """Runs `LargestUnderBudget` for one model; returns a JSON-ready dict."""
  results = {}

  def Measure(num_layers: int) -> float:
    results[num_layers] = runner.Run(config_fn(num_layers))
    return results[num_layers]['peak_mib']

  num_layers, points = LargestUnderBudget(Measure, budget, max_layers, known)
  config = config_fn(num_layers) if num_layers else None
  dim = config_fn(1)['dim']
  return {
      'name': runner_lib.Name(config_fn(1)),
      'num_layers': num_layers,
      'num_params': num_layers * (dim * dim + dim),
      'peak_mib': points.get(num_layers),
      'capped': num_layers == max_layers,
      'config': config,
      'probes': {str(n): p for n, p in sorted(points.items())},
      'probe_runs': {str(n): r for n, r in sorted(results.items())},
  }


def CompareLargest(runner: runner_lib.Runner, rows: List[Dict[str, Any]],
                   budget_mib: float, micro_batches: int,
                   max_layers: int) -> Dict[str, Any]:
  """The largest plain and GPipe models within a budget, searched at once.

  Args:
    runner: Runs the workers (the two searches share its slots).
    rows: `MeasureRows` of the table, with a graph-mode plain row; its peaks
      are free probes (plain, and unrolled GPipe with `micro_batches` and
      remat 'always', in graph mode).
    budget_mib: The peak one training step may reach.
    micro_batches: M of the GPipe model (one stage, remat 'always').
    max_layers: Larger models are not tried (the result is then 'capped').

  Returns:
    A JSON-ready dict: budget_mib, layer_ratio and param_ratio (GPipe /
    plain), and for 'plain' and 'gpipe' the answer, its peak and every probe.
  """
  graph_rows = [row for row in rows if row['config']['mode'] == 'graph']
  plain = graph_rows[0]
  num_layers = plain['config']['num_layers']
  known = {
      'plain': {num_layers: plain['peak_mib']},
      'gpipe': {
          num_layers: row['peak_mib'] for row in graph_rows[1:]
          if row['config']['micro_batches'] == micro_batches and
          row['config']['remat'] == 'always' and
          row['config']['engine'] == _BUDGET_ENGINE
      },
  }
  shape = {key: plain['config'][key] for key in ('dim', 'batch')}
  config_fns = {
      'plain': lambda n: runner_lib.Config('plain', n, steps=1, **shape),
      'gpipe': lambda n: runner_lib.Config('gpipe', n, steps=1,
                                           micro_batches=micro_batches,
                                           remat='always',
                                           engine=_BUDGET_ENGINE, **shape),
  }
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    futures = {
        name: pool.submit(_SearchLargest, runner, config_fns[name],
                          budget_mib, known[name], max_layers)
        for name in ('plain', 'gpipe')
    }
    results = {name: f.result() for name, f in futures.items()}
  return dict(
      budget_mib=budget_mib,
      layer_ratio=runner_lib.Ratio(results['gpipe']['num_layers'],
                                   results['plain']['num_layers']),
      param_ratio=runner_lib.Ratio(results['gpipe']['num_params'],
                                   results['plain']['num_params']),
      **results)


def FormatTable(rows: List[Dict[str, Any]]) -> str:
  """The memory table: one fixed-width line per configuration.

  Args:
    rows: Rows of `MeasureRows`, each mode's plain model first.

  Returns:
    The table as text, header first; ratios are to the plain model of the
    same mode.
  """
  lines = [
      f'{"model":<34}{"peak MiB":>10}{"x plain":>9}{"step s":>9}'
      f'{"x plain":>9}',
  ]
  lines.append('-' * len(lines[0]))
  for row in rows:
    lines.append(f'{row["name"]:<34}{row["peak_mib"]:>10.1f}'
                 f'{runner_lib.FormatRatio(row["peak_ratio"]):>9}'
                 f'{row["step_s"]:>9.2f}'
                 f'{runner_lib.FormatRatio(row["step_ratio"]):>9}')
  return '\n'.join(lines)


def FormatBudget(budget: Dict[str, Any], dim: int, batch: int) -> str:
  """The result of `CompareLargest` as text.

  Args:
    budget: `CompareLargest`'s dict.
    dim: The FCLayers' size, for the heading.
    batch: The mini-batch size, for the heading.

  Returns:
    A heading, one line per model and the GPipe / plain ratio.
  """
  lines = [f'Largest model within {budget["budget_mib"]:.1f} MiB (one '
           f'training step, dim {dim}, batch {batch}):']
  for result in (budget['plain'], budget['gpipe']):
    peak = result['peak_mib']
    peak = f'{peak:.1f} MiB' if peak is not None else '-'
    capped = ' (capped by --budget_max_layers)' if result['capped'] else ''
    lines.append(f'  {result["name"]:<24}{result["num_layers"]:>5} layers '
                 f'{result["num_params"] / 1e6:>8.2f}M params  peak '
                 f'{peak}{capped}')
  ratio = budget['layer_ratio']
  lines.append(
      '  gpipe / plain: ' + (f'{ratio:.2f}x' if ratio else 'n/a') +
      f' layers and parameters (target >= 3.5x; GPipe paper 318M/82M = '
      f'{PAPER_RATIO:.1f}x)')
  return '\n'.join(lines)
