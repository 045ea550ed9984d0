#!/usr/bin/env python3
"""Per-side CPU profile of an interleaved swap benchmark run: which library and which of layerswap's functions
each side's threads spend their time in, per training step.

    PERF=... PERF_THREADS_JSON=perf.json bench/perf_threads.sh perf.txt -- \
        python3 bench/swap.py --cases llama-lora:0.25 --interleave 6 --processes 2 ... --out swap.json
    python3 bench/perf_sides.py swap.json perf.json [--dsos 16] [--symbols 0.04]

The swap JSON names each process's pid (resident, layerswap, variants, peers); perf.json (bench/perf_report.py)
has each thread's samples within its process's timed window. A side's figure is the sum over its processes'
threads of one role (main: the process's first thread, which runs the forward pass and the optimizer; autograd:
pt_autograd_0, which runs the backward pass; move and learn: layerswap's threads) divided by the processes and
by the timed steps each ran (warm-up excluded, the steps after a pause included).
"""
import argparse
import collections
import json
import sys

from swap import interleave_cycles  # torch-free: the benchmark's parent

ROLES = {"pt_autograd_0": "autograd", "layerswap-move": "move", "layerswap-learn": "learn"}


def side_pids(swap):
    """{pid: side name} from a swap benchmark JSON (its first case)."""
    out = {}
    for model in swap.get("models", {}).values():
        for p in (model.get("interleave") or {}).get("resident_processes") or []:
            out[p.get("pid")] = "resident"
    for c in swap.get("cases", []):
        tag = f"layerswap {c['budget_fraction']:g}"
        for p in c.get("processes") or []:
            out[p.get("pid")] = tag
        for name, v in (c.get("variants") or {}).items():
            for p in v.get("processes") or []:
                out[p.get("pid")] = f"{tag} [{name}]"
        for name, v in (c.get("peers") or {}).items():
            for p in v.get("processes") or []:
                out[p.get("pid")] = name
    out.pop(None, None)
    return out


def timed_steps(swap):
    """The timed steps each interleaved process ran (bench/swap.py's interleave_cycles), or None."""
    s = swap.get("settings", {})
    cycles, block = s.get("interleave_cycles"), s.get("interleave_block")
    if cycles and block:
        steps = s.get("steps")
        return (interleave_cycles(cycles, steps, s.get("warmup", 0), block) if steps else cycles) * block
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("swap_json")
    ap.add_argument("perf_json")
    ap.add_argument("--dsos", type=int, default=16, help="libraries listed per role")
    ap.add_argument("--symbols", type=float, default=0.04, help="layerswap and CUPTI symbols above this ms/step")
    args = ap.parse_args(argv)
    with open(args.swap_json, encoding="utf-8") as f:
        swap = json.load(f)
    with open(args.perf_json, encoding="utf-8") as f:
        perf = json.load(f)
    sides = side_pids(swap)
    steps = timed_steps(swap)
    if not sides or not steps:
        print("no interleaved processes with pids in the swap JSON (bench/swap.py --interleave, session 38 on)")
        return 1
    procs = collections.Counter(sides.values())
    agg = collections.defaultdict(lambda: {"ms": 0.0, "dso": collections.Counter(), "sym": collections.Counter()})
    for key, t in perf.items():
        pid, tid = (int(x) for x in key.split("/"))
        if pid not in sides or not t.get("windowed"):
            continue
        role = "main" if pid == tid else ROLES.get(t["name"], "other")
        a = agg[(sides[pid], role)]
        scale = 1e3 / (procs[sides[pid]] * steps)  # seconds in all -> ms per step of one process
        a["ms"] += t["seconds"] * scale
        freq = sum(t["dso"].values()) / t["seconds"] if t["seconds"] else 0.0
        for k, v in t["dso"].items():
            a["dso"][k] += v / freq * scale
        for k, v in t["sym"].items():
            a["sym"][k] += v / freq * scale
    order = sorted(procs, key=lambda s: (s != "resident", s))
    print(f"ms of CPU per timed step and process ({steps} timed steps each; sides: "
          + ", ".join(f"{s} x{procs[s]}" for s in order) + ")")
    for role in ("main", "autograd", "move", "learn", "other"):
        if not any((s, role) in agg for s in order):
            continue
        print(f"\n== {role}: " + ", ".join(f"{s} {agg[(s, role)]['ms']:.1f}" for s in order if (s, role) in agg))
        if role not in ("main", "autograd"):
            continue
        dsos = collections.Counter()
        for s in order:
            dsos.update(agg[(s, role)]["dso"])
        w = max(len(s) for s in order) + 2
        print("   " + " " * 40 + "".join(f"{s:>{w}}" for s in order))
        for dso, _ in dsos.most_common(args.dsos):
            print(f"   {dso[:40]:40}" + "".join(f"{agg[(s, role)]['dso'][dso]:{w}.2f}" for s in order))
        syms = collections.Counter()
        for s in order:
            syms.update({k: v for k, v in agg[(s, role)]["sym"].items() if k.startswith("_C.") or "cupti" in k})
        print("   layerswap's module and CUPTI:")
        for sym, _ in syms.most_common():
            row = [agg[(s, role)]["sym"][sym] for s in order]
            if max(row) >= args.symbols:
                name = sym.split(" ", 1)[-1].replace("layerswap::", "").replace("(anonymous namespace)::", "")
                name = ("CUPTI " if "cupti" in sym else "") + name
                print(f"   {name[:40]:40}" + "".join(f"{v:{w}.2f}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
