"""Summarizes a py-spy raw profile (`py-spy record --threads --format raw`):
per thread, its share of the samples, then the functions where it spends
its time (inclusive, by module:function), so "engine thread vs event loop"
reads off directly.

    python3 tools/gpu/profile_summary.py profile.txt [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import re

_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def parse(path: str):
    """Yields (thread, frames root first, samples) from collapsed stacks."""
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            parts = stack.split(";")
            # "process PID:..." (with --subprocesses), then "thread (...): NAME", then frames.
            head = 0
            while head < len(parts) and (parts[head].startswith("process ") or parts[head].startswith("thread ")):
                head += 1
            yield " ".join(parts[:head]) or "?", parts[head:], int(count)


def short(frame: str) -> str:
    match = _FRAME.match(frame)
    if match is None:
        return frame
    module = match["file"].rsplit("/", 1)[-1].removesuffix(".py")
    return f"{module}:{match['func']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    per_thread = collections.Counter()
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for thread, frames, count in parse(args.profile):
        per_thread[thread] += count
        for name in {short(f) for f in frames}:
            inclusive[thread][name] += count
    total = sum(per_thread.values()) or 1
    for thread, samples in per_thread.most_common():
        print(f"\n{thread}: {samples} samples ({100 * samples / total:.1f}% of all)")
        for name, count in inclusive[thread].most_common(args.top):
            print(f"  {100 * count / samples:5.1f}%  {name}")


if __name__ == "__main__":
    main()
