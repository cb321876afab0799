"""Runs a user's Python script against this checkout:

    tools/bazel run //tools:python -- my_script.py [args...]

The script can `from pagoda import LLM, SamplingParams`: the package and its
Bazel-built kernels are on the path. Relative paths resolve from the folder the
command was started in.
"""

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: tools/bazel run //tools:python -- SCRIPT.py [ARGS...]")
    # `bazel run` starts in the runfiles tree; go back to where the user was.
    os.chdir(os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd()))
    script = sys.argv[1]
    if not os.path.isfile(script):
        sys.exit(f"tools/bazel run //tools:python: no such script: {script}")
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
