"""lingvo_gpipe: GPipe pipeline parallelism for TensorFlow 2 and Lingvo.

    from lingvo_gpipe import GPipeSequentialLayer
    p = GPipeSequentialLayer.Params().Set(name='pipe', cell_tpl=cells,
                                          num_stages=4, num_micro_batches=8)

Modules: `layers` (the Lingvo layer), `batchnorm` (micro-batch aware batch
norm), `costs` (per-cell costs for partitioning), `pipeline` (the engine), `stage` and
`recompute` (one stage's calls and their re-materialized gradients),
`microbatch`, `schedule`, `partition`, `placement`.
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
