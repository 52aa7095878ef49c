"""The schedules benchmark: what schedules, virtual stages and engines cost.

Each comparison is a ratio of two measured training steps (medians over
interleaved repeats, each configuration in a worker process; see `runner`)
with the target it is held to:

* the loop engine's step against the unrolled engine's (8 FC 1024, batch
  2048, K = 4, M = 64) and against Lingvo's PipeliningLayer on tiny stages
  (16 FC 128, batch 1024, K = 8, M = 64), TensorFlow's default threads;
* the cost of re-materialization at K = 1, M = 1 (8 FC 1024, batch 2048),
  with one thread per op and with the default threads;
* circular stages (v = 2) against GPipe at K = 2, M = 2, and interleaved
  1F1B against plain 1F1B at M = K = 2, each logical device one core;
* 1F1B without re-materialization against GPipe: peak memory at M = 32
  (8 FC 1024 and a loss cell, K = 2, 256 rows per micro-batch), its growth
  from M = 8 to 32, and the step at K = 2, M = 8 with default threads;
* the zero-bubble schedules against 1F1B: 'zb1p' and 'zbv' steps at K = 2,
  M = 4 (8 FC 1024 and a loss cell, batch 2048), each stage in a process
  pinned to one core (held to the targets) and on logical devices of one
  process with one-thread ops (reported), and the peak of 'zb1p' at M = 8:
  of the largest stage, each stage in a process of its own (held to the
  target), and of both stages in one process (reported).

    comparisons = Comparisons()
    measured = runner_lib.MeasureTable(runner, Configs(comparisons), repeats)
    rows = Rows(comparisons, measured)
"""

from typing import Any, Dict, List, NamedTuple, Sequence

from benchmarks import runner as runner_lib

Config = Dict[str, Any]


class Comparison(NamedTuple):
  """A measured ratio and its target.

  Attributes:
    name: What is compared.
    measure: 'step_s' or 'peak_mib'.
    numerator: The configuration measured.
    denominator: The configuration it is compared with.
    target: The ratio must be at most this (None: reported only).
  """
  name: str
  measure: str
  numerator: Config
  denominator: Config
  target: Any


def _Gpipe(num_layers, dim, batch, micro, remat, stages, mode='graph',
           engine='auto', schedule='gpipe', virtual_stages=1, threads=0,
           steps=5, processes=False):
  return runner_lib.Config(
      'gpipe', num_layers, dim, batch, steps, micro, remat, stages=stages,
      warmups=2, mode=mode, engine=engine, schedule=schedule,
      virtual_stages=virtual_stages, intra_op_threads=threads,
      processes=processes)


def Comparisons(small: bool = False) -> List[Comparison]:
  """The comparisons of the schedules benchmark (see the module docstring).

  Args:
    small: Tiny sizes (dims 32 and 16, 8 rows per micro-batch), to check
      that every comparison builds and runs; its ratios mean nothing.

  Returns:
    The comparisons.
  """
  comparisons = []
  rows = 8 if small else 256  # Per micro-batch, in the memory comparisons.
  # The loop engine's per-tick cost.
  big = dict(num_layers=8, dim=32 if small else 1024,
             batch=256 if small else 2048)
  sizes = f"{big['num_layers']} FC {big['dim']}, batch {big['batch']}"
  comparisons.append(Comparison(
      f'loop / unrolled step, K=4 M=64 ({sizes})', 'step_s',
      _Gpipe(**big, micro=64, remat='always', stages=4, engine='loop'),
      _Gpipe(**big, micro=64, remat='always', stages=4, engine='unrolled'),
      1.10))
  # Tiny steps (25-30 ms) vary by 10-30% from step to step: 20 of them.
  tiny = dict(num_layers=16, dim=16 if small else 128,
              batch=128 if small else 1024, steps=20)
  comparisons.append(Comparison(
      "loop / Lingvo's PipeliningLayer step, K=8 M=64 "
      f"({tiny['num_layers']} FC {tiny['dim']}, batch {tiny['batch']})",
      'step_s',
      _Gpipe(**tiny, micro=64, remat='always', stages=8, engine='loop'),
      runner_lib.Config('lingvo', tiny['num_layers'], tiny['dim'],
                        tiny['batch'], tiny['steps'], 64, stages=8,
                        warmups=2), 1.00))
  # The loop engine's per-tick overhead on tiny stages, which 'auto' weighs
  # (schedule.LOOP_TICK_SECONDS).
  comparisons.append(Comparison(
      'loop / unrolled step, K=8 M=64 '
      f"({tiny['num_layers']} FC {tiny['dim']}, batch {tiny['batch']})",
      'step_s',
      _Gpipe(**tiny, micro=64, remat='always', stages=8, engine='loop'),
      _Gpipe(**tiny, micro=64, remat='always', stages=8, engine='unrolled'),
      None))
  # Re-materialization's cost: one extra forward would be about 4/3.
  for threads, label in ((1, 'one thread per op'), (0, 'default threads')):
    plain = runner_lib.Config('plain', **big, steps=5, warmups=2,
                              intra_op_threads=threads)
    for remat in ('never', 'always'):
      comparisons.append(Comparison(
          f"remat '{remat}' / plain stack step, K=1 M=1 ({label})", 'step_s',
          _Gpipe(**big, micro=1, remat=remat, stages=1, threads=threads),
          plain, None))
  # Circular and interleaved stages cut the bubble: one core per device.
  for engine in ('unrolled', 'loop'):
    comparisons.append(Comparison(
        f'circular v=2 / GPipe step, K=2 M=2 ({engine}, one core per device)',
        'step_s',
        _Gpipe(**big, micro=2, remat='always', stages=2, engine=engine,
               virtual_stages=2, threads=1),
        _Gpipe(**big, micro=2, remat='always', stages=2, engine=engine,
               threads=1), 0.92))
  comparisons.append(Comparison(
      'interleaved 1F1B v=2 / 1F1B step, K=2 M=2 (one core per device)',
      'step_s',
      _Gpipe(**big, micro=2, remat='never', stages=2, schedule='1f1b',
             virtual_stages=2, threads=1),
      _Gpipe(**big, micro=2, remat='never', stages=2, schedule='1f1b',
             threads=1), 1.00))
  # 1F1B keeps the activations of the micro-batches in flight only.
  def Loss(micro, remat, schedule, engine='auto', processes=False):
    return _Gpipe(8, big['dim'], rows * micro, micro, remat, 2,
                  engine=engine, schedule=schedule, steps=3,
                  processes=processes)
  for engine in ('unrolled', 'loop'):
    comparisons.append(Comparison(
        f"1F1B 'never' / GPipe 'never' ({engine}) peak, K=2 M=32", 'peak_mib',
        Loss(32, 'never', '1f1b'), Loss(32, 'never', 'gpipe', engine), 0.35))
  comparisons.append(Comparison(
      "1F1B 'never' peak, M=32 / M=8 (K=2)", 'peak_mib',
      Loss(32, 'never', '1f1b'), Loss(8, 'never', '1f1b'), 1.5))
  comparisons.append(Comparison(
      "1F1B 'never' / GPipe 'always' step, K=2 M=8 (default threads)",
      'step_s', Loss(8, 'never', '1f1b'), Loss(8, 'always', 'gpipe'), 0.85))
  # Zero bubble: the weight gradients fill 1F1B's bubble (8 FC and a loss
  # cell, batch 2048, K = 2, M = 4). Each stage in a process pinned to a
  # core of its own: on logical devices of one process, a device's
  # independent ops (a backward's two matmuls, W's four) run on both cores,
  # and 1F1B's bubble is not idle.
  def ZeroBubble(schedule, processes):
    return _Gpipe(8, big['dim'], big['batch'], 4, 'never', 2,
                  schedule=schedule, threads=1, processes=processes,
                  virtual_stages=2 if schedule == 'zbv' else 1)
  for name, target in (('zb1p', 0.92), ('zbv', 0.88)):
    comparisons.append(Comparison(
        f"{name} / 1F1B step, K=2 M=4 ('never', a pinned process per "
        'stage)', 'step_s', ZeroBubble(name, True), ZeroBubble('1f1b', True),
        target))
  for name in ('zb1p', 'zbv'):
    comparisons.append(Comparison(
        f"{name} / 1F1B step, K=2 M=4 ('never', logical devices, "
        'one-thread ops)', 'step_s', ZeroBubble(name, False),
        ZeroBubble('1f1b', False), None))
  # A device's memory is its own: the peak of the largest stage, each in a
  # process (an allocator) of its own. ZB-H1 keeps the largest stage's (the
  # first's) peak; on the last stage a deferred W holds a micro-batch more
  # than 1F1B, which shows in the peak of both stages in one process.
  comparisons.append(Comparison(
      "zb1p / 1F1B peak, K=2 M=8 ('never', a process per stage: the largest)",
      'peak_mib', Loss(8, 'never', 'zb1p', processes=True),
      Loss(8, 'never', '1f1b', processes=True), 1.10))
  comparisons.append(Comparison(
      "zb1p / 1F1B peak, K=2 M=8 ('never', both stages in one process)",
      'peak_mib', Loss(8, 'never', 'zb1p'), Loss(8, 'never', '1f1b'), None))
  return comparisons


def Select(comparisons: Sequence[Comparison],
           text: str) -> List[Comparison]:
  """The comparisons whose name contains `text`.

  Args:
    comparisons: From `Comparisons`.
    text: Part of a comparison's name, e.g. 'K=4 M=64'.

  Returns:
    The matching comparisons, in order.

  Raises:
    ValueError: if none matches; the message lists the names.
  """
  selected = [c for c in comparisons if text in c.name]
  if not selected:
    raise ValueError(
        f'--schedules_match={text!r} is in no comparison\'s name; the names '
        f'are {[c.name for c in comparisons]}')
  return selected


def Configs(comparisons: Sequence[Comparison]) -> List[Config]:
  """Every configuration to measure, once each, in order of appearance."""
  configs = []
  for c in comparisons:
    for config in (c.numerator, c.denominator):
      if config not in configs:
        configs.append(config)
  return configs


def Rows(comparisons: Sequence[Comparison],
         measured: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """One row per comparison: both values, their ratio, the target, whether met.

  Args:
    comparisons: From `Comparisons`.
    measured: `runner.MeasureTable` results of `Configs(comparisons)`, in that
      order.

  Returns:
    JSON-ready dicts.
  """
  configs = Configs(comparisons)
  rows = []
  for c in comparisons:
    a = measured[configs.index(c.numerator)][c.measure]
    b = measured[configs.index(c.denominator)][c.measure]
    ratio = a / b if b else float("nan")
    rows.append({
        'name': c.name,
        'measure': c.measure,
        'numerator': runner_lib.Name(c.numerator),
        'denominator': runner_lib.Name(c.denominator),
        'value': a,
        'reference': b,
        'ratio': ratio,
        'target': c.target,
        'met': None if c.target is None else ratio <= c.target,
    })
  return rows


def FormatTable(rows: Sequence[Dict[str, Any]]) -> str:
  """The rows as text: ratio, the two values, target and verdict."""
  lines = [f'{"comparison":78} {"ratio":>6} {"value":>10} {"reference":>10} '
           f'{"target":>7}']
  for r in rows:
    unit = ' s' if r['measure'] == 'step_s' else ' MiB'
    target = '' if r['target'] is None else (
        f'<= {r["target"]:.2f} {"met" if r["met"] else "MISSED"}')
    lines.append(f'{r["name"]:78} {r["ratio"]:6.2f} '
                 f'{r["value"]:8.3f}{unit:>2} {r["reference"]:8.3f}{unit:>2} '
                 f'{target}')
  return '\n'.join(lines)
