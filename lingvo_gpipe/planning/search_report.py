"""What `plan.py auto` prints of a search: the table, the winner, the overrides.

Pure Python, no TensorFlow. `search.Search` ranks configurations; this
module says it in text: `FormatTable` the ranked candidates, `Reason` why the
winner won (or `NothingFits` why there is none, with the term that dominates
the smallest peak), `OverrideLines` the `--model_params_override` lines that
select a candidate, `FormatBytes` sizes in binary units. Six cells (16 MB
of weights, gradients and slots each) do not fit two devices of 40 MB:

    >>> Affine = profile_lib.Affine
    >>> fc = profile_lib.CellProfile(
    ...     'fc', Affine(1e-3, 1e-4), Affine(2e-3, 2e-4), update_s=1e-3,
    ...     activation_bytes=4e3, output_bytes=1e3, weight_bytes=4e6,
    ...     gradient_bytes=4e6, slot_bytes=8e6)
    >>> model = profile_lib.Profile(cells=(fc,) * 6, input_bytes=1e3,
    ...                             batch_size=32)
    >>> result = search.Search(model, num_devices=2, memory_per_device=40e6)
    >>> print(FormatTable(result, top=2))  # Its columns are wider.
    rank K v M R schedule remat       engine   step ms     peak fits partition
    ------------------------------------------------------------------------...
       0 2 1 1 1 gpipe    except_last unrolled   78.60 49.6 MiB  no  [3, 3]
       1 2 1 1 1 gpipe    never       unrolled   78.60 49.6 MiB  no  [3, 3]
    (67 more; --json_out lists every candidate)
    >>> print(Reason(result))
    nothing fits memory_per_device=40000000 (38.1 MiB): the smallest
    predicted peak is 52000000 bytes (49.6 MiB, K=2 v=1 M=1 R=1 gpipe
    remat='except_last' [3, 3], device 0), dominated by optimizer_slots:
    22.9 MiB (46%). Give more memory per device, more devices or a smaller
    batch.

`report` has the other tables of plan.py, those of a partition's stages.
"""

from typing import List, Optional, Tuple

from lingvo_gpipe.planning import profile as profile_lib
from lingvo_gpipe.planning import search


def FormatBytes(size: float) -> str:
  """1536 -> '1.5 KiB'."""
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if abs(size) < 1024 or unit == 'GiB':
      return f'{size:.1f} {unit}' if unit != 'B' else f'{size:.0f} B'
    size /= 1024
  return f'{size:.1f} GiB'


def DominantTerm(candidate: profile_lib.Candidate) -> Tuple[str, float]:
  """The largest term of the candidate's peak, and its bytes."""
  name = max(candidate.peak_terms, key=lambda t: candidate.peak_terms[t])
  return name, candidate.peak_terms[name]


def Reason(result: search.SearchResult) -> str:
  """Why the winner won, in a sentence or two."""
  if result.chosen is None:
    return NothingFits(result)
  best = result.candidates[result.chosen]
  fitting = [c for c in result.candidates if c.fits]
  text = (f'{best.Describe()}: the fastest predicted step '
          f'({best.predicted_step_s * 1e3:.1f} ms) of the {len(fitting)} of '
          f'{len(result.candidates)} configurations that fit '
          f'{FormatBytes(result.memory_per_device)} per device; bubble '
          f'{best.bubble_fraction:.2f}, peak '
          f'{FormatBytes(best.predicted_peak_bytes)} '
          f'({best.predicted_peak_bytes / result.memory_per_device:.0%} of '
          f'the budget) on device {best.peak_device}')
  term, size = DominantTerm(best)
  text += f', mostly {term} ({FormatBytes(size)}).'
  if len(fitting) > 1:
    second = fitting[1]
    text += (f' Next: {second.Describe()} at '
             f'{second.predicted_step_s * 1e3:.1f} ms '
             f'(+{second.predicted_step_s / best.predicted_step_s - 1:.1%}).')
  faster = [c for c in result.candidates if not c.fits and
            c.predicted_step_s < best.predicted_step_s]
  if faster:
    quickest = min(faster, key=lambda c: c.predicted_step_s)
    text += (f' Faster but over budget: {quickest.Describe()} at '
             f'{quickest.predicted_step_s * 1e3:.1f} ms, peak '
             f'{FormatBytes(quickest.predicted_peak_bytes)}.')
  return text


def NothingFits(result: search.SearchResult,
                budget: Optional[str] = None) -> str:
  """The message when no configuration fits: the smallest peak and its term.

  Args:
    result: The search.
    budget: How to name the budget searched with (default:
      'memory_per_device=<bytes> (<size>)').

  Returns:
    The message.
  """
  if not result.candidates:
    return 'no configuration could be evaluated: ' + ' '.join(result.skipped)
  smallest = min(result.candidates, key=lambda c: c.predicted_peak_bytes)
  term, size = DominantTerm(smallest)
  if budget is None:
    budget = (f'memory_per_device={result.memory_per_device:.0f} '
              f'({FormatBytes(result.memory_per_device)})')
  return (f'nothing fits {budget}: the smallest predicted '
          f'peak is {smallest.predicted_peak_bytes:.0f} bytes '
          f'({FormatBytes(smallest.predicted_peak_bytes)}, '
          f'{smallest.Describe()}, device {smallest.peak_device}), dominated '
          f'by {term}: {FormatBytes(size)} '
          f'({size / smallest.predicted_peak_bytes:.0%}). Give more memory '
          f'per device, more devices or a smaller batch.')


def OverrideLines(profile: profile_lib.Profile,
                  candidate: profile_lib.Candidate) -> List[str]:
  """The `--model_params_override` lines that select a candidate.

  num_stages and micro_batch_size are set only where the model sets them
  (Lingvo's text format cannot turn a None into an int); the partition
  (K v counts) gives K anyway, and M micro-batches of B / (R M) examples
  agree with either. input.batch_size is the batch of one replica (Lingvo's
  is per model split).

  Args:
    profile: The model.
    candidate: The configuration.

  Returns:
    'key: value' lines.
  """
  path = profile.stack_path
  settings = profile.stack_settings
  lines = []
  if settings.get('num_stages') is not None:
    lines.append(f'{path}.num_stages: {candidate.num_stages}')
  lines += [
      f'{path}.virtual_stages: {candidate.virtual_stages}',
      f'{path}.num_micro_batches: {candidate.num_micro_batches}',
  ]
  if settings.get('micro_batch_size') is not None:
    micro = candidate.shape.MicroBatchSize(profile.batch_size)
    lines.append(f'{path}.micro_batch_size: {micro}')
  lines += [
      f'{path}.schedule: {candidate.schedule}',
      f'{path}.remat: {candidate.remat}',
      f'{path}.partition: {candidate.partition}',
      f'input.batch_size: {profile.batch_size // candidate.replicas}',
  ]
  return lines


def FormatTable(result: search.SearchResult,
                top: Optional[int] = None) -> str:
  """The ranked candidates as a fixed-width table.

  Args:
    result: From `search.Search`.
    top: Rows to show (None: all); a last line says how many were left out.

  Returns:
    The table.
  """
  header = (f'{"rank":>4}  {"K":>2} {"v":>2} {"M":>3} {"R":>2}  '
            f'{"schedule":<8} {"remat":<11} {"engine":<8} '
            f'{"step ms":>9} {"peak":>11}  {"fits":<4}  partition')
  lines = [header, '-' * len(header)]
  rows = result.candidates if top is None else result.candidates[:top]
  for i, c in enumerate(rows):
    lines.append(
        f'{i:>4}  {c.num_stages:>2} {c.virtual_stages:>2} '
        f'{c.num_micro_batches:>3} {c.replicas:>2}  {c.schedule:<8} '
        f'{c.remat:<11} {c.engine:<8} {c.predicted_step_s * 1e3:>9.2f} '
        f'{FormatBytes(c.predicted_peak_bytes):>11}  '
        f'{"yes" if c.fits else "no":<4}  {c.partition}'
        f'{" (memory limit)" if c.partition_rule == "memory_limit" else ""}')
  if len(rows) < len(result.candidates):
    lines.append(f'({len(result.candidates) - len(rows)} more; --json_out '
                 'lists every candidate)')
  return '\n'.join(lines)
