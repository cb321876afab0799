"""`tools/bazel run //server -- ARGS`: Pagoda's OpenAI-compatible server (see
pagoda.entrypoints.openai.api_server for the flags)."""

import sys

from pagoda.entrypoints.openai.api_server import main

if __name__ == "__main__":
    main(sys.argv[1:])
