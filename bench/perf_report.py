#!/usr/bin/env python3
"""Per-thread CPU profile from `perf script` output, in one pass (bench/perf_threads.sh uses it).

    perf script -i perf.data -F pid,tid,comm,time,ip,sym,dso | python3 bench/perf_report.py \
        --freq 999 [--windows FILE] [--threads 8] [--symbols 30] [--json OUT]

Reads one cpu-clock sample per line. A process with a window in FILE ("pid start end", CLOCK_MONOTONIC seconds,
as bench/swap.py's workers write them) counts only its samples inside it. Prints every thread with samples
(busiest first), then for the N busiest the share of their samples by library and their top symbols; --json also
writes {"pid/tid": {"name", "seconds", "windowed", "dso": {dso: samples}, "sym": {"dso sym": samples}}} for every
thread, for comparisons between sides (the swap benchmark's JSON names each process's pid).
"""
import argparse
import collections
import json
import re
import sys

# "  python3 12345/12350  1234.567890:  7f12ab  at::native::foo<float>(int) (/usr/lib/libtorch.so)"
LINE = re.compile(r"^\s*(?P<comm>.*?)\s+(?P<pid>\d+)/(?P<tid>\d+)\s+(?P<time>[\d.]+):\s+(?P<ip>[0-9a-f]+)\s+"
                  r"(?P<sym>.*?)\s+\((?P<dso>[^()]*)\)\s*$")


def read_windows(path):
    windows = {}
    if path:
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3:
                    windows[parts[0]] = (float(parts[1]), float(parts[2]))
    return windows


def aggregate(lines, windows):
    threads = {}
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        pid, tid = m["pid"], m["tid"]
        window = windows.get(pid)
        if window is not None and not window[0] <= float(m["time"]) <= window[1]:
            continue
        t = threads.get((pid, tid))
        if t is None:
            t = threads[(pid, tid)] = {"name": m["comm"], "samples": 0, "windowed": window is not None,
                                       "dso": collections.Counter(), "sym": collections.Counter()}
        t["samples"] += 1
        dso = m["dso"].rsplit("/", 1)[-1]
        sym = re.sub(r"\+0x[0-9a-f]+$", "", m["sym"])
        t["dso"][dso] += 1
        t["sym"][f"{dso} {sym}"] += 1
    return threads


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--freq", type=float, required=True, help="the sampling rate, Hz (samples / freq = seconds)")
    ap.add_argument("--windows", help="file of 'pid start end' lines")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--symbols", type=int, default=30)
    ap.add_argument("--json", help="also write every thread's counts here")
    args = ap.parse_args(argv)
    threads = aggregate(sys.stdin, read_windows(args.windows))
    order = sorted(threads.items(), key=lambda kv: -kv[1]["samples"])
    print("# threads: pid tid name seconds (busiest first; windowed: within its process's timed window)")
    for (pid, tid), t in order[:60]:
        print(f"{pid} {tid} {t['name'].replace(' ', '_')} {t['samples'] / args.freq:.3f}"
              + (" windowed" if t["windowed"] else ""))
    for (pid, tid), t in order[:args.threads]:
        n = t["samples"]
        print(f"\n######## thread {tid} ({t['name']}) of process {pid}: {n / args.freq:.3f} s")
        for dso, k in t["dso"].most_common(12):
            print(f"{100 * k / n:8.2f}%  {dso}")
        print("--------")
        for sym, k in t["sym"].most_common(args.symbols):
            print(f"{100 * k / n:8.2f}%  {sym}")
    if args.json:
        out = {f"{pid}/{tid}": {"name": t["name"], "seconds": t["samples"] / args.freq, "windowed": t["windowed"],
                                "dso": dict(t["dso"]), "sym": dict(t["sym"].most_common(400))}
               for (pid, tid), t in order}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
