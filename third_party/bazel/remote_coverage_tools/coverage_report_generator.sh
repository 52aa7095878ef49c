#!/bin/sh
# Stand-in (see third_party/bazel/README.md): coverage is not supported offline.
echo "coverage_report_generator: not available offline" >&2
exit 1
