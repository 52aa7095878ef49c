"""Planning a pipeline: neither TensorFlow nor Lingvo.

Modules: `checks` (argument checks shared by every layer), `schedule` (which
stage runs which micro-batch when, remat rules, bubble), `simulate` (timing and
memory of a step from per-stage costs), `partition` (the optimal contiguous
split of cells into stages), `report` (partition tables), `timeline`
(pictures and Chrome traces of a step).
"""
