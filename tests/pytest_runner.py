"""Entry point of every py_test: runs one pytest file under Bazel.

Bazel passes the test file as the first argument. Results go to the JUnit XML
file Bazel asks for (XML_OUTPUT_FILE), so per-case results show up in
bazel-testlogs and .ci/run can count them.
"""

import os
import sys

import pytest

if __name__ == "__main__":
    test_file, *rest = sys.argv[1:]
    # As when running the file itself: its directory's helper modules import.
    sys.path.insert(0, os.path.dirname(os.path.abspath(test_file)))
    args = [test_file, "-q", "-p", "no:cacheprovider", *rest]
    if "XML_OUTPUT_FILE" in os.environ:
        args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
    sys.exit(pytest.main(args))
