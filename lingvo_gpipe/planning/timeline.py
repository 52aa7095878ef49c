"""Pictures and traces of a training step's events (simulated or measured).

Pure Python; `DrawTimeline` imports matplotlib when called. A simulated
GPipe step of K = 4, M = 8 as a picture and a trace:

    >>> import os, shutil, tempfile
    >>> from lingvo_gpipe.planning import schedule
    >>> table = schedule.BuildTable('gpipe', 4, 8)
    >>> sim = simulate.Simulate(table, [1.0] * 4, [2.0] * 4)
    >>> out = tempfile.mkdtemp()
    >>> DrawTimeline(sim.events, 4, os.path.join(out, 'step.png'), 'K=4, M=8')
    >>> WriteChromeTrace(sim.events, 4, os.path.join(out, 'step.json'),
    ...                  'K=4, M=8')
    >>> sorted(os.listdir(out))
    ['step.json', 'step.png']
    >>> shutil.rmtree(out)
"""

import collections
import json
from typing import Optional, Sequence, Tuple

from lingvo_gpipe.planning import simulate

# Picture and trace colours of the phases of a stage call.
PHASE_COLORS = {
    'forward': '#4C72B0',
    'recompute': '#DD8452',
    'backward': '#55A868',
    'weight': '#8172B3',  # The weight gradient of a split backward.
}
# Label boxes with their micro-batch only if there are at most this many.
_MAX_LABELLED_EVENTS = 600


def TimeUnit(span: float) -> Tuple[float, str]:
  """(factor, unit name) to show times of a step lasting `span` seconds."""
  for factor, unit in ((1.0, 's'), (1e3, 'ms')):
    if span * factor >= 1.0:
      return factor, unit
  return 1e6, 'us'


def Label(event: simulate.Event, chunked: bool) -> str:
  """'<micro-batch>', or '<chunk>.<micro-batch>' when devices run chunks."""
  return f'{event.chunk}.{event.micro_batch}' if chunked else str(
      event.micro_batch)


def _Chunked(events: Sequence[simulate.Event]) -> bool:
  """Whether some device runs a chunk other than its own index.

  It does when v > 1, or when the table places chunk c off device c.
  """
  return any(e.chunk != e.stage for e in events)


def DrawTimeline(events: Sequence[simulate.Event], num_stages: int, path: str,
                 title: str, time_unit: Optional[Tuple[float, str]] = None
                ) -> None:
  """Draws a step as a PNG: one row per device, one box per call phase.

  Boxes are coloured by phase (`PHASE_COLORS`) and, when there are few enough
  to read, labelled with their micro-batch ('<chunk>.<micro-batch>' with
  several chunks per device or chunks placed on other devices than their
  index, so that a circular or V-shaped step's passes show), so the
  pipeline's fill, steady state and drain show at a glance.

  Args:
    events: The step's events (simulated or measured), times in seconds.
    num_stages: K, the number of rows.
    path: Where to write the PNG.
    title: The picture's title.
    time_unit: (factor, name) for the time axis; default: chosen from the
      step's length (s, ms or us).
  """
  # Only the subcommands that draw need matplotlib (it takes a while to load).
  # pylint: disable=g-import-not-at-top
  from matplotlib import figure
  from matplotlib import patches
  # pylint: enable=g-import-not-at-top
  end = max(e.end for e in events)
  factor, unit = time_unit or TimeUnit(end)
  height = 1.5 + min(0.5 * num_stages, 6 + 0.12 * num_stages)
  fig = figure.Figure(figsize=(12, height), layout='constrained')
  ax = fig.add_subplot()
  boxes = collections.defaultdict(list)
  for e in events:
    boxes[e.stage, e.phase].append(
        (e.start * factor, (e.end - e.start) * factor))
  edge = 0.5 if len(events) <= _MAX_LABELLED_EVENTS * 4 else 0.0
  for (stage, phase), ranges in boxes.items():
    ax.broken_barh(ranges, (stage - 0.4, 0.8),
                   facecolors=PHASE_COLORS[phase], edgecolor='white',
                   linewidth=edge)
  if len(events) <= _MAX_LABELLED_EVENTS:
    min_width = end * factor / 120
    chunked = _Chunked(events)
    for e in events:
      width = (e.end - e.start) * factor
      if width >= min_width:
        ax.text((e.start * factor) + width / 2, e.stage, Label(e, chunked),
                ha='center', va='center', fontsize=7, color='white')
  ax.set_ylim(num_stages - 0.5, -0.5)
  step = max(1, num_stages // 32)
  ax.set_yticks(range(0, num_stages, step))
  ax.set_yticklabels([f'stage {k}' for k in range(0, num_stages, step)])
  ax.set_xlim(0, end * factor)
  ax.set_xlabel(f'time ({unit})')
  ax.set_title(title, fontsize=10)
  ax.grid(axis='x', alpha=0.3)
  ax.legend(
      handles=[patches.Patch(color=c, label=p)
               for p, c in PHASE_COLORS.items()],
      loc='upper left', bbox_to_anchor=(1.0, 1.0), fontsize=8)
  fig.savefig(path, dpi=110)


def WriteChromeTrace(events: Sequence[simulate.Event], num_stages: int,
                     path: str, name: str) -> None:
  """Writes a step as a Chrome trace: one thread (row) per stage.

  Each call phase is a complete ('X') event named '<phase> <micro-batch>'
  ('<phase> <chunk>.<micro-batch>' as `DrawTimeline` labels), with the
  phase as its category; times are microseconds.

  Args:
    events: The step's events, times in seconds.
    num_stages: K.
    path: Where to write the JSON.
    name: The process name shown above the rows.
  """
  trace = [{'name': 'process_name', 'ph': 'M', 'pid': 0,
            'args': {'name': name}}]
  for k in range(num_stages):
    trace.append({'name': 'thread_name', 'ph': 'M', 'pid': 0, 'tid': k,
                  'args': {'name': f'stage {k}'}})
    trace.append({'name': 'thread_sort_index', 'ph': 'M', 'pid': 0,
                  'tid': k, 'args': {'sort_index': k}})
  chunked = _Chunked(events)
  for e in events:
    trace.append({
        'name': f'{e.phase} {Label(e, chunked)}',
        'cat': e.phase,
        'ph': 'X',
        'ts': e.start * 1e6,
        'dur': (e.end - e.start) * 1e6,
        'pid': 0,
        'tid': e.stage,
        'args': {'stage': e.stage, 'chunk': e.chunk,
                 'micro_batch': e.micro_batch, 'phase': e.phase},
    })
  with open(path, 'w') as f:
    json.dump({'traceEvents': trace, 'displayTimeUnit': 'ms'}, f)
