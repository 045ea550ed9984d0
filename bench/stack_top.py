#!/usr/bin/env python3
"""Where a sampled process spends its time, from collapsed stacks: the frames with the most samples, self and
inclusive, as a short table and JSON. Made for `py-spy record --native -f raw` on the GPU machine, whose raw output
(tens of MB for a minute of a training run) is too large to bring back: summarize it there.

    py-spy record --subprocesses --native -r 100 -f raw -o prof.txt -- python3 bench/swap.py ...
    python3 bench/stack_top.py prof.txt --match 'train_step' --top 40 --json $OUT/top.json

Each input line is `frame;frame;...;leaf count` (the collapsed format; py-spy puts the process and thread first).
--match keeps only the stacks that contain a frame with that substring (a thread, a function). Frames are counted
once per stack for the inclusive figure, however deep the recursion."""
import argparse
import collections
import json
import sys


def summarize(lines, match=None):
    self_counts, incl_counts = collections.Counter(), collections.Counter()
    total = 0
    for line in lines:
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if match and not any(match in f for f in frames):
            continue
        n = int(count)
        total += n
        self_counts[frames[-1]] += n
        for f in set(frames):
            incl_counts[f] += n
    return total, self_counts, incl_counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", nargs="?", help="collapsed stacks (default stdin)")
    ap.add_argument("--match", help="keep only stacks with a frame containing this")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", help="write {'samples', 'self', 'inclusive'} here")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args(argv)
    if a.self_test:
        total, s, i = summarize(["p;t;main;f;g 3", "p;t;main;f 2", "p;u;other 5", "bad line", "p;t;main;f;f 1"],
                                match="main")
        assert total == 6 and s["g"] == 3 and s["f"] == 3 and i["f"] == 6 and i["main"] == 6 and "other" not in i
        print("stack_top self-test: ok")
        return 0
    with (open(a.input) if a.input else sys.stdin) as fh:
        total, s, i = summarize(fh, a.match)
    if total == 0:
        print("no samples matched", file=sys.stderr)
        return 1
    for title, counter in (("self", s), ("inclusive", i)):
        print(f"{title} (of {total} samples)")
        for frame, n in counter.most_common(a.top):
            print(f"  {100.0 * n / total:6.2f}%  {n:8d}  {frame[:160]}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"samples": total, "match": a.match,
                       "self": s.most_common(a.top), "inclusive": i.most_common(a.top)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
