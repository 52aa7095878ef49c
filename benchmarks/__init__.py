"""Measurements behind tools/benchmark.py and tools/plan.py timeline.

A repository package (setup.py does not install it): it builds and times
real training steps of GPipeSequentialLayer, Lingvo's PipeliningLayer and the
plain stack. One module per concern:

  models       the measured models: deep stacks of Lingvo FCLayers
  measure      one configuration's step time and peak memory (in a worker)
  worker       `python -m benchmarks.worker CONFIG`: measure in a fresh process
  runner       configurations, worker subprocesses, medians over repeats
  host         the measuring host: CPU, oneDNN, an allocator that keeps
               peak statistics on every host
  memory       the `benchmark.py memory` table and largest-model search
  speed        the `benchmark.py speed` comparison with Lingvo's GPipe
  traced_step  a traced training step for `plan.py timeline`

It is imported from the repository root: tools/ put that root on sys.path,
pytest has it through setup.cfg (`pythonpath = .`), Bazel through its
runfiles, and worker subprocesses run with the root as working directory.
TensorFlow and Lingvo are imported only where a step is built, so that a
tool's parent process, which only orchestrates workers, starts quickly.
"""
