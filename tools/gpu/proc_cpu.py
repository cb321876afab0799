"""CPU use of a process tree over a window: which process (API server,
engine core, worker, benchmark client) is the one at 100% of a core, i.e.
the bound of a pipeline of GIL-bound Python processes.

    python3 tools/gpu/proc_cpu.py --delay 8 --duration 10 ROOT_PID [ROOT_PID ...]

Waits --delay seconds, reads utime+stime of every process under the roots
(children found through /proc/*/stat), again --duration seconds later, and
prints each process's share of one core and of its busiest threads
(name/tid), busiest first.
"""

from __future__ import annotations

import argparse
import os
import time

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> tuple[str, int, float] | None:
    """(comm, ppid, cpu seconds) of /proc/PID[/task/TID]/stat."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _tree(roots: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(f"/proc/{name}/stat")) is not None:
            children.setdefault(stat[1], []).append(int(name))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in args if a]
    # The interesting part of "python3 -m pagoda.x ..." or "python3 -c from multiprocessing...".
    return " ".join(words[:4])[:100]


def snapshot(pids: list[int]) -> dict:
    """{pid: (cmdline, cpu seconds, {thread name: cpu seconds})}."""
    result = {}
    for pid in pids:
        process = _stat(f"/proc/{pid}/stat")
        if process is None:
            continue
        threads: dict[str, float] = {}
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tids = []
        for tid in tids:
            stat = _stat(f"/proc/{pid}/task/{tid}/stat")
            if stat is not None:
                threads[f"{stat[0]}/{tid}"] = stat[2]
        result[pid] = (_cmdline(pid), process[2], threads)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", type=int, nargs="+")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--duration", type=float, default=10.0)
    args = parser.parse_args()
    time.sleep(args.delay)
    before, start = snapshot(_tree(args.roots)), time.monotonic()
    time.sleep(args.duration)
    after, wall = snapshot(_tree(args.roots)), time.monotonic() - start
    rows = []
    for pid, (cmd, cpu, threads) in after.items():
        old_cpu, old_threads = (before[pid][1], before[pid][2]) if pid in before else (0.0, {})
        busy = {name: (t - old_threads.get(name, 0.0)) / wall for name, t in threads.items()}
        rows.append(((cpu - old_cpu) / wall, pid, cmd, busy))
    print(f"CPU over {wall:.1f} s, in cores (1.00 = one core all the time):")
    for share, pid, cmd, busy in sorted(rows, reverse=True):
        if share < 0.02:
            continue
        top = ", ".join(f"{name} {b:.2f}" for name, b in sorted(busy.items(), key=lambda kv: -kv[1])[:4] if b >= 0.02)
        print(f"  {share:5.2f}  pid {pid}  {cmd}\n         threads: {top}")


if __name__ == "__main__":
    main()
