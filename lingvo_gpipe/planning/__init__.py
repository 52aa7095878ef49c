"""Planning a pipeline: neither TensorFlow nor Lingvo.

Modules: `checks` (argument checks shared by every layer), `config` (the
parameters every front end takes), `schedule` (which stage runs which
micro-batch when, remat rules, bubble), `simulate` (timing and memory of a
step from per-stage costs), `partition` (the optimal contiguous split of cells
into stages), `sizes` (parameter counts and variable bytes of cells),
`timing` (how a 'profile' cost is timed), `report` (partition tables),
`timeline` (pictures and Chrome traces of a step). `plan.py auto`'s planner:
`profile` (the data model and its JSON), `predict` (the cost model),
`calibrate` (the call overhead from a measured step), `search` (partitions and
the search) and `search_report` (its text).
"""
