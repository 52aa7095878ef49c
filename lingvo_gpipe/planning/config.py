"""The pipeline parameters every front end takes, checked in one place.

Pure Python. The Lingvo layer (`GPipeSequentialLayer`) and the Keras layer
(`lingvo_gpipe.keras`) take the same knobs: cells, K, v, partition, M or the
micro-batch size, batch_dim, remat, engine and schedule. `CheckShape` checks
them before anything is built and says how the cells are cut into chunks;
`NumMicroBatches` decides M from a batch. Errors name the parameter, its
value and what would be valid, the same from either front end.

    >>> shape = CheckShape(['fc0', 'fc1', 'fc2', 'fc3'], num_stages=2,
    ...                    virtual_stages=2, partition='uniform')
    >>> shape.counts  # Cells per chunk; chunk c on device c % 2.
    [1, 1, 1, 1]
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

from lingvo_gpipe.planning import checks
from lingvo_gpipe.planning import partition as partition_lib
from lingvo_gpipe.planning import schedule

# Cost-based partitions (costs come from the front end).
COST_PARTITIONS = ('flops', 'params', 'profile')
PARTITIONS = ('uniform',) + COST_PARTITIONS


class Shape(NamedTuple):
  """How the cells are cut: K devices, v chunks per device, cells per chunk.

  Attributes:
    num_stages: K, the number of devices (pipeline stages).
    virtual_stages: v; there are K * v chunks, chunk c on device c mod K.
    counts: Cells per chunk (K * v positive ints), or None while a cost-based
      partition waits for its costs.
  """
  num_stages: int
  virtual_stages: int
  counts: Optional[List[int]]

  @property
  def num_chunks(self) -> int:
    return self.num_stages * self.virtual_stages


class Skips(NamedTuple):
  """Skip connections by cell index, and how they cross the chunks.

  Attributes:
    cells: Per skip, (source cell, target cell or None: the output).
    chunk_skips: The skips that leave their source's chunk, as (source
      chunk, target chunk or None) pairs in order (what the engine routes).
    crossing: Per skip, its index in chunk_skips, or None if it stays in
      one chunk.
  """
  cells: List[Tuple[int, Optional[int]]]
  chunk_skips: List[Tuple[int, Optional[int]]]
  crossing: List[Optional[int]]


def CheckSkips(cell_names: Sequence[str],
               skips: Sequence[Tuple[str, Optional[str]]]
              ) -> List[Tuple[int, Optional[int]]]:
  """Cell indices of (from_cell, to_cell) skips; ValueError naming `skips`.

  Args:
    cell_names: The cells' names, in order.
    skips: (from_cell, to_cell) names; to_cell None means the pipeline's
      output. to_cell must come after from_cell.

  Returns:
    (source index, target index or None) pairs.

  Raises:
    ValueError: for a malformed pair, an unknown name, a skip to itself or
      backwards.
  """
  index = {name: i for i, name in enumerate(cell_names)}
  result = []
  for skip in skips or ():
    if not isinstance(skip, (tuple, list)) or len(skip) != 2:
      raise ValueError(f'skips={list(skips)}: {skip!r} is not a (from_cell, '
                       'to_cell) pair of cell names (to_cell None: the '
                       'output).')
    source, target = skip
    for name in (source, target) if target is not None else (source,):
      if name not in index:
        raise ValueError(f'skips={list(skips)}: {name!r} is not a cell; '
                         f'the cells are {list(cell_names)}.')
    if target is not None and index[target] <= index[source]:
      raise ValueError(f'skips={list(skips)}: {skip!r} goes to itself or '
                       'backwards; to_cell must come after from_cell.')
    result.append((index[source],
                   None if target is None else index[target]))
  return result


def ChunkSkips(skip_cells: Sequence[Tuple[int, Optional[int]]],
               counts: Sequence[int]) -> Skips:
  """How skips between cells cross the chunks of a partition.

  Args:
    skip_cells: From `CheckSkips`.
    counts: Cells per chunk.

  Returns:
    The `Skips`.
  """
  chunk_of = [c for c, count in enumerate(counts) for _ in range(count)]
  chunk_skips, crossing = [], []
  for source, target in skip_cells:
    a = chunk_of[source]
    b = None if target is None else chunk_of[target]
    if b == a:
      crossing.append(None)
    else:
      crossing.append(len(chunk_skips))
      chunk_skips.append((a, b))
  return Skips(list(skip_cells), chunk_skips, crossing)


def CheckShape(cell_names: Sequence[str],
               num_stages: Optional[int] = None,
               virtual_stages: int = 1,
               partition: Union[str, Sequence[int]] = 'uniform',
               num_micro_batches: int = 1,
               micro_batch_size: Optional[int] = None,
               batch_dim: int = 0,
               remat: str = 'always',
               engine: str = 'auto',
               schedule_name: str = 'gpipe',
               skips: Sequence[Tuple[str, Optional[str]]] = (),
               cells_param: str = 'cell_tpl') -> Shape:
  """Checks a pipeline's parameters; returns how its cells are cut.

  Args:
    cell_names: The cells' names, in order; unique and non-empty.
    num_stages: K; None for one chunk per cell (K = cells / v).
    virtual_stages: v >= 1, chunks per device.
    partition: One of `PARTITIONS`, or cells per chunk (K * v counts).
    num_micro_batches: M >= 1.
    micro_batch_size: None, or the size of one micro-batch.
    batch_dim: The batch dimension, >= 0.
    remat: One of `schedule.REMAT_MODES`.
    engine: 'auto' or one of `schedule.ENGINES`.
    schedule_name: A key of `schedule.SCHEDULES`.
    skips: (from_cell, to_cell or None) names (`CheckSkips`).
    cells_param: The front end's name of the cells' parameter, named in the
      errors about cell names (Lingvo's 'cell_tpl', Keras' 'layers').

  Returns:
    The `Shape`.

  Raises:
    ValueError: naming the parameter, its value and what would be valid.
  """
  if not cell_names:
    raise ValueError(f'{cells_param} is empty; give at least one cell.')
  names = list(cell_names)
  duplicates = sorted({n for n in names if names.count(n) > 1})
  if duplicates or not all(names):
    raise ValueError(f'{cells_param}: the cell names {names} must be unique '
                     f'and non-empty; repeated: {duplicates}.')
  num_cells = len(names)
  checks.CheckPositiveInt('virtual_stages', virtual_stages)
  if isinstance(partition, str):
    if partition not in PARTITIONS:
      raise ValueError(f'partition={partition!r} is not supported; use one '
                       f'of {list(PARTITIONS)} or a list of cells per stage.')
    if num_stages is None:
      if num_cells % virtual_stages:
        raise ValueError(
            f'virtual_stages={virtual_stages} with num_stages=None (one chunk '
            f'per cell) needs a multiple of {virtual_stages} cells, not '
            f'{num_cells}; set num_stages.')
      num_stages = num_cells // virtual_stages
    _CheckChunks(num_cells, num_stages, virtual_stages)
    counts = (partition_lib.UniformPartition(num_cells,
                                             num_stages * virtual_stages)
              if partition == 'uniform' else None)
  else:
    counts = partition_lib.CheckPartition(partition, num_cells)
    if num_stages is not None and len(counts) != num_stages * virtual_stages:
      raise ValueError(
          f'partition={counts} has {len(counts)} entries but num_stages='
          f'{num_stages} and virtual_stages={virtual_stages} make '
          f'{num_stages * virtual_stages} chunks; give one count per chunk.')
    if len(counts) % virtual_stages:
      raise ValueError(
          f'partition={counts} has {len(counts)} chunks, not a multiple of '
          f'virtual_stages={virtual_stages}; give K * {virtual_stages} '
          'counts (chunk c runs on device c mod K).')
    num_stages = len(counts) // virtual_stages
  schedule.CheckSchedule(schedule_name)
  schedule.CheckEngine(engine, remat, schedule_name)
  checks.CheckPositiveInt('num_micro_batches', num_micro_batches)
  if micro_batch_size is not None:
    checks.CheckPositiveInt('micro_batch_size', micro_batch_size)
  checks.CheckBatchDim(batch_dim)
  CheckSkips(names, skips)
  if micro_batch_size is None:  # M is known: the table must exist.
    schedule.BuildTable(schedule_name, num_stages, num_micro_batches,
                        virtual_stages)
  else:  # M is not known yet: the schedule's rules of v, with an M that
    # every schedule runs (a multiple of K).
    schedule.CheckScheduleSizes(schedule_name, num_stages, num_stages,
                                virtual_stages)
  return Shape(num_stages, virtual_stages, counts)


def _CheckChunks(num_cells: int, num_stages: int, virtual_stages: int) -> None:
  """Raises ValueError unless K is valid and K * v chunks fit the cells."""
  partition_lib.CheckNumStages(num_cells, num_stages)
  if num_stages * virtual_stages > num_cells:
    raise ValueError(
        f'virtual_stages={virtual_stages} with num_stages={num_stages} needs '
        f'{num_stages * virtual_stages} chunks of at least one cell, but '
        f'there are {num_cells} cells; use virtual_stages <= '
        f'{num_cells // num_stages}.')


def NumMicroBatches(batch_size: Optional[int], num_micro_batches: int,
                    micro_batch_size: Optional[int]) -> int:
  """M for a mini-batch of `batch_size`.

  Args:
    batch_size: The static batch size, or None if unknown.
    num_micro_batches: The M asked for (1 if only micro_batch_size is set).
    micro_batch_size: The micro-batch size asked for, or None.

  Returns:
    M.

  Raises:
    ValueError: if the batch does not split into M micro-batches (or
      micro-batches of micro_batch_size), if both are set and their product
      is not the batch size, or if micro_batch_size needs a static batch size
      that is unknown.
  """
  if micro_batch_size is None:
    if batch_size is not None:
      CheckSplit(batch_size, num_micro_batches)
    return num_micro_batches
  if batch_size is None:
    raise ValueError(f'micro_batch_size={micro_batch_size} needs a static '
                     'batch size; the inputs have none. Set '
                     'num_micro_batches instead.')
  if num_micro_batches != 1:
    if num_micro_batches * micro_batch_size != batch_size:
      raise ValueError(
          f'num_micro_batches={num_micro_batches} and micro_batch_size='
          f'{micro_batch_size} are both set, but their product is not the '
          f'batch size {batch_size}; set one of them, or both with '
          'num_micro_batches * micro_batch_size == batch size.')
    return num_micro_batches
  if batch_size % micro_batch_size:
    raise ValueError(
        f'micro_batch_size={micro_batch_size} does not divide the batch '
        f'size {batch_size}; use a divisor of {batch_size}.')
  return batch_size // micro_batch_size


def CheckSplit(batch_size: int, num_micro_batches: int) -> None:
  """Raises ValueError unless M is in [1, batch_size] and divides it."""
  if num_micro_batches > batch_size:
    raise ValueError(
        f'num_micro_batches={num_micro_batches} is larger than the batch size '
        f'{batch_size}; use a value in [1, {batch_size}].')
  if batch_size % num_micro_batches:
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    raise ValueError(
        f'num_micro_batches={num_micro_batches} does not divide the batch size '
        f'{batch_size}; valid values are {divisors}.')


def ChunkCells(items: Sequence, counts: Sequence[int]) -> List[List]:
  """Cuts `items` (one per cell) into consecutive chunks of `counts`."""
  chunks, start = [], 0
  for count in counts:
    chunks.append(list(items[start:start + count]))
    start += count
  return chunks
