"""lingvo_gpipe: GPipe pipeline parallelism for TensorFlow 2 and Lingvo.

    from lingvo_gpipe import GPipeSequentialLayer
    p = GPipeSequentialLayer.Params().Set(name='pipe', cell_tpl=cells,
                                          num_stages=4, num_micro_batches=8)

Modules: `layers` (the Lingvo layer), `pipeline` (the engine), `stage` and
`recompute` (one stage's calls and their re-materialized gradients),
`microbatch`, `schedule`, `partition`, `placement`.
"""

from lingvo_gpipe.layers import GPipeSequentialLayer

__all__ = ['GPipeSequentialLayer']
__version__ = '0.1.0'
