#!/usr/bin/env python3
"""The foundation benchmark: layerswap's allocator against PyTorch's own, both measured in one run.

  1. alloc+free latency, 512 B .. 256 MiB: layerswap._C.bench_alloc_free(size, iters), the median of one
     allocation and free through PyTorch's current CUDA allocator on the current stream (warm cache);
  2. a training step of samples/train_transformer.py's model (the >= 1B default) with no budget pressure
     (LAYERSWAP=1, no LAYERSWAP_BUDGET): the median step time over every timed step.

Each side runs in a fresh process (the allocator is chosen before CUDA memory exists): this script re-invokes
itself with the hidden `--worker native|layerswap`. The sides alternate, native, layerswap, native,
layerswap (--rounds), to cancel drift (clocks, temperature); each side's figure is the median over all its
rounds. Results go to bench/results/foundation.json; a table is printed last.

    python3 bench/foundation.py            # the full run (a few minutes on an H100)
    python3 bench/foundation.py --quick    # a tiny model and few iterations: a smoke test
"""

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
TRAIN = REPO / "samples" / "train_transformer.py"
SIDES = ("native", "layerswap")

SIZES = [512, 4 << 10, 64 << 10, 1 << 20, 2 << 20, 16 << 20, 64 << 20, 256 << 20]
NO_GPU_MESSAGE = ("no CUDA GPU is visible: bench/foundation.py measures layerswap against PyTorch's allocator on a "
                  "GPU; see README for the tests you can run without one")


def size_label(n):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def load_train_module():
    spec = importlib.util.spec_from_file_location("train_transformer", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def side_env(side):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP")}
    for name in ("PYTORCH_NO_CUDA_MEMORY_CACHING", "PYTORCH_CUDA_ALLOC_CONF", "LD_PRELOAD"):
        env.pop(name, None)
    if side == "layerswap":
        env["LAYERSWAP"] = "1"  # enabled by torch's backend autoload, no budget: no pressure
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------------------------------------------------
# Worker: one side, in a fresh process
# ---------------------------------------------------------------------------------------------------------

def run_worker(args):
    import torch  # with LAYERSWAP=1 in the environment, this makes layerswap PyTorch's allocator

    out = {"side": args.worker, "enabled_by": None}
    import layerswap

    if args.worker == "layerswap":
        if layerswap.is_enabled():
            out["enabled_by"] = "environment (torch backend autoload)"
        else:
            print("WARNING: LAYERSWAP=1 is set but `import torch` did not enable layerswap; calling "
                  "layerswap.enable()", flush=True)
            layerswap.enable()
            out["enabled_by"] = "layerswap.enable() (the autoload did not enable it)"
        if not layerswap.is_enabled():
            raise SystemExit("layerswap could not be enabled")
    elif layerswap.is_enabled():
        raise SystemExit("layerswap is enabled in the native worker: unset LAYERSWAP and LAYERSWAP_BUDGET")
    from layerswap import _C

    if not torch.cuda.is_available():
        raise SystemExit(NO_GPU_MESSAGE)
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the allocator in force is initialised before bench_alloc_free uses it
    torch.cuda.synchronize()
    out["device"] = torch.cuda.get_device_name()
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda

    # 1. alloc+free latency.
    small_iters, large_iters = (200, 20) if args.quick else (2000, 200)
    alloc = {}
    for size in SIZES:
        iters = small_iters if size <= (2 << 20) else large_iters
        _C.bench_alloc_free(size, max(10, iters // 10))  # warm-up: the cache holds a block of this size
        runs = [_C.bench_alloc_free(size, iters) for _ in range(3)]
        alloc[str(size)] = statistics.median(runs)
        print(f"  [{args.worker}] alloc+free {size_label(size):>8}: {alloc[str(size)]:8.3f} us "
              f"(runs {', '.join(f'{r:.3f}' for r in runs)})", flush=True)
    out["alloc_free_us"] = alloc
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    # 2. training steps.
    tt = load_train_module()
    if args.quick:
        cfg = tt.ModelConfig(vocab=4096, d_model=256, layers=2, heads=2)
        batch, seq = 2, 128
    else:
        cfg = tt.ModelConfig()
        batch, seq = 4, 1024
    result = tt.train(cfg, steps=args.warmup + args.steps, warmup=args.warmup, batch=batch, seq=seq, seed=0,
                      device="cuda", log=lambda s: print(f"  [{args.worker}] {s}", flush=True))
    out["step_times_s"] = result["step_times_s"][result["warmup"]:]
    out["warmup_step_times_s"] = result["step_times_s"][:result["warmup"]]
    out["losses"] = result["losses"]
    out["params"] = result["params"]
    out["model"] = result["config"]
    out["peak_allocated"] = result["peak_allocated"]
    out["peak_reserved"] = result["peak_reserved"]
    out["layerswap_active"] = result["layerswap"]
    out["layerswap_stats"] = result["layerswap_stats"]
    if args.worker == "layerswap" and not result["layerswap"]:
        raise SystemExit("the layerswap worker trained without layerswap")
    with open(args.worker_out, "w") as f:
        json.dump(out, f, default=str)
    return 0


# ---------------------------------------------------------------------------------------------------------
# Parent: alternate the sides, aggregate, write, print
# ---------------------------------------------------------------------------------------------------------

def launch(side, args, round_index, tmpdir):
    path = pathlib.Path(tmpdir) / f"{side}-{round_index}.json"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", side, "--worker-out", str(path),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.quick:
        cmd.append("--quick")
    print(f"== round {round_index + 1}/{args.rounds}: {side}", flush=True)
    proc = subprocess.run(cmd, env=side_env(side), cwd=str(REPO), timeout=args.worker_timeout)
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"the {side} worker (round {round_index + 1}) failed with exit status {proc.returncode}; "
                           "its output is above")
    return json.loads(path.read_text())


def aggregate(runs, args):
    first = runs["native"][0]
    step = {side: statistics.median([t for r in runs[side] for t in r["step_times_s"]]) for side in SIDES}
    alloc = {}
    for size in SIZES:
        key = str(size)
        row = {side: statistics.median([r["alloc_free_us"][key] for r in runs[side]]) for side in SIDES}
        row["ratio"] = row["layerswap"] / row["native"] if row["native"] > 0 else None
        alloc[key] = row
    ls_stats = runs["layerswap"][-1].get("layerswap_stats") or {}
    return {
        "benchmark": "foundation",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": first["device"],
        "torch": first["torch"],
        "cuda": first["cuda"],
        "quick": bool(args.quick),
        "params": first["params"],
        "model": first["model"],
        "steps": sum(len(r["step_times_s"]) for r in runs["layerswap"]),  # timed steps per side
        "steps_detail": {"timed_per_run": args.steps, "warmup_per_run": args.warmup, "rounds": args.rounds},
        "step_s": step,
        "step_ratio_median": step["layerswap"] / step["native"],
        "step_s_per_round": {side: [statistics.median(r["step_times_s"]) for r in runs[side]] for side in SIDES},
        "step_times_s": {side: [r["step_times_s"] for r in runs[side]] for side in SIDES},
        "alloc_free_us": alloc,
        "alloc_free_us_per_round": {side: [r["alloc_free_us"] for r in runs[side]] for side in SIDES},
        "peak_allocated": {side: max(r["peak_allocated"] or 0 for r in runs[side]) for side in SIDES},
        "peak_reserved": {side: max(r["peak_reserved"] or 0 for r in runs[side]) for side in SIDES},
        "losses_equal_across_sides": runs["native"][0]["losses"] == runs["layerswap"][0]["losses"],
        "layerswap_enabled_by": runs["layerswap"][0]["enabled_by"],
        "layerswap_stats": ls_stats,
        "order": [f"{side}{i + 1}" for i in range(args.rounds) for side in SIDES],
    }


def gib(n):
    return f"{n / (1 << 30):.2f} GiB" if n else "n/a"


def print_table(res):
    print()
    print(f"layerswap foundation benchmark: {res['device']}, torch {res['torch']} (CUDA {res['cuda']}), "
          f"{res['date']}{'  [QUICK: smoke test, not a measurement]' if res['quick'] else ''}")
    print()
    print("alloc+free, median us per pair (warm cache, current stream)")
    print(f"  {'size':>8}  {'native':>10}  {'layerswap':>10}  {'ratio':>7}")
    for key, row in res["alloc_free_us"].items():
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "n/a"
        print(f"  {size_label(int(key)):>8}  {row['native']:10.3f}  {row['layerswap']:10.3f}  {ratio:>7}")
    print()
    s = res["steps_detail"]
    print(f"training step, {res['params']:,} parameters, batch {res['model']['batch']} x seq {res['model']['seq']}, "
          f"no budget; median of {res['steps']} timed steps per side ({s['rounds']} rounds of "
          f"{s['timed_per_run']} after {s['warmup_per_run']} warm-up steps)")
    print(f"  {'':>8}  {'native':>10}  {'layerswap':>10}  {'ratio':>7}")
    print(f"  {'step s':>8}  {res['step_s']['native']:10.4f}  {res['step_s']['layerswap']:10.4f}  "
          f"{res['step_ratio_median']:6.3f}x")
    for i in range(s["rounds"]):
        print(f"  {'round ' + str(i + 1):>8}  {res['step_s_per_round']['native'][i]:10.4f}  "
              f"{res['step_s_per_round']['layerswap'][i]:10.4f}")
    print(f"  {'peak res':>8}  {gib(res['peak_reserved']['native']):>10}  {gib(res['peak_reserved']['layerswap']):>10}")
    print(f"  losses equal across sides: {res['losses_equal_across_sides']} (not required: no deterministic mode)")
    print(f"  layerswap enabled by: {res['layerswap_enabled_by']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="layerswap vs PyTorch's CUDA allocator: alloc+free latency and a "
                                            "training step, both sides in one run")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/foundation.json; "
                                               "foundation_quick.json with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20; 4 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (default 5; 2 with --quick)")
    p.add_argument("--rounds", type=int, default=2, help="native/layerswap pairs of runs (default 2)")
    p.add_argument("--quick", action="store_true", help="tiny model and few iterations: a smoke test")
    p.add_argument("--worker-timeout", type=int, default=420, help="seconds allowed to one worker (default 420)")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.quick else 20
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    if args.out is None:
        args.out = str(HERE / "results" / ("foundation_quick.json" if args.quick else "foundation.json"))
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)

    import torch  # no CUDA context here: only the workers touch the GPU

    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    runs = {side: [] for side in SIDES}
    try:
        with tempfile.TemporaryDirectory(prefix="layerswap-bench-") as tmpdir:
            for r in range(args.rounds):
                for side in SIDES:
                    runs[side].append(launch(side, args, r, tmpdir))
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    res = aggregate(runs, args)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"\nwrote {out}")
    print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
