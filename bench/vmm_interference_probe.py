#!/usr/bin/env python3
"""Do the residency engine's VMM calls slow the threads that launch kernels? Trains a swap.py case resident (no
layerswap) and times its steps alone and beside a native thread (bench/vmm_load.cpp, built here with g++) that maps,
grants access to and unmaps an allocation at a VA no kernel uses, busy --duty of the time: "host" maps host-located
memory (an eviction's remap, the dear kind), "device" device memory (a prefetch's); or that queries a completed event
("query": a move's polling) or records one on a stream of its own ("record": a fence); "host-ctx" and "device-ctx"
make the remaps in a context the thread creates, not PyTorch's (primary) one, "host-green" and "device-green" in a
green context it creates (one over all the SMs: it shares the primary context's memory), "host-none" and
"device-none" with no context current at all. Nothing moves and no kernel reads that memory, so a slower step or more
CPU in the launching threads is what the driver's shared state costs them. Each kind of context the modes name is
first checked: a mapping made there must serve the primary context. The engine-pattern modes make the engine's work
at a set rate instead of a duty: --regions allocations of --mib side by side, evicted to host pages and prefetched
back, --rate GB/s each way, with three calls per region ("regions", as the engine does), or one unmap and one set
access over them all ("span": a third of the calls for the same bytes), or with device memory in place of the host's
("device-regions"); "span-unmap" and "span-access" span one of the two calls only; "h2d" makes the prefetches' H2D
copies of those bytes alone (no remap), "regions-h2d" both. The load thread is named layerswap-move, so
--pin-threads (the default) puts it on the core the engine's thread gets.
Prints, per row, the median step, the issue time and the launching threads' CPU per step with ratios to the mean of
the "off" rows; --out writes JSON.

    python3 bench/vmm_interference_probe.py --case llama-lora --out probe.json"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import swap_models as sm  # noqa: E402


# The load thread's modes (vmm_load.cpp, run()): remaps of device or host memory, event queries, event records.
LOAD_MODES = {"device": 0, "host": 1, "query": 2, "record": 3, "device-ctx": 4, "host-ctx": 5, "device-green": 6,
              "host-green": 7, "device-none": 8, "host-none": 9}
CROSS_KINDS = {"ctx": 0, "green": 1, "none": 2}  # vmm_cross_context_check's kind
# The engine's pattern at a set rate (vmm_load.cpp, run_engine()): --regions regions of --mib evicted to host pages
# and prefetched back, --rate GB/s each way; one region's calls after another, or one unmap and one set access
# over them all; "device-regions" as "regions" with a second device allocation in place of the host pages;
# "span-unmap" one unmap over them, the rest per region; "span-access" one set access over them, the rest per region.
# "h2d" the H2D copies of those bytes alone (pinned host memory, a stream of its own), "regions-h2d" both.
ENGINE_MODES = {"regions": 0, "span": 1, "device-regions": 2, "span-unmap": 3, "span-access": 4, "h2d": 5,
                "regions-h2d": 6}


def build_load(out_dir):
    """Compiles vmm_load.cpp; returns the loaded library."""
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    lib = Path(out_dir) / "libvmm_load.so"
    cmd = ["g++", "-O2", "-std=c++20", "-shared", "-fPIC", str(HERE / "vmm_load.cpp"), f"-I{cuda}/include",
           f"-L{cuda}/lib64", f"-L{cuda}/lib64/stubs", "-lcuda", "-lpthread", "-o", str(lib)]
    subprocess.run(cmd, check=True)
    so = ctypes.CDLL(str(lib))
    so.vmm_load_start.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_double]
    so.vmm_engine_load_start.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_double]
    so.vmm_load_stop.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_double)]
    so.vmm_cross_context_check.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_int]
    return so


def launching_cpu(rec):
    """CPU seconds per step of the threads that launch: the Python thread (and its siblings) and autograd's."""
    t = rec.get("threads_per_step") or {}
    return sum(v["cpu_s"] for k, v in t.items() if k in ("python3", "python", "pt_autograd_0"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="llama-lora", choices=["llama-lora", "llama-full", "unet"])
    ap.add_argument("--steps", type=int, default=12, help="steps per row (default 12)")
    ap.add_argument("--warmup", type=int, default=3, help="of which untimed (default 3)")
    ap.add_argument("--mib", type=int, default=24, help="bytes mapped per round, MiB (default 24: a layer's matrix)")
    ap.add_argument("--duty", type=float, default=0.6,
                    help="share of the time the load thread is in VMM calls (default 0.6: the engine's at LoRA 25%%)")
    ap.add_argument("--modes", default="off,host,off,device,off,host,off")
    ap.add_argument("--regions", type=int, default=8,
                    help="regions per round of the engine-pattern modes (default 8)")
    ap.add_argument("--rate", type=float, default=20.0,
                    help="GB/s each way of the engine-pattern modes (default 20: the engine's at LoRA 25%%)")
    ap.add_argument("--no-pin", action="store_true", help="leave the threads where the scheduler puts them")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    for m in a.modes.split(","):
        if m not in ("off", *LOAD_MODES, *ENGINE_MODES):
            raise SystemExit(f"--modes: {m!r} is not one of off, {', '.join((*LOAD_MODES, *ENGINE_MODES))}")
    if any(m in ENGINE_MODES for m in a.modes.split(",")) and (a.mib % 2 or a.regions < 1 or a.rate <= 0):
        raise SystemExit(f"--mib {a.mib}, --regions {a.regions}, --rate {a.rate}: the modes "
                         f"{', '.join(ENGINE_MODES)} need an even --mib (2 MiB pages), --regions >= 1 and --rate > 0")
    if not 0 < a.duty <= 1:
        raise SystemExit(f"--duty {a.duty}: give a share in (0, 1]")
    with tempfile.TemporaryDirectory() as tmp:
        so = build_load(tmp)
        sm.make_deterministic(0)
        cfg = sm.RunConfig(case=a.case, steps=a.steps, warmup=a.warmup, pin_threads=not a.no_pin)
        built = sm.build_case(cfg)
        torch.cuda.synchronize()
        cross = {}
        for kind in CROSS_KINDS:
            if not any(m.endswith("-" + kind) for m in a.modes.split(",")):
                continue
            ctx_bytes = ctypes.c_longlong()
            err = so.vmm_cross_context_check(ctypes.byref(ctx_bytes), CROSS_KINDS[kind])
            cross[kind] = {"error": err, "context_device_bytes": ctx_bytes.value}
            print(f"cross-context check ({kind}): "
                  f"{'mappings serve the primary context' if err == 0 else f'error {err}'}; "
                  f"the context took {ctx_bytes.value / 2**20:.1f} MiB of device memory", flush=True)
        rows = []
        for mode in a.modes.split(","):
            t_load = time.perf_counter()
            if mode in ENGINE_MODES:
                started = so.vmm_engine_load_start(ENGINE_MODES[mode], a.mib, a.regions, a.rate)
            else:
                started = so.vmm_load_start(LOAD_MODES[mode], a.mib, a.duty) if mode != "off" else 0
            if started != 0:
                raise SystemExit("the load thread was already running")
            rec = sm.train(built, cfg, log=lambda *_: None)
            row = {"mode": mode, "median_step_s": rec["median_step_s"], "median_issue_s": rec["median_issue_s"],
                   "launching_cpu_s": launching_cpu(rec), "threads_per_step": rec.get("threads_per_step")}
            if mode != "off":
                rounds, busy = ctypes.c_ulonglong(), ctypes.c_double()
                err = so.vmm_load_stop(ctypes.byref(rounds), ctypes.byref(busy))
                if err != 0:
                    raise SystemExit(f"the load thread failed (error {err}, see vmm_load.cpp)")
                row["load_rounds"] = rounds.value
                row["load_busy_s"] = busy.value
                if mode in ENGINE_MODES:
                    wall = time.perf_counter() - t_load
                    row["load_gbps_each_way"] = rounds.value * a.regions * a.mib * 2**20 / 1e9 / wall
                    row["load_busy_share"] = busy.value / wall
                    row["load_us_per_mib"] = busy.value * 1e6 / max(1, rounds.value) / (2 * a.regions * a.mib)
                elif mode.split("-")[0] in ("device", "host"):
                    row["load_us_per_mib"] = busy.value * 1e6 / max(1, rounds.value) / a.mib
                else:
                    row["load_us_per_call"] = busy.value * 1e6 / max(1, rounds.value)
            rows.append(row)
            print(f"{a.case} {mode:6s} step {row['median_step_s']:.4f} s  issue {row['median_issue_s']:.4f} s  "
                  f"launching CPU {row['launching_cpu_s']:.4f} s/step"
                  + (f"  load {row['load_busy_s']:.2f} s busy, {row['load_rounds']} rounds" if mode != "off" else "")
                  + (f", {row['load_gbps_each_way']:.1f} GB/s each way, busy {row['load_busy_share']:.0%}, "
                     f"{row['load_us_per_mib']:.2f} us/MiB" if mode in ENGINE_MODES else ""),
                  flush=True)
    off = [r for r in rows if r["mode"] == "off"]
    summary = {}
    if off:
        base = {k: statistics.mean(r[k] for r in off) for k in ("median_step_s", "median_issue_s", "launching_cpu_s")}
        for mode in (*LOAD_MODES, *ENGINE_MODES):
            got = [r for r in rows if r["mode"] == mode]
            if got:
                summary[mode] = {k: {"value": statistics.mean(r[k] for r in got), "off": base[k],
                                     "ratio": statistics.mean(r[k] for r in got) / base[k]} for k in base}
                print(f"{mode:6s} vs off: " + ", ".join(f"{k} {v['value']:.4f} / {v['off']:.4f} = {v['ratio']:.3f}x"
                                                       for k, v in summary[mode].items()), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "case": a.case, "mib": a.mib, "duty": a.duty,
                       "regions": a.regions, "rate_gbps": a.rate,
                       "rows": rows, "summary": summary, "cross_context": cross or None}, fh, indent=1)


if __name__ == "__main__":
    main()
