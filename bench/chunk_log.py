#!/usr/bin/env python3
"""What the program's allocations made on the launching threads, from a LAYERSWAP_LOG=debug log.

The allocator logs, at debug level, every segment the program makes itself ("the program makes a chunk of 126.00 MiB
for 125.00 MiB (room ..., idle ...); engine: 64th 22, ..."): a chunk (created, mapped, granted access on the
launching thread), a slab, or a composite of spare chunks (Note [Spare composites] in allocator/caching_allocator.cpp).
This script counts those lines once the step is learned (the first line whose 64th is not 0), by what was made and
its size, and by the 64th of the step it was made in, and divides by the steps the log spans: a new step starts where
the 64th goes back (docs/swapping.md, next step 6, asks which requests still make chunks).

    python3 bench/swap.py --cases llama-lora:0.25 --sides layerswap --steps 12 --warmup 4 \\
        --ls-env LAYERSWAP_LOG=debug --out $OUT/debug.json > $OUT/debug.log 2>&1
    python3 bench/chunk_log.py $OUT/debug.log          # or a .gz, e.g. bench/results/debug_s53_lora25.log.gz
    python3 bench/chunk_log.py --last 4 $OUT/debug.log # the last four steps only (the steady state)

Give it one process's log: lines of several processes interleaved would count steps wrongly. A step in which the
program made nothing leaves no line, so the step count is a lower bound and the figures a step an upper bound.
"""

import argparse
import collections
import gzip
import re
import sys

MAKES = re.compile(r"the program makes a (?P<what>[a-z ]+?) of (?P<made>[\d.]+ [KMG]i?B) for "
                   r"(?:[\d.]+ [KMG]i?B|\d+ B) .*?engine: 64th (?P<phase>\d+),")


def read_lines(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        yield from f


def count(lines, last_steps=0):
    """Counts after the step is learned, over the last `last_steps` steps (0: all): {"steps", "per_step": [n, ...],
    "by_made": {(what, made): n}, "by_phase": {phase: n}}."""
    made = []  # one list of (what, size, phase) per step
    last = None
    for line in lines:
        m = MAKES.search(line)
        if not m:
            continue
        phase = int(m["phase"])
        if last is None and phase == 0:
            continue  # before the step is learned every line says 64th 0
        if last is None or phase < last:
            made.append([])
        last = phase
        made[-1].append((m["what"], m["made"], phase))
    per_step = [len(step) for step in made]
    kept = made[-last_steps:] if last_steps else made
    by_made = collections.Counter((what, size) for step in kept for what, size, _ in step)
    by_phase = collections.Counter(phase for step in kept for _, _, phase in step)
    return {"steps": len(kept), "per_step": per_step, "by_made": by_made, "by_phase": by_phase}


def report(result, out=sys.stdout):
    steps = result["steps"]
    if steps == 0:
        print("no line of the program making a segment once the step was learned", file=out)
        return
    print("segments the program made in each step once the step was learned: "
          + " ".join(str(n) for n in result["per_step"]), file=out)
    total = sum(result["by_made"].values())
    print(f"{total} over the {steps} steps below (at most {total / steps:.1f} a step)", file=out)
    print("by what and size (a step):", file=out)
    for (what, made), n in sorted(result["by_made"].items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {what:20s} {made:>12s}  {n:5d}  ({n / steps:.2f})", file=out)
    print("by the 64th of the step (a step):", file=out)
    for phase, n in sorted(result["by_phase"].items()):
        print(f"  64th {phase:2d}  {n:5d}  ({n / steps:.2f})", file=out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="a LAYERSWAP_LOG=debug log of one process (text or .gz)")
    p.add_argument("--last", type=int, default=0, metavar="N",
                   help="count only the last N steps (the steady state; default: every step once learned)")
    args = p.parse_args(argv)
    if args.last < 0:
        p.error(f"--last must be 0 (every step) or a number of steps, not {args.last}")
    report(count(read_lines(args.log), args.last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
