#!/usr/bin/env python3
"""Can kernel launches be seen without CUPTI? A coverage probe (bench/launch_hook_probe.c).

CUPTI's callbacks cost ~4% of the 1.1B LoRA step with an empty callback (docs/swapping.md, session 28), the largest
single part of layerswap's cost at 25%. The shim in bench/launch_hook_probe.c wraps the driver's launch functions
where libraries resolve them (dlsym, cuGetProcAddress) and interposes the runtime's launch functions (CUDA 13's
__cudaLaunchKernel among them), and counts the calls. This script builds it, trains a case for a few steps with
layerswap on (a budget above everything: the tracker sees every launch, nothing moves) and the shim preloaded, and
compares the shim's counts with the tracker's kernel launches in the same process. Equal counts say every launch of
the workload came through one of those two routes; a gap is the launches that took another path (a runtime linked
into a library, the driver's export table, graphs). Session 28 on the H200: 83% of the LoRA step's launches, 79% of
the UNet's, all but 4 of full fine-tuning's (docs/swapping.md).

    python3 bench/launch_hook_probe.py --steps 6 --out bench/results/launch_hook_probe.json
"""
import argparse
import ctypes
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def build_shim(tmp):
    out = pathlib.Path(tmp) / "launch_hook_probe.so"
    source = HERE / "launch_hook_probe.c"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-Wall", "-o", str(out), str(source), "-ldl"], check=True)
    return out


def child(args):
    sys.path.insert(0, str(HERE))
    import torch
    import swap_models
    import layerswap
    import layerswap.tracker as lt
    cfg = swap_models.RunConfig(case=args.case, steps=args.steps, warmup=min(2, args.steps - 1), quick=args.quick)
    built = swap_models.build_case(cfg)
    record = swap_models.train(built, cfg, log=lambda *_: None)
    torch.cuda.synchronize()
    shim = ctypes.CDLL(args.shim)
    count = shim.launch_hook_probe_count
    count.restype = ctypes.c_uint64
    counts = [count(i) for i in range(14)]
    tracker = {k: v for k, v in lt.stats().items() if isinstance(v, (int, float))}
    seen = {"cuLaunchKernel": counts[0:3], "cuLaunchKernelEx": counts[3:6], "resolved": counts[6],
            "conflicts": counts[7], "cudaLaunchKernel": counts[8], "cudaLaunchKernelExC": counts[9],
            "cudaLaunchCooperativeKernel": counts[10], "runtime_ptsz": counts[11], "__cudaLaunchKernel": counts[12],
            "__cudaLaunchKernel_ptsz": counts[13]}
    kept = ("launches", "kernels", "copies", "memsets", "graphs", "nested_skipped", "decoded")
    result = {"counts": seen, "tracker": {k: tracker.get(k) for k in kept}, "enabled": layerswap.is_enabled(),
              "median_step_s": record.get("median_step_s"), "losses_hex": record.get("losses_hex")}
    pathlib.Path(args.result).write_text(json.dumps(result))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", default="llama-lora")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="the small model (CPU-sized figures, for a smoke run)")
    p.add_argument("--out", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shim", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(HERE))
    import swap
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_shim(tmp)
        env = swap.worker_env(40 << 30, {})
        env["LD_PRELOAD"] = str(shim)
        result = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--child", "--shim", str(shim), "--result", str(result), "--case", args.case,
               "--steps", str(args.steps)]
        if args.quick:
            cmd.append("--quick")
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if run.returncode != 0 or not result.exists():
            sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
            sys.exit(run.returncode or 1)
        got = json.loads(result.read_text())
    c = got["counts"]
    driver = sum(c["cuLaunchKernel"]) + sum(c["cuLaunchKernelEx"])
    runtime_keys = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "runtime_ptsz",
                    "__cudaLaunchKernel", "__cudaLaunchKernel_ptsz")
    runtime = sum(c[k] for k in runtime_keys)
    kernels = got["tracker"]["kernels"] or 0
    got.update({"case": args.case, "steps": args.steps, "driver_resolved_launches": driver,
                "runtime_interposed_launches": runtime, "tracker_kernels": kernels,
                "driver_fraction": driver / kernels if kernels else None,
                "covered_fraction": (driver + runtime) / kernels if kernels else None})
    print(json.dumps({k: v for k, v in got.items() if k != "losses_hex"}, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
