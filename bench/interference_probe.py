#!/usr/bin/env python3
"""Does copy traffic slow the GPU's compute? Trains a swap.py case resident (no layerswap) and times its steps
alone and beside a thread that keeps the copy engines busy the way swapping does: H2D copies from pinned host
memory on a side stream ("h2d"), the same plus a reduction kernel over each copied buffer on that stream (a proxy
for the write-back digests, Note [Write-back] in allocator/residency.cpp: "h2d+read"), and D2H copies beside the
H2D ones ("both"). A slowdown here is what swapping costs the program's kernels before layerswap does anything on
the CPU. Prints median step times with ratios to the first "alone" run and the copy rate reached; --out writes JSON.

    python3 bench/interference_probe.py --case llama-lora --out probe.json"""
import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import swap_models as sm  # noqa: E402


def traffic(mode, stop, counter, mib):
    n = mib << 20
    host_src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    while not stop.is_set():
        with torch.cuda.stream(h2d):
            dev_a.copy_(host_src, non_blocking=True)
            if mode == "h2d+read":
                dev_a.view(torch.int64).sum()
        if mode == "both":
            with torch.cuda.stream(d2h):
                host_dst.copy_(dev_b, non_blocking=True)
        h2d.synchronize()
        if mode == "both":
            d2h.synchronize()
        counter[0] += n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="llama-lora", choices=["llama-lora", "llama-full", "unet"])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64, help="bytes per copy (default 64 MiB)")
    ap.add_argument("--modes", default="alone,h2d,h2d+read,both,alone")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    sm.make_deterministic(0)
    cfg = sm.RunConfig(case=a.case, steps=a.steps, warmup=a.warmup)
    built = sm.build_case(cfg)
    rows = []
    for mode in a.modes.split(","):
        stop, counter = threading.Event(), [0]
        th = None
        if mode != "alone":
            th = threading.Thread(target=traffic, args=(mode, stop, counter, a.mib), daemon=True)
            th.start()
            time.sleep(0.5)
        c0, t0 = counter[0], time.perf_counter()
        rec = sm.train(built, cfg, log=lambda *_: None)
        rate = (counter[0] - c0) / (time.perf_counter() - t0) / 1e9
        stop.set()
        if th:
            th.join()
        row = {"mode": mode, "median_step_s": rec["median_step_s"], "median_cpu_s": rec["median_cpu_s"],
               "copy_gbps": rate}
        rows.append(row)
        base = rows[0]["median_step_s"]
        print(f"{a.case:10s} {mode:9s} step {row['median_step_s']:.4f} s ({row['median_step_s'] / base:.2f}x)  "
              f"cpu {row['median_cpu_s']:.4f} s  copies {rate:.1f} GB/s", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "case": a.case, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
