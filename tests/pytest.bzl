"""pytest_test: a Bazel py_test that runs its test file under pytest.

The tests are pytest modules (test functions, fixtures, tests/conftest.py),
not scripts: run as a script a test file would define its tests and exit 0.
This macro makes tests/pytest_main.py the main program, passes it the test
files and adds the set-up every test shares (conftest.py, setup.cfg).
"""

def pytest_test(name, srcs, deps = [], data = [], **kwargs):
    """A py_test running `srcs` under pytest.

    Args:
      name: The target name, e.g. "partition_test".
      srcs: The test files.
      deps: Libraries the tests import (helpers, modules under test).
      data: Files and binaries the tests read or run.
      **kwargs: Other py_test attributes (size, tags, ...).
    """
    native.py_test(
        name = name,
        srcs = srcs + ["pytest_main.py"],
        main = "pytest_main.py",
        args = ["$(rootpath %s)" % src for src in srcs],
        deps = deps + [
            ":conftest",
            ":pytest_main",
        ],
        data = data,
        python_version = "PY3",
        # No generated __init__.py: tests/ is not a package, its helpers
        # import as top-level modules, as under `make test`.
        legacy_create_init = False,
        **kwargs
    )
