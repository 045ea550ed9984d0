#!/usr/bin/env python3
"""What PyTorch's cuBLAS calls cost the launching threads when CUBLAS_WORKSPACE_CONFIG is set.

Session 38's profile found 7-9% of every launching thread's CPU, in every side of bench/swap.py (the resident run
included), in libstdc++'s std::regex compiler (`_BracketMatcher::_M_ready`, `regex_traits::isctype`,
`collate::do_transform`, `__strxfrm_l`). The stacks (this probe's --stacks) show where: PyTorch 2.11's
`at::cuda::getCurrentCUDABlasHandle()` calls `setWorkspaceForHandle()`, which calls `getChosenWorkspaceSize()` on every
call, and that parses CUBLAS_WORKSPACE_CONFIG with a new `std::regex(":([0-9]+):([0-9]+)")` each time the variable is
set. Deterministic runs must set it (use_deterministic_algorithms(True) refuses cuBLAS otherwise), so every GEMM of the
benchmark's step compiles a regex, on whichever thread issues it.

Two measurements, each in fresh processes that take turns (ABAB...), the variable unset (A) and set to ":4096:8" (B):
  mm    N launches of a 64 x 64 bf16 torch.mm (launch-bound): microseconds and thread CPU per call;
  step  the 1.1B LoRA step of bench/swap.py without layerswap and with deterministic algorithms off (so that the
        variable may be unset): the step's median and its phases' launching-thread CPU;
  det   the same step deterministic, the variable set throughout or unset after the first step as bench/swap.py
        does (swap_models.drop_cublas_config): the losses must be bit-identical.
With --count, one more process of each kind runs with bench/strxfrm_count.c preloaded (compiled here with cc) and
reports the __strxfrm_l calls per mm and per step (about 516 per regex compiled). With --stacks N it also prints N
stacks of those calls.

    python3 bench/cublas_regex_probe.py --count --out regex.json

Needs a GPU, transformers and peft; not layerswap."""
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

HERE = Path(__file__).resolve().parent
CONFIGS = {"unset": None, "set": ":4096:8"}


def worker_mm(args):
    import torch
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(500):
        torch.mm(x, x)
    torch.cuda.synchronize()
    counter = probe_counter()
    calls0 = counter() if counter else None
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(args.n):
        torch.mm(x, x)
    issued = time.perf_counter() - t0
    cpu = time.thread_time() - c0
    torch.cuda.synchronize()
    out = {"us_per_call": 1e6 * issued / args.n, "cpu_us_per_call": 1e6 * cpu / args.n}
    if counter:
        out["strxfrm_per_call"] = (counter() - calls0) / args.n
    return out


def worker_step(args, deterministic=False):
    sys.path.insert(0, str(HERE))
    import torch
    import swap_models as sm
    if deterministic:
        sm.make_deterministic(0)
    else:
        torch.manual_seed(0)
    # Not deterministic: the variable stays as the parent set it. Deterministic: set, then dropped after the first
    # step unless --keep (swap_models.drop_cublas_config, what bench/swap.py does).
    cfg = sm.RunConfig(case="llama-lora", device="cuda", quick=args.quick, steps=args.steps, warmup=args.warmup,
                       pin_threads=True, keep_cublas_config=args.keep or not deterministic)
    built = sm.build_case(cfg)
    counter = probe_counter()
    marks = []

    def after_step(step):
        if counter:
            marks.append(counter())
        if counter and step == cfg.warmup and args.stacks:
            arm = ctypes.CDLL(None).layerswap_probe_strxfrm_arm
            arm.argtypes = [ctypes.c_int]
            arm(args.stacks)

    record = sm.train(built, cfg, after_step=after_step, log=lambda *a: None)
    phases = sm.median_phases(record["phase_times_s"][cfg.warmup:])
    out = {"median_step_s": statistics.median(record["step_times_s"][cfg.warmup:]),
           "phase_s": phases, "losses_hex": record["losses_hex"],
           "cublas_workspace_config": record.get("cublas_workspace_config")}
    if counter and len(marks) > cfg.warmup + 1:
        timed = marks[cfg.warmup:]
        out["strxfrm_per_step"] = (timed[-1] - timed[0]) / (len(timed) - 1)
    return out


def probe_counter():
    """The preloaded counter's reader, or None when bench/strxfrm_count.c is not loaded."""
    try:
        fn = ctypes.CDLL(None).layerswap_probe_strxfrm_calls
    except AttributeError:
        return None
    fn.restype = ctypes.c_long
    return fn


def run_worker(kind, config, args, preload=None, keep=False):
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    if CONFIGS[config] is not None:
        env["CUBLAS_WORKSPACE_CONFIG"] = CONFIGS[config]
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [sys.executable, __file__, "--worker", kind, "--n", str(args.n), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--stacks", str(args.stacks)] + (["--quick"] if args.quick else []) + \
        (["--keep"] if keep else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise SystemExit(f"{kind} worker ({config}) failed with status {r.returncode}:\n{r.stderr[-3000:]}")
    if args.stacks and preload:
        sys.stderr.write("".join(l + "\n" for l in r.stderr.splitlines() if l.startswith(("[strxfrm", "/", " "))))
    return json.loads(r.stdout.strip().splitlines()[-1])


def build_preload(tmp):
    out = Path(tmp) / "strxfrm_count.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(HERE / "strxfrm_count.c"), "-ldl"],
                   check=True)
    return str(out)


def summarize(rows, key):
    """{config: the median of `key` over the rows of that config}."""
    by = {c: [r[key] for r in rows if r["config"] == c] for c in CONFIGS}
    return {c: statistics.median(v) for c, v in by.items() if v}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=("mm", "step", "det"), help=argparse.SUPPRESS)
    ap.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=20000, help="mm launches per process (default 20000)")
    ap.add_argument("--mm-rounds", type=int, default=4, help="mm processes per setting (default 4)")
    ap.add_argument("--step-rounds", type=int, default=2, help="step processes per setting (default 2; 0: none)")
    ap.add_argument("--steps", type=int, default=14, help="training steps per step process (default 14)")
    ap.add_argument("--warmup", type=int, default=4, help="steps left out (default 4)")
    ap.add_argument("--det-rounds", type=int, default=1,
                    help="deterministic step processes per setting, the variable kept or dropped after the first "
                         "step as bench/swap.py does: their losses must be bit-identical (default 1; 0: none)")
    ap.add_argument("--quick", action="store_true", help="the tiny model (a smoke test)")
    ap.add_argument("--count", action="store_true", help="also count __strxfrm_l calls (bench/strxfrm_count.c)")
    ap.add_argument("--stacks", type=int, default=0, help="with --count: print this many stacks of those calls")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per process (default 300)")
    ap.add_argument("--out", help="result JSON")
    args = ap.parse_args()
    if args.worker:
        work = {"mm": worker_mm, "step": worker_step, "det": lambda a: worker_step(a, deterministic=True)}
        print(json.dumps(work[args.worker](args)), flush=True)
        return

    result = {"configs": CONFIGS, "n": args.n, "mm": [], "step": [], "det": [], "count": {}}
    for i in range(args.mm_rounds):
        for config in (CONFIGS if i % 2 == 0 else reversed(list(CONFIGS))):
            row = {"config": config, **run_worker("mm", config, args)}
            result["mm"].append(row)
            print(f"mm   {config:5s} {row['us_per_call']:6.2f} us a call, {row['cpu_us_per_call']:6.2f} us CPU",
                  flush=True)
    for i in range(args.step_rounds):
        for config in (CONFIGS if i % 2 == 0 else reversed(list(CONFIGS))):
            row = {"config": config, **run_worker("step", config, args)}
            result["step"].append(row)
            ph = row["phase_s"]
            print(f"step {config:5s} {row['median_step_s']:.4f} s; launching CPU forward {ph['forward'][1]:.4f} s, "
                  f"backward {ph['backward'][2] or 0:.4f} s (autograd thread)", flush=True)
    for i in range(args.det_rounds):
        for keep in ((True, False) if i % 2 == 0 else (False, True)):
            row = {"keep": keep, **run_worker("det", "set", args, keep=keep)}
            result["det"].append(row)
            print(f"det  {'kept   ' if keep else 'dropped'} {row['median_step_s']:.4f} s "
                  f"({row['cublas_workspace_config']})", flush=True)
    if result["det"]:
        hexes = {tuple(r["losses_hex"]) for r in result["det"]}
        result["det_losses_bitwise_equal"] = len(hexes) == 1
        print(f"det: losses bit-identical across {len(result['det'])} processes: {len(hexes) == 1}")
    if args.count:
        with tempfile.TemporaryDirectory() as tmp:
            preload = build_preload(tmp)
            result["count"]["mm"] = run_worker("mm", "set", args, preload)
            print(f"count mm (set): {result['count']['mm']['strxfrm_per_call']:.0f} __strxfrm_l calls per mm",
                  flush=True)
            if args.step_rounds:
                result["count"]["step"] = run_worker("step", "set", args, preload)
                print(f"count step (set): {result['count']['step'].get('strxfrm_per_step', 0):.0f} __strxfrm_l "
                      "calls per step", flush=True)

    mm = summarize(result["mm"], "cpu_us_per_call")
    result["mm_cpu_us_per_call"] = mm
    print(f"mm: CPU per call {mm['unset']:.2f} us unset, {mm['set']:.2f} us set: +{mm['set'] - mm['unset']:.2f} us")
    if result["step"]:
        st = summarize(result["step"], "median_step_s")
        result["median_step_s"] = st
        print(f"step: {st['unset']:.4f} s unset, {st['set']:.4f} s set ({st['set'] / st['unset']:.3f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
