#!/usr/bin/env python3
"""Can kernel launches be seen without CUPTI? A coverage probe (bench/launch_hook_probe.c).

CUPTI's callbacks cost ~4% of the 1.1B LoRA step with an empty callback (docs/history.md, session 28), the largest
single part of layerswap's cost at 25%. The shim in bench/launch_hook_probe.c wraps the driver's launch functions
where libraries resolve them (dlsym, cuGetProcAddress) and interposes the runtime's launch functions (CUDA 13's
__cudaLaunchKernel among them), and counts the calls. This script builds it, trains a case for a few steps with
layerswap on (a budget above everything: the tracker sees every launch, nothing moves) and the shim preloaded, and
compares the shim's counts with the tracker's kernel launches in the same process. Equal counts say every launch of
the workload came through one of those two routes; a gap is the launches that took another path (a runtime linked
into a library, the driver's export table, graphs). Session 28 on the H200: 83% of the LoRA step's launches, 79% of
the UNet's, all but 4 of full fine-tuning's (docs/history.md, session 28).

    python3 bench/launch_hook_probe.py --steps 6 --out bench/results/launch_hook_probe.json
    python3 bench/launch_hook_probe.py --self-test     # the shim on a fake driver and runtime, no GPU
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

# ---- --self-test: the shim on a fake driver and a fake runtime (no GPU, no CUDA) ----
FAKE_DRIVER = r"""
#include <stdint.h>
#include <string.h>
static int launches[2], launches_ex;
static int launch(int slot) { return ++launches[slot], 0; }
int cuLaunchKernel(void* f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned h,
                   void* s, void** p, void** x) { return launch(0); }
int cuLaunchKernel_ptsz(void* f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned h,
                        void* s, void** p, void** x) { return launch(1); }
int cuLaunchKernelEx(const void* config, void* f, void** p, void** x) { return ++launches_ex, 0; }
int cuGetProcAddress_v2(const char* symbol, void** pfn, int version, uint64_t flags, int* status) {
  if (status) *status = 0;
  if (strcmp(symbol, "cuLaunchKernel") == 0) *pfn = flags == 2 ? (void*)cuLaunchKernel_ptsz : (void*)cuLaunchKernel;
  else if (strcmp(symbol, "cuLaunchKernelEx") == 0) *pfn = (void*)cuLaunchKernelEx;
  else return 500;
  return 0;
}
int fake_driver_count(int which) { return which < 2 ? launches[which] : launches_ex; }
"""
FAKE_RUNTIME = r"""
#include <stddef.h>
typedef struct { unsigned x, y, z; } dim3_t;
static int calls;
int __cudaLaunchKernel(const void* k, dim3_t g, dim3_t b, void** a, size_t s, void* st) {
  return (g.x == 2 && b.z == 3 && s == 64) ? (++calls, 0) : 1;  /* the arguments arrive intact */
}
int fake_runtime_calls(void) { return calls; }
"""
CALLER = r"""
#include <stddef.h>
typedef struct { unsigned x, y, z; } dim3_t;
int __cudaLaunchKernel(const void* k, dim3_t g, dim3_t b, void** a, size_t s, void* st);
int call_runtime(int n) {
  dim3_t g = {2, 1, 1}, b = {1, 1, 3};
  int bad = 0;
  for (int i = 0; i < n; ++i) bad += __cudaLaunchKernel(0, g, b, 0, 64, 0) != 0;
  return bad;
}
"""


def self_test_child(tmp):
    tmp = pathlib.Path(tmp)
    shim = ctypes.CDLL(str(tmp / "launch_hook_probe.so"))
    count = shim.launch_hook_probe_count
    count.restype = ctypes.c_uint64
    driver = ctypes.CDLL(str(tmp / "libfake_driver.so"))
    proc = driver.cuGetProcAddress_v2  # through dlsym: the shim's wrapper
    launch_t = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3))
    for flags, n in ((0, 3), (2, 2)):
        fn = ctypes.c_void_p()
        assert proc(b"cuLaunchKernel", ctypes.byref(fn), 13000, ctypes.c_uint64(flags), None) == 0
        for _ in range(n):
            assert launch_t(fn.value)(None, 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
    ex = driver.cuLaunchKernelEx  # by name through dlsym
    for _ in range(4):
        assert ex(None, None, None, None) == 0
    assert driver.cuGetProcAddress_v2(b"cuMemAlloc", ctypes.byref(ctypes.c_void_p()), 13000, ctypes.c_uint64(0),
                                      None) == 500, "an unknown symbol must fail as the driver says"
    caller = ctypes.CDLL(str(tmp / "libcaller.so"))
    assert caller.call_runtime(5) == 0, "the interposed __cudaLaunchKernel garbled its arguments"
    runtime = ctypes.CDLL(str(tmp / "libfake_runtime.so"))
    got = {"shim": [count(i) for i in range(14)], "driver": [driver.fake_driver_count(i) for i in range(3)],
           "runtime": runtime.fake_runtime_calls()}
    expected_shim = [3, 0, 2, 4, 0, 0, 3, 0, 0, 0, 0, 0, 5, 0]  # slots 0/2, Ex slot 0, 3 handed out, __cudaLaunchKernel
    assert got["shim"] == expected_shim, got
    assert got["driver"] == [3, 2, 4], got  # every counted call reached the driver
    assert got["runtime"] == 5, got
    print("launch_hook_probe self-test: ok", got)


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        t = pathlib.Path(tmp)
        build_shim(tmp)
        for name, text in (("fake_driver", FAKE_DRIVER), ("fake_runtime", FAKE_RUNTIME)):
            (t / f"{name}.c").write_text(text)
            subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(t / f"lib{name}.so"), str(t / f"{name}.c")],
                           check=True)
        (t / "caller.c").write_text(CALLER)
        subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(t / "libcaller.so"), str(t / "caller.c"), f"-L{t}",
                        "-lfake_runtime", f"-Wl,-rpath,{t}"], check=True)
        env = dict(os.environ, LD_PRELOAD=str(t / "launch_hook_probe.so"))
        run = subprocess.run([sys.executable, __file__, "--self-test-child", tmp], env=env, capture_output=True,
                             text=True)
        sys.stdout.write(run.stdout)
        if run.returncode != 0:
            sys.stderr.write(run.stderr[-4000:])
            sys.exit(run.returncode)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", default="llama-lora")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="the small model (CPU-sized figures, for a smoke run)")
    p.add_argument("--out", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shim", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--self-test", action="store_true", help="the shim on a fake driver and runtime (no GPU)")
    p.add_argument("--self-test-child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.self_test:
        self_test()
        return
    if args.self_test_child:
        self_test_child(args.self_test_child)
        return
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
