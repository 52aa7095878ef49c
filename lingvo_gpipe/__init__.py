"""lingvo_gpipe: GPipe pipeline parallelism for TensorFlow 2 and Lingvo.

    >>> from lingvo.core import layers
    >>> from lingvo_gpipe import GPipeSequentialLayer
    >>> cells = [layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=8,
    ...                                      output_dim=8) for i in range(8)]
    >>> p = GPipeSequentialLayer.Params().Set(name='pipe', cell_tpl=cells,
    ...                                       num_stages=4, num_micro_batches=8)
    >>> p.Instantiate().partition  # Cells per stage.
    [2, 2, 2, 2]

Layers, each using only the ones below it:

* `layers` (GPipeSequentialLayer), `cells` (Lingvo cells as stage functions),
  `batchnorm` (micro-batch aware batch norm), `costs` (per-cell costs),
  `profiling` (what `plan.py auto` measures of each cell), `stacks`,
  `from_lingvo` and `checkpoints` (Lingvo's GPipe stacks, params and
  checkpoints): the Lingvo front end; `keras/`: the Keras 3 front end, which
  loads no Lingvo;
* `engine/`: the pipeline on TensorFlow alone;
* `planning/`: schedules, simulation, partitioning, reports; no TensorFlow.

`partition` is the public path of `planning.partition`.
"""

__all__ = ['BatchNormLayer', 'GPipeSequentialLayer']
__version__ = '0.1.0'


def __getattr__(name):
  # Lazy, so that the engine and the planning modules import without Lingvo.
  if name == 'GPipeSequentialLayer':
    from lingvo_gpipe import layers  # pylint: disable=g-import-not-at-top
    return layers.GPipeSequentialLayer
  if name == 'BatchNormLayer':
    from lingvo_gpipe import batchnorm  # pylint: disable=g-import-not-at-top
    return batchnorm.BatchNormLayer
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
