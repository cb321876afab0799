"""Bins the records of tools/gpu/trace (sitecustomize.py) into a timeline:

  python3 tools/gpu/trace_summary.py TRACE_DIR [--bin 0.25]

Time 0 is the first request the client sent (a serving run) or the first
step (an offline run). Per bin: requests the client sent, requests the
front end took in, steps, prompt tokens and decode rows scheduled, the mean
running and waiting counts, and requests done (client side). Then the
headline: when the engine first ran its full batch, and how the run's time
splits into ramp (until then), steady and tail (after the last intake and
the batch falling below full)."""

from __future__ import annotations

import argparse
import glob
from collections import defaultdict


def load(trace_dir: str) -> dict[str, list[list[float]]]:
    records = defaultdict(list)
    for path in glob.glob(f"{trace_dir}/*.tsv"):
        with open(path) as f:
            for line in f:
                kind, *fields = line.rstrip("\n").split("\t")
                records[kind].append([float(x) for x in fields])
    for rows in records.values():
        rows.sort()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--bin", type=float, default=0.25, help="seconds per row")
    args = parser.parse_args()
    records = load(args.trace_dir)
    sched, intake, client = records["sched"], records["intake"], records["client"]
    if not sched:
        raise SystemExit(f"{args.trace_dir}: no step records")
    t0 = client[0][0] if client else sched[0][0]
    end = max(sched[-1][0], max((c[0] + c[2] for c in client), default=0.0))
    nbins = int((end - t0) / args.bin) + 1
    rows = [defaultdict(float) for _ in range(nbins)]

    def at(t: float) -> defaultdict:
        return rows[min(max(int((t - t0) / args.bin), 0), nbins - 1)]

    for t, *_ in client:
        at(t)["sent"] += 1
    for t, _, latency, _ in client:
        at(t + latency)["done"] += 1
    for (t,) in intake:
        at(t)["intake"] += 1
    for t, running, waiting, prefill, decode in sched:
        row = at(t)
        row["steps"] += 1
        row["prefill"] += prefill
        row["decode"] += decode
        row["running"] += running
        row["waiting"] += waiting
    print(f"{'t (s)':>6} {'sent':>5} {'intake':>6} {'steps':>5} {'prefill':>8} {'decode':>7} "
          f"{'running':>7} {'waiting':>7} {'done':>5}")
    for i, row in enumerate(rows):
        steps = row["steps"] or 1
        print(f"{i * args.bin:6.2f} {row['sent']:5.0f} {row['intake']:6.0f} {row['steps']:5.0f} {row['prefill']:8.0f} "
              f"{row['decode']:7.0f} {row['running'] / steps:7.1f} {row['waiting'] / steps:7.1f} {row['done']:5.0f}")
    full = max(r[1] for r in sched)
    first_full = next(r[0] for r in sched if r[1] == full)
    last_full = max(r[0] for r in sched if r[1] == full)
    print(f"steps {len(sched)}, batch full ({full:.0f}) first at {first_full - t0:.3f} s, last at {last_full - t0:.3f} s, "
          f"end {end - t0:.3f} s" + (f", last intake {intake[-1][0] - t0:.3f} s" if intake else "")
          + (f", last sent {client[-1][0] - t0:.3f} s" if client else ""))


if __name__ == "__main__":
    main()
