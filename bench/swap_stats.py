#!/usr/bin/env python3
"""Where each case of a bench/swap.py run spends its step, one line per case, from its JSON: the step against the
resident one, the launching thread's time (CPU, launch calls, allocator calls and mutex waits, waits for prefetches
and host waits), the policy's and the migration thread's, the moves, and the allocator's churn per step. A case's
variants (bench/swap.py --variant NAME:...) follow it, as "model fraction [NAME]".

    python3 bench/swap_stats.py bench/results/swap.json

Figures a run did not record (an older layerswap) print as '-'. With --relation MODEL it reads any number of runs and
prints instead how the step's excess over the resident step goes with the migration thread's remap time, over every
side of MODEL (variants included):

    python3 bench/swap_stats.py --relation llama-lora bench/results/swap_s4*.json

With --pool MODEL:FRACTION it reads any number of runs and pools that case's interleaved cycles: each run's step over
the bound and its paired median, then every cycle's ratio (step / resident) of all runs together, with its median,
quartiles and a bootstrap 95% interval of that median; and the peers' speedups the same way. Give each run once: a
record merged with --merge holds the same cycles as the files merged into it.

    python3 bench/swap_stats.py --pool llama-lora:0.25 bench/results/swap_s53_lora25*.json"""
import argparse
import json
import pathlib
import random
import signal
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from swap import _flatten  # noqa: E402  (the statistics snapshots' flattening, as swap.py makes its per-step figures)

# (column, key in the case, scale, format)
COLUMNS = [
    ("step", "step_s", 1, "{:.3f}"), ("resident", "resident_step_s", 1, "{:.3f}"),
    ("cpu", "cpu_s", 1, "{:.3f}"), ("cpu res", "resident_cpu_s", 1, "{:.3f}"),
    ("launch", "launch_api_s_per_step", 1, "{:.3f}"), ("alloc", "call_s_per_step", 1, "{:.3f}"),
    ("lock", "lock_wait_s_per_step", 1, "{:.3f}"), ("wait", "launch_wait_s_per_step", 1, "{:.3f}"),
    ("host", "host_wait_s_per_step", 1, "{:.3f}"), ("policy", "policy_s_per_step", 1, "{:.3f}"),
    ("vmm", "remap_s_per_step", 1, "{:.3f}"), ("evict", "evictions_per_step", 1, "{:.0f}"),
    ("chunks", "chunks_created_per_step", 1, "{:.0f}"),
    ("steal", "steal_s_per_step", 1, "{:.3f}"), ("steal res", "resident_steal_s_per_step", 1, "{:.3f}"),
]
# Allocator counters per timed step, from the two statistics snapshots swap.py keeps.
CHURN = [("segs", "segments.allocated"), ("phys", "num_device_alloc")]
# The churn's causes, per timed step, in a second table: (column, key, format); a key matches a flattened name
# equal to it or ending in "." + it (the residency engine's figures sit under "residency.").
CAUSES = [("segs", "segments.allocated", "{:.0f}"), ("new s", "segment_new_s", "{:.3f}"),
          ("del s", "segment_destroy_s", "{:.3f}"), ("reclaim", "num_reclaims", "{:.0f}"),
          ("by policy", "num_engine_reclaims", "{:.0f}"), ("chunks", "chunks_created", "{:.0f}"),
          ("for segs", "chunks_for_segments", "{:.0f}"), ("released", "chunks_released", "{:.0f}"),
          ("for size", "chunks_released_for_size", "{:.0f}"), ("for pages", "chunks_released_for_pages", "{:.0f}"),
          ("policy", "policy_s", "{:.3f}"), ("maintain", "maintain_s", "{:.3f}"), ("room", "room_s", "{:.3f}"),
          ("waits", "num_lock_waits", "{:.0f}"), ("spun", "num_lock_spins", "{:.0f}"),
          ("composed", "num_composites", "{:.0f}"), ("donors", "composite_donors", "{:.0f}"),
          ("split", "num_splits", "{:.0f}")]


def sides(res):
    """(label, figures) of each case's layerswap side, then of its variants."""
    for c in res.get("cases", []):
        label = f"{c.get('model')} {c.get('budget_fraction')}"
        yield label, c
        for name, v in (c.get("variants") or {}).items():
            yield f"{label} [{name}]", v


def rows(res):
    steps = res.get("settings", {}).get("steps", 30) - res.get("settings", {}).get("warmup", 5)
    out = []
    for label, c in sides(res):
        row = {"case": label}
        for name, key, scale, fmt in COLUMNS:
            v = c.get(key)
            row[name] = fmt.format(v * scale) if isinstance(v, (int, float)) else "-"
        snaps = c.get("layerswap_stats") or {}
        a, b = _flatten(snaps.get("after_warmup")), _flatten(snaps.get("end"))

        def per_step(key, fmt):
            """From the two snapshots, else from the side's own per-step figure (a variant keeps no snapshots)."""
            k = next((n for n in b if n == key or n.endswith("." + key)), None)
            if k and steps > 0:
                return fmt.format((b[k] - a.get(k, 0)) / steps)
            v = c.get(key + "_per_step")
            return fmt.format(v) if isinstance(v, (int, float)) else "-"

        for name, key in CHURN:
            row[name] = per_step(key, "{:.0f}")
        for name, key, fmt in CAUSES:
            row["c:" + name] = per_step(key, fmt)
        out.append(row)
    return out


def print_table(table, names, label=lambda n: n):
    widths = {n: max(len(label(n)), *(len(r[n]) for r in table)) for n in names}
    print("  ".join(label(n).rjust(widths[n]) if n != "case" else label(n).ljust(widths[n]) for n in names))
    for r in table:
        print("  ".join(r[n].rjust(widths[n]) if n != "case" else r[n].ljust(widths[n]) for n in names))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="*", default=["bench/results/swap.json"])
    ap.add_argument("--relation", metavar="MODEL", help="the step's excess against the remap time over every side of "
                    "MODEL in the runs given")
    ap.add_argument("--pool", metavar="MODEL:FRACTION", help="pool the interleaved cycles of one case over the runs "
                    "given (e.g. llama-lora:0.25)")
    ap.add_argument("--limit", type=float, default=1.2, help="with --pool: the ratio a run's step over the bound is "
                    "held to (default 1.2)")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args(argv)
    if a.self_test:
        cases = [{"model": "m", "resident_step_s": 0.1, "step_s": 0.13, "remap_s_per_step": 0.06,
                  "variants": {"v": {"step_s": 0.14, "remap_s_per_step": 0.08}, "w": {"step_s": 0.2}}},
                 {"model": "n", "resident_step_s": 0.1, "step_s": 0.5, "remap_s_per_step": 0.1},
                 {"model": "m", "resident_step_s": 0.2, "step_s": 0.25, "remap_s_per_step": 0.1}]
        pts = relation_points([{"cases": cases}], "m")
        assert [(round(e, 9), r) for e, r in pts] == [(0.03, 0.06), (0.04, 0.08), (0.05, 0.1)], pts
        summary = relation_summary(pts)
        assert summary["n"] == 3 and abs(summary["correlation"] - 1) < 1e-9 and abs(summary["slope"] - 0.5) < 1e-9
        assert all(abs(x - 0.5) < 1e-9 for x in [summary["ratio_median"]] + summary["ratio_range"]), summary
        assert relation_summary(pts[:2])["quartiles"] is None  # too few sides for quartiles
        res = {"settings": {"steps": 12, "warmup": 2},
               "cases": [{"model": "m", "budget_fraction": 0.25, "step_s": 0.25, "call_s_per_step": 0.0125,
                          "layerswap_stats": {"after_warmup": {"segments": {"allocated": 10}},
                                              "end": {"segments": {"allocated": 60}}}}]}
        (r,) = rows(res)
        assert r["step"] == "0.250" and r["alloc"] == "0.013" and r["segs"] == "5" and r["lock"] == "-", r
        assert r["c:segs"] == "5" and r["c:new s"] == "-", r
        res["cases"][0]["variants"] = {"v": {"step_s": 0.2, "num_reclaims_per_step": 3.0, "segment_new_s_per_step": 0.004}}
        r, v = rows(res)
        assert v["case"] == "m 0.25 [v]" and v["step"] == "0.200" and v["alloc"] == "-", v
        assert v["c:reclaim"] == "3" and v["c:new s"] == "0.004" and v["segs"] == "-", v
        del res["cases"][0]["variants"]
        res["cases"][0]["threads_per_step"] = {"pt_autograd_0": {"threads": 1, "cpu_s": 0.1, "runqueue_s": 0.0}}
        res["cases"][0]["resident_threads_per_step"] = {"pt_autograd_0": {"threads": 1, "cpu_s": 0.08}}
        (t,) = thread_rows(res)
        assert t["cpu"] == "0.100" and t["cpu res"] == "0.080" and t["runq res"] == "-", t
        res["cases"][0]["evicted_bytes_by_phase.1_per_step"] = 2.5e8
        (p,) = phase_rows(res)
        assert p["figure"] == "evicted MB" and p["1"] == "250" and p["0"] == "-", p
        res["models"] = {"m": {"interleave": {"resident_block_position_s": [0.2, 0.1, 0.1]}}}
        res["cases"][0]["interleave"] = {"block_position_s": [0.3, 0.15, None]}
        assert place_rows(res) == [{"case": "m resident", "0": "200.0", "1": "100.0", "2": "100.0"},
                                   {"case": "m 0.25", "0": "300.0", "1": "150.0", "2": "-"}], place_rows(res)
        runs = [{"device": "X", "cases": [{"model": "m", "budget_fraction": 0.25, "step_s": 1.1, "resident_step_s": 1.0,
                                            "bound_s": 1.0, "step_over_bound": 1.1,
                                            "interleave": {"median_ratio": 1.1, "ratios_per_cycle": [1.0, 1.1, 1.3]},
                                            "peers": {"p": {"layerswap_speedup": 2.0, "interleave": {
                                                "layerswap_speedup": {"ratios_per_cycle": [2.0, 2.2]}}}}}]},
                {"device": "X", "cases": [{"model": "m", "budget_fraction": 0.25, "step_s": 1.3, "resident_step_s": 1.0,
                                            "bound_s": 1.0, "step_over_bound": 1.3,
                                            "interleave": {"median_ratio": 1.25, "ratios_per_cycle": [1.2, 1.4]}}]},
                {"cases": [{"model": "m", "budget_fraction": 0.5, "step_over_bound": 9.0}]}]
        pool = pool_case(runs, "m", 0.25, limit=1.2, resamples=200)
        assert [r["step_over_bound"] for r in pool["runs"]] == [1.1, 1.3], pool
        assert pool["cycles"] == 5 and abs(pool["median"] - 1.2) < 1e-9, pool
        assert pool["within"] == 1 and pool["within_paired"] == 1 and not pool["bound_not_resident"], pool
        lo, hi = pool["median_ci"]
        assert 1.0 <= lo <= pool["median"] <= hi <= 1.4, pool
        assert pool["peers"]["p"]["runs"] == 1 and abs(pool["peers"]["p"]["median"] - 2.1) < 1e-9, pool
        assert pool["peers"]["p"]["speedup_range"] == [2.0, 2.0], pool
        runs[0]["cases"][0]["peers"]["p"]["layerswap_speedup"] = None  # no step figure: no per-run range, no error
        assert pool_case(runs, "m", 0.25, limit=1.2, resamples=10)["peers"]["p"]["speedup_range"] is None
        runs[1]["cases"][0]["bound_s"] = 1.2  # S / B above the resident step: the cycles' ratios are not over the bound
        assert pool_case(runs, "m", 0.25, limit=1.2, resamples=10)["bound_not_resident"] == 1
        assert pool_case(runs, "m", 0.1, limit=1.2)["runs"] == []
        print("swap_stats self-test: ok")
        return 0
    if a.relation:
        results = load_runs(a.json)
        pts = relation_points(results, a.relation)
        if len(pts) < 2:
            print(f"{len(pts)} side(s) of {a.relation} with a step, a resident step and a remap time: too few",
                  file=sys.stderr)
            return 1
        summary = relation_summary(pts)
        quart = summary["quartiles"]
        def two(x):
            return "-" if x is None else f"{x:.2f}"
        print(f"{a.relation}: {summary['n']} sides in {len(a.json)} runs; the step's excess over the resident step "
              f"against the migration thread's remap time: correlation {two(summary['correlation'])}, slope "
              f"{two(summary['slope'])} s per s; their ratio: median {summary['ratio_median']:.2f}"
              + (f", quartiles {quart[0]:.2f}-{quart[1]:.2f}" if quart else "")
              + f", range {summary['ratio_range'][0]:.2f}-{summary['ratio_range'][1]:.2f}")
        return 0
    if a.pool:
        model, _, fraction = a.pool.rpartition(":")
        try:
            fraction = float(fraction)
        except ValueError:
            ap.error(f"--pool {a.pool!r}: expected MODEL:FRACTION, e.g. llama-lora:0.25")
        results = load_runs(a.json)
        pool = pool_case(results, model, fraction, limit=a.limit, names=a.json)
        if not pool["runs"]:
            print(f"no run of {a.json} has the case {model} at {fraction:g} with interleaved cycles", file=sys.stderr)
            return 1
        print_pool(pool, model, fraction, a.limit)
        return 0
    if len(a.json) != 1:
        ap.error("one run at a time, unless --relation or --pool")
    with open(a.json[0]) as fh:
        res = json.load(fh)
    table = rows(res)
    if not table:
        print("no cases", file=sys.stderr)
        return 1
    print_table(table, ["case"] + [c[0] for c in COLUMNS] + [c[0] for c in CHURN])
    print("seconds per step; cpu: the launching thread's CPU time (spin waits included); launch: kernel launch calls; "
          "alloc: allocator calls; lock: their mutex waits; wait: launches waiting for prefetches; host: the "
          "allocator's host waits; policy: the policy holding the mutex; vmm: the migration thread's map/unmap/access; "
          "evict, chunks, segs, phys: evictions, chunks made, segments made, physical allocations made per step; steal: CPU "
          "seconds the hypervisor took from the machine's CPUs per step (all CPUs), in layerswap's run and the resident one")
    print()
    print_table(table, ["case"] + ["c:" + c[0] for c in CAUSES], label=lambda n: n[2:] if n.startswith("c:") else n)
    print("per step: segs: segments made; new s, del s: seconds making and destroying them (on the allocating thread: "
          "reclaims and evictions included in new s); reclaim: idle segments destroyed for an allocation; by policy: "
          "... for a prefetch; chunks: chunks made, for segs: of which for new segments; released: chunks released, "
          "for size: to make room for another size, for pages: for the allocator's pages; policy: seconds the policy held "
          "the allocator's mutex, maintain: of which the allocator's housekeeping, room: of which finding prefetches "
          "a chunk; waits: allocator calls that found the mutex taken, spun: of which got it spinning")
    threads = thread_rows(res)
    if threads:
        print()
        print_table(threads, ["case", "thread", "n", "cpu", "cpu res", "runq", "runq res"])
        print("CPU seconds per timed step of each thread (by name; n: how many threads share it), layerswap's run and "
              "the resident one; runq: seconds it was ready to run but waited for a core")
    phases = phase_rows(res)
    if phases:
        print()
        print_table(phases, ["case", "figure"] + [str(i) for i in range(8)])
        print("per timed step, by the eighth of the learned step (0: the forward pass's start): bytes evicted and "
              "prefetched (by where the move ended), the migration thread's remap time, and launches' waits for late "
              "prefetches")
    places = place_rows(res)
    if places:
        print()
        width = max(len(r) - 1 for r in places)
        for r in places:
            r.update({str(i): "-" for i in range(width) if str(i) not in r})
        print_table(places, ["case"] + [str(i) for i in range(width)])
        print("ms per step by its place in an interleaved block, the median over blocks and processes (0: the step "
              "after a pause, left out of the step figures): a side whose place 1 is slower than its later places "
              "takes more than one step to settle after a pause")
    return 0


# Where in the step the moves fall: per eighth of the learned step, per timed step (bench/swap.py's per-step figures).
PHASES = [("evicted MB", "evicted_bytes_by_phase", 1e-6, "{:.0f}"),
          ("prefetched MB", "prefetched_bytes_by_phase", 1e-6, "{:.0f}"),
          ("remap ms", "remap_s_by_phase", 1e3, "{:.1f}"),
          ("late wait ms", "late_wait_s_by_phase", 1e3, "{:.1f}")]


def phase_rows(res):
    """One row per side and figure: the figure in each eighth of the step; sides that recorded none are left out."""
    out = []
    for label, c in sides(res):
        for name, key, scale, fmt in PHASES:
            vals = [c.get(f"{key}.{i}_per_step") for i in range(8)]
            if all(v is None for v in vals):
                continue
            row = {"case": label, "figure": name}
            for i, v in enumerate(vals):
                row[str(i)] = fmt.format(v * scale) if isinstance(v, (int, float)) else "-"
            out.append(row)
    return out


def place_rows(res):
    """An interleaved run's step by its place in the block (bench/swap.py's block_position_s; place 0 follows a
    pause and is left out of the figures), in ms: each model's resident side, then each case's layerswap side, its
    variants and its peers. Empty for a run that did not interleave."""
    out = []

    def row(label, places):
        if places:
            out.append({"case": label, **{str(i): "-" if t is None else f"{t * 1e3:.1f}" for i, t in enumerate(places)}})

    for name, m in (res.get("models") or {}).items():
        row(f"{name} resident", (m.get("interleave") or {}).get("resident_block_position_s"))
    for label, c in sides(res):
        row(label, (c.get("interleave") or {}).get("block_position_s"))
        for peer, p in (c.get("peers") or {}).items():
            row(f"{label} {peer}", (p.get("interleave") or {}).get("block_position_s"))
    return out


def load_runs(names):
    """The bench/swap.py runs (JSON files) named, in order."""
    results = []
    for name in names:
        with open(name) as fh:
            results.append(json.load(fh))
    return results


def relation_points(results, model):
    """(the step's excess over the resident step, the migration thread's remap time), seconds per step, for every side
    of `model` in `results` (bench/swap.py runs: each case and its variants, against the case's resident step) that
    recorded both."""
    pts = []
    for res in results:
        for c in res.get("cases", []):
            resident = c.get("resident_step_s")
            if c.get("model") != model or not resident:
                continue
            for side in [c] + list((c.get("variants") or {}).values()):
                if side.get("step_s") and side.get("remap_s_per_step"):
                    pts.append((side["step_s"] - resident, side["remap_s_per_step"]))
    return pts


def relation_summary(pts):
    """How the excess goes with the remap time over `pts` (relation_points, two or more): their correlation, the
    least-squares slope of excess on remap time, and the ratio excess / remap time's median, quartiles (None with
    fewer than four sides) and range."""
    excess, remap = [e for e, _ in pts], [r for _, r in pts]
    ratios = sorted(e / r for e, r in pts)
    same = len(set(excess)) == 1 or len(set(remap)) == 1
    return {"n": len(pts), "correlation": None if same else statistics.correlation(remap, excess),
            "slope": None if len(set(remap)) == 1 else statistics.linear_regression(remap, excess).slope,
            "ratio_median": statistics.median(ratios),
            "quartiles": (lambda q: [q[0], q[2]])(statistics.quantiles(ratios, n=4)) if len(ratios) >= 4 else None,
            "ratio_range": [ratios[0], ratios[-1]]}


def _median_ci(values, resamples, seed=54):
    """A bootstrap 95% interval of the median of `values` (a fixed seed: the same runs give the same interval)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [meds[int(0.025 * (resamples - 1))], meds[int(0.975 * (resamples - 1))]]


def pool_case(results, model, fraction, limit, names=None, resamples=2000):
    """One case (`model` at budget `fraction`) over several bench/swap.py runs: per run its step over the bound and
    its paired median (step / resident per cycle); all runs' cycles pooled, with their median, quartiles and a
    bootstrap interval of the median; how many runs were within `limit` either way; and each peer's paired
    speedups pooled the same way. `bound_not_resident` counts the runs whose bound was S / B rather than the
    resident step, where a cycle's step / resident is not its step over the bound."""
    runs, cycles, peers = [], [], {}
    for i, res in enumerate(results):
        for c in res.get("cases", []):
            inter = c.get("interleave") or {}
            if c.get("model") != model or c.get("budget_fraction") != fraction or not inter.get("ratios_per_cycle"):
                continue
            runs.append({"name": names[i] if names else str(i), "device": res.get("device"),
                         "resident_step_s": c.get("resident_step_s"), "step_over_bound": c.get("step_over_bound"),
                         "paired": inter.get("median_ratio"), "cycles": len(inter["ratios_per_cycle"]),
                         "bound_is_resident": (c.get("bound_s") or 0) <= (c.get("resident_step_s") or 0)})
            cycles += inter["ratios_per_cycle"]
            for peer, p in (c.get("peers") or {}).items():
                speed = ((p.get("interleave") or {}).get("layerswap_speedup") or {}).get("ratios_per_cycle")
                if speed:
                    entry = peers.setdefault(peer, {"runs": 0, "cycles": [], "speedups": []})
                    entry["runs"] += 1
                    entry["cycles"] += speed
                    entry["speedups"].append(p.get("layerswap_speedup"))
    out = {"runs": runs, "cycles": len(cycles), "peers": {}}
    if not cycles:
        return out
    out["median"] = statistics.median(cycles)
    out["quartiles"] = (lambda q: [q[0], q[2]])(statistics.quantiles(cycles, n=4)) if len(cycles) >= 4 else None
    out["median_ci"] = _median_ci(cycles, resamples)
    out["within"] = sum(1 for r in runs if r["step_over_bound"] is not None and r["step_over_bound"] <= limit)
    out["within_paired"] = sum(1 for r in runs if r["paired"] is not None and r["paired"] <= limit)
    out["bound_not_resident"] = sum(1 for r in runs if not r["bound_is_resident"])
    for peer, e in peers.items():
        speedups = [x for x in e["speedups"] if x]
        out["peers"][peer] = {"runs": e["runs"], "cycles": len(e["cycles"]), "median": statistics.median(e["cycles"]),
                              "median_ci": _median_ci(e["cycles"], resamples),
                              "speedup_range": [min(speedups), max(speedups)] if speedups else None}
    return out


def print_pool(pool, model, fraction, limit):
    print(f"{model} at {fraction:g}: {len(pool['runs'])} runs, {pool['cycles']} interleaved cycles")
    print(f"  {'run':<48} {'device':<12} {'resident':>8} {'step/bnd':>8} {'paired':>7} {'cycles':>6}")
    for r in pool["runs"]:
        res = f"{r['resident_step_s']:.4f}" if r["resident_step_s"] else "-"
        sob = f"{r['step_over_bound']:.3f}" if r["step_over_bound"] is not None else "-"
        par = f"{r['paired']:.3f}" if r["paired"] is not None else "-"
        print(f"  {pathlib.Path(r['name']).name:<48} {str(r['device'])[-12:]:<12} {res:>8} {sob:>8} {par:>7} "
              f"{r['cycles']:>6}")
    q, ci = pool["quartiles"], pool["median_ci"]
    print(f"  pooled cycles, step / resident: median {pool['median']:.3f}"
          + (f" (quartiles {q[0]:.3f}-{q[1]:.3f})" if q else "") + f", 95% interval of the median {ci[0]:.3f}-{ci[1]:.3f}")
    print(f"  runs within {limit:g}x: {pool['within']} of {len(pool['runs'])} by step over the bound, "
          f"{pool['within_paired']} paired")
    if pool["bound_not_resident"]:
        print(f"  note: in {pool['bound_not_resident']} run(s) the bound was S / B, above the resident step: their "
              "cycles' step / resident is not their step over the bound")
    for peer, p in pool["peers"].items():
        span = p["speedup_range"]
        print(f"  {peer}: layerswap faster by {p['median']:.2f}x pooled over {p['cycles']} cycles of {p['runs']} runs "
              f"(95% interval {p['median_ci'][0]:.2f}-{p['median_ci'][1]:.2f})"
              + (f"; per run {span[0]:.2f}-{span[1]:.2f}x" if span else ""))


def _seconds(v):
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def thread_rows(res, top=6):
    """The busiest threads of each case's layerswap run beside the resident run's threads of the same name."""
    out = []
    fmt = _seconds
    for label, c in sides(res):
        ls, resident = c.get("threads_per_step") or {}, c.get("resident_threads_per_step") or {}
        for name in list(ls)[:top]:
            mine, theirs = ls[name], resident.get(name) or {}
            out.append({"case": label, "thread": name,
                        "n": str(mine.get("threads", "-")), "cpu": fmt(mine.get("cpu_s")),
                        "cpu res": fmt(theirs.get("cpu_s")), "runq": fmt(mine.get("runqueue_s")),
                        "runq res": fmt(theirs.get("runqueue_s"))})
    return out


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the tables quietly, as other tools' output does
    sys.exit(main())
