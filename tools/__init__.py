"""Command lines of the repository: thin absl apps over importable modules.

    python tools/train.py --model=lm.GPipeCharLm --num_devices=4 --logdir=DIR
    python tools/plan.py partition|simulate|timeline ...
    python tools/benchmark.py memory|speed ...

Each tool holds its flags, checks them, dispatches and prints; the work is
done by `lingvo_gpipe` (the installed library), `benchmarks` (measurements)
and `params` (registered Lingvo models), all packages at the repository root.
`cli` is the shared subcommand / one-line-error / --json_out runner.

Finding the repository root. `python tools/plan.py` puts tools/ on sys.path,
not the root; so each tool, when it runs as the main program, puts the root
(the parent of its own folder) first on sys.path before its other imports.
That holds for any python with the dependencies, from any working directory,
and makes the tool use this checkout's lingvo_gpipe, benchmarks and params
even when another lingvo_gpipe is installed. Nothing relies on how the
library was installed. Tests import the tools as `tools.<name>` (pytest's
`pythonpath = .` in setup.cfg); Bazel puts the root on the path through its
runfiles. Not installed by setup.py.
"""
