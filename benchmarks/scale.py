"""The scale benchmark: what the pipeline costs to start and to step as M grows.

For every K and M, one training step of a stack of Lingvo FCLayers (one stage
per logical CPU device) built by GPipeSequentialLayer's two engines,
'unrolled' and 'loop', and by Lingvo's `gpipe.PipeliningLayer`:

* graph mode (TF1 graph and session, gradients colocated with their ops as
  Lingvo's trainer does): graph build time, first `session.run`, steady step
  time and peak memory, for all three;
* an eager `tf.function` (GradientTape): trace + first call, for both
  engines (Lingvo's layer does not run in tf.function);
* the same function compiled by XLA (jit_compile=True): trace + compile +
  first call, steady step, peak memory and the lines of its HLO.

From the graph-mode numbers it also judges the layer's engine='auto': the cost
of starting and training `schedule.AUTO_TRAINING_STEPS` steps (build + first
run + that many steps) with the engine 'auto' picks, against the better of
the two. Every measurement is a
worker process (see `runner`).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks import runner as runner_lib
from lingvo_gpipe.planning import schedule

IMPLEMENTATIONS = ('unrolled', 'loop', 'lingvo')
# The engines of GPipeSequentialLayer among them.
_ENGINES = ('unrolled', 'loop')
# Warm-up steps of every configuration: the first builds and optimizes.
WARMUPS = 2
Shape = Tuple[int, int]


def Configs(num_layers: int, dim: int, batch: int, steps: int,
            shapes: Sequence[Shape]) -> List[Dict[str, Any]]:
  """Per (K, M): each engine in graph, function and XLA mode, then Lingvo.

  Args:
    num_layers: FCLayers in every model.
    dim: Their size.
    batch: The mini-batch size.
    steps: Measured steps after `WARMUPS` warm-up steps.
    shapes: (K, M) pairs.

  Returns:
    The configurations, in the order `Rows` expects: 7 per shape.
  """
  configs = []
  for k, m in shapes:
    for engine in _ENGINES:
      for mode in runner_lib.MODES:
        configs.append(runner_lib.Config(
            'gpipe', num_layers, dim, batch, steps, m, 'always', stages=k,
            warmups=WARMUPS, mode=mode, engine=engine))
    configs.append(runner_lib.Config('lingvo', num_layers, dim, batch, steps,
                                     m, stages=k, warmups=WARMUPS))
  return configs


def _StartAndTrain(graph: Dict[str, Any]) -> float:
  """Seconds to build the graph, run the first step and train a run's steps."""
  return (graph['build_s'] + graph['warmup_s'] +
          schedule.AUTO_TRAINING_STEPS * graph['step_s'])


def Rows(measured: List[Dict[str, Any]],
         shapes: Sequence[Shape]) -> List[Dict[str, Any]]:
  """One row per (K, M) from `runner.MeasureTable` of `Configs`.

  Args:
    measured: The measured configurations, in `Configs` order.
    shapes: The same (K, M) pairs.

  Returns:
    JSON-ready rows: stages, micro_batches; per implementation its graph-mode
    numbers (build_s, first_s, step_s, peak_mib), and per engine function
    (trace_first_s) and XLA numbers (first_s, step_s, peak_mib, hlo_lines);
    auto_engine, auto_cost_ratio (its start + a run's steps / the better
    engine's) and best_engine.
  """
  rows = []
  per_shape = 2 * len(runner_lib.MODES) + 1
  for i, (k, m) in enumerate(shapes):
    runs = measured[i * per_shape:(i + 1) * per_shape]
    row = {'stages': k, 'micro_batches': m}
    for e, engine in enumerate(_ENGINES):
      graph, function, xla = runs[3 * e:3 * e + 3]
      row[engine] = {
          'build_s': graph['build_s'],
          'first_s': graph['warmup_s'],
          'step_s': graph['step_s'],
          'peak_mib': graph['peak_mib'],
          'function_trace_first_s': function['build_s'] + function['warmup_s'],
          'xla_first_s': xla['build_s'] + xla['warmup_s'],
          'xla_step_s': xla['step_s'],
          'xla_peak_mib': xla['peak_mib'],
          'hlo_lines': xla['runs'][0]['hlo_lines'],
          'start_and_train_s': _StartAndTrain(graph),
      }
    lingvo = runs[-1]
    row['lingvo'] = {
        'build_s': lingvo['build_s'],
        'first_s': lingvo['warmup_s'],
        'step_s': lingvo['step_s'],
        'peak_mib': lingvo['peak_mib'],
        'start_and_train_s': _StartAndTrain(lingvo),
    }
    auto = schedule.ChooseEngine('auto', k, m, 'always')
    best = min(_ENGINES, key=lambda e: row[e]['start_and_train_s'])
    row.update(
        auto_engine=auto,
        best_engine=best,
        auto_cost_ratio=runner_lib.Ratio(row[auto]['start_and_train_s'],
                                         row[best]['start_and_train_s']))
    rows.append(row)
  return rows


def _Find(rows: List[Dict[str, Any]], k: int, m: int) -> Optional[Dict[str,
                                                                       Any]]:
  for row in rows:
    if (row['stages'], row['micro_batches']) == (k, m):
      return row
  return None


def Targets(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """The loop engine's targets, each with its measured value.

  Targets whose (K, M) points were not measured are left out.

  Args:
    rows: `Rows`.

  Returns:
    Dicts with 'target' (text), 'value' (a number or text) and 'met' (bool).
  """
  targets = []
  small, large = _Find(rows, 4, 4), _Find(rows, 4, 64)
  if small and large:
    ratio = large['loop']['hlo_lines'] / small['loop']['hlo_lines']
    targets.append({'target': 'loop HLO lines, K=4: M=64 / M=4 <= 1.25',
                    'value': ratio, 'met': ratio <= 1.25})
  small, large = _Find(rows, 8, 8), _Find(rows, 8, 64)
  if small and large:
    ratio = (large['loop']['function_trace_first_s'] /
             small['loop']['function_trace_first_s'])
    targets.append({
        'target': 'loop tf.function trace + first call, K=8: M=64 / M=8 '
                  '<= 1.5',
        'value': ratio, 'met': ratio <= 1.5})
  worst = max(row['loop']['build_s'] / row['lingvo']['build_s']
              for row in rows)
  targets.append({'target': 'loop graph build / Lingvo <= 1 at every (K, M)',
                  'value': worst, 'met': worst <= 1.0})
  worst = max(row['loop']['step_s'] / row['lingvo']['step_s'] for row in rows)
  targets.append({'target': 'loop step / Lingvo <= 1 at every (K, M)',
                  'value': worst, 'met': worst <= 1.0})
  slower = [row['loop']['step_s'] / row['unrolled']['step_s'] for row in rows
            if row['unrolled']['step_s'] < row['loop']['step_s']]
  worst = max(slower, default=1.0)
  targets.append({
      'target': 'loop step / unrolled <= 1.15 where unrolled is faster',
      'value': worst, 'met': worst <= 1.15})
  worst = max(row['auto_cost_ratio'] for row in rows)
  targets.append({
      'target': f"'auto' start + {schedule.AUTO_TRAINING_STEPS:,} steps / "
                "the better engine's "
                '<= 1.10 at every (K, M)',
      'value': worst, 'met': worst <= 1.10})
  return targets


def _Seconds(value: float) -> str:
  return f'{value:.2f}' if value < 100 else f'{value:.0f}'


def FormatTable(rows: List[Dict[str, Any]]) -> str:
  """The scale table: one line per (K, M); u = unrolled, l = loop, L = Lingvo.

  Args:
    rows: `Rows`.

  Returns:
    The table as text, two header lines first.
  """
  header = (f'{"K":>2} {"M":>4} | {"HLO lines":>13} | {"tf.fn first s":>13} |'
            f' {"XLA first s":>13} | {"graph build s":>18} | '
            f'{"first run s":>18} | {"step ms":>20} | {"peak MiB":>20} | auto')
  units = (f'{"":>7} | {"u":>6} {"l":>6} | {"u":>6} {"l":>6} | {"u":>6} '
           f'{"l":>6} | {"u":>5} {"l":>5} {"L":>6} | {"u":>5} {"l":>5} '
           f'{"L":>6} | {"u":>6} {"l":>6} {"L":>6} | {"u":>6} {"l":>6} '
           f'{"L":>6} |')
  lines = [header, units, '-' * len(header)]
  for row in rows:
    u, l, lingvo = row['unrolled'], row['loop'], row['lingvo']
    lines.append(
        f'{row["stages"]:>2} {row["micro_batches"]:>4} | '
        f'{u["hlo_lines"]:>6} {l["hlo_lines"]:>6} | '
        f'{_Seconds(u["function_trace_first_s"]):>6} '
        f'{_Seconds(l["function_trace_first_s"]):>6} | '
        f'{_Seconds(u["xla_first_s"]):>6} {_Seconds(l["xla_first_s"]):>6} | '
        f'{_Seconds(u["build_s"]):>5} {_Seconds(l["build_s"]):>5} '
        f'{_Seconds(lingvo["build_s"]):>6} | '
        f'{_Seconds(u["first_s"]):>5} {_Seconds(l["first_s"]):>5} '
        f'{_Seconds(lingvo["first_s"]):>6} | '
        f'{u["step_s"] * 1e3:>6.1f} {l["step_s"] * 1e3:>6.1f} '
        f'{lingvo["step_s"] * 1e3:>6.1f} | '
        f'{u["peak_mib"]:>6.1f} {l["peak_mib"]:>6.1f} '
        f'{lingvo["peak_mib"]:>6.1f} | {row["auto_engine"]} '
        f'({row["auto_cost_ratio"]:.2f}x best)')
  return '\n'.join(lines)


def FormatTargets(targets: List[Dict[str, Any]]) -> str:
  """One line per target: met or missed, and the measured value."""
  lines = []
  for t in targets:
    value = t['value']
    shown = f'{value:.2f}' if isinstance(value, float) else str(value)
    lines.append(f'  [{"met" if t["met"] else "MISSED"}] {t["target"]}: '
                 f'{shown}')
  return '\n'.join(lines)


def DrawStartup(rows: List[Dict[str, Any]], path: str, title: str) -> None:
  """Plots start-up cost against M: one panel per kind of start-up.

  Panels: tf.function trace + first call, XLA trace + compile + first call,
  and graph build + first session.run (with Lingvo's). One line per
  implementation and K.

  Args:
    rows: `Rows`.
    path: Where to write the PNG.
    title: The figure's title.
  """
  # Only this function needs matplotlib (it takes a while to load).
  # pylint: disable=g-import-not-at-top
  from matplotlib import figure
  # pylint: enable=g-import-not-at-top
  colors = {'unrolled': '#DD8452', 'loop': '#4C72B0', 'lingvo': '#55A868'}
  styles = ['-', '--', ':', '-.']
  stages = sorted({row['stages'] for row in rows})
  panels = [
      ('tf.function: trace + first call', _ENGINES,
       lambda r, e: r[e]['function_trace_first_s']),
      ('XLA: trace + compile + first call', _ENGINES,
       lambda r, e: r[e]['xla_first_s']),
      ('graph mode: build + first session.run', IMPLEMENTATIONS,
       lambda r, e: r[e]['build_s'] + r[e]['first_s']),
  ]
  fig = figure.Figure(figsize=(15, 4.8), layout='constrained')
  axes = fig.subplots(1, len(panels), sharey=True)
  for ax, (panel, implementations, value) in zip(axes, panels):
    for impl in implementations:
      for k, style in zip(stages, styles * len(stages)):
        points = sorted((row['micro_batches'], value(row, impl))
                        for row in rows if row['stages'] == k)
        ax.plot([p[0] for p in points], [p[1] for p in points],
                color=colors[impl], linestyle=style, marker='o',
                markersize=3, label=f'{impl} K={k}')
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel('micro-batches M')
    ax.set_title(panel, fontsize=10)
    ax.grid(alpha=0.3, which='both')
  axes[0].set_ylabel('seconds')
  axes[-1].legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.0, 1.0))
  fig.suptitle(title, fontsize=11)
  fig.savefig(path, dpi=110)


def AllShapes(stages: Sequence[int],
              micro_batches: Sequence[int]) -> List[Shape]:
  """Every (K, M) pair, K-major."""
  return [(k, m) for k in stages for m in micro_batches]
