#!/usr/bin/env python3
"""How do the engine's remaps reach the threads that launch kernels? No training: a spinner thread, pinned to one
core, does one kind of work for --seconds, alone and beside the engine-pattern load of bench/vmm_load.cpp (a thread
named layerswap-move pinned to --load-cpu that evicts --regions regions of --mib to host pages and prefetches them
back at --rate GB/s each way, or the same with device memory in place of the host's). The spinner's kinds
(vmm_load.cpp, spin()): "alu" integer arithmetic in registers, "walk" a dependent walk over 256 MiB one 4 KiB page a
step (TLB misses at every step: TLB flushes sent to its core cost it), "cached" the same walk over 16 pages, "submit"
one-word cuMemsetD32Async calls (the driver's submission path, as a launch takes it), "fault" page faults (the
process's mmap lock), "pingpong" a token handed to and from a second thread two cores up (wake-ups), and PyTorch
kinds (TORCH_KINDS below). Each row gives the spinner's rate against the mean of the rows without load, and the
interrupts its core and the whole machine took per second (/proc/interrupts: TLB shootdowns, function-call and
rescheduling IPIs). It also reads /proc/self/maps around one
allocation's map and unmap, host-located and device: does the driver give the CPU a mapping of the VA?

    python3 bench/vmm_ipi_probe.py --out ipi.json"""
import argparse
import ctypes
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vmm_interference_probe import ENGINE_MODES, build_load  # noqa: E402

SPIN_KINDS = {"alu": 0, "walk": 1, "cached": 2, "submit": 3, "fault": 4, "pingpong": 5}
# Kinds that PyTorch runs on the spinner's thread: "launch" kernel launches on a one-element tensor (the launching
# thread's rate: the GPU keeps up); "gemm" 4096 x 4096 bf16 matrix products timed by events (the GPU's rate: the
# launches keep ahead); "graph" replays a CUDA graph of 1,000 one-element kernels, "graph-mm" one of 100 products of
# 1024 x 2048 by 2048 x 2048 (bf16, a 1.1B model's layer at batch 1 x 1024) each followed by an elementwise kernel:
# the GPU's rate at the small kernels of a training step, with no launching thread in the way (kernels per GPU
# second); "ops" out-of-place ops on small tensors (a new tensor each, from PyTorch's caching allocator): the
# launching thread's rate at a training step's small kernels.
TORCH_KINDS = ("launch", "gemm", "graph", "graph-mm", "ops")


def torch_spin(kind, cpu, seconds):
    """Runs a TORCH_KINDS kind on this thread, pinned to `cpu`, for about `seconds`; returns units per second
    (launches per wall second, or products per GPU second)."""
    import torch

    os.sched_setaffinity(0, {cpu})  # this thread only
    if kind == "launch":
        x = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(256):
                x.add_(1.0)
            n += 256
            torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)
    if kind == "ops":
        x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2048, 64, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(64):
                y = torch.nn.functional.silu(x @ w)
                z = (y * 0.5 + 1.0).sum(dim=0)
                del y, z
            n += 64 * 6
            torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)
    if kind in ("graph", "graph-mm"):
        side = torch.cuda.Stream()
        if kind == "graph":
            x = torch.zeros(1, device="cuda")
            body, per = (lambda: [x.add_(1.0) for _ in range(1000)]), 1000
        else:
            xs = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
            ys = torch.empty_like(xs)

            def body():
                for _ in range(100):
                    torch.matmul(xs, w, out=ys)
                    ys.mul_(0.5)
            per = 200
        with torch.cuda.stream(side):
            body()  # warm: cuBLAS picks its kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        torch.cuda.synchronize()
        gpu_s, n, t0 = 0.0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            gpu_s += start.elapsed_time(end) / 1e3
            n += per
        return n / gpu_s
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = a @ b
    torch.cuda.synchronize()
    gpu_s, n, t0 = 0.0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(32):
            torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        gpu_s += start.elapsed_time(end) / 1e3
        n += 32
    return n / gpu_s
LOADS = ("off", "regions", "device-regions")
IRQS = ("TLB", "CAL", "RES", "LOC")


def read_interrupts():
    """{name: [count per CPU]} from /proc/interrupts, for the rows in IRQS; {} where it cannot be read."""
    try:
        lines = Path("/proc/interrupts").read_text().splitlines()
    except OSError:
        return {}
    ncpu = len(lines[0].split())
    out = {}
    for line in lines[1:]:
        name, _, rest = line.partition(":")
        name = name.strip()
        if name in IRQS:
            out[name] = [int(x) for x in rest.split()[:ncpu]]
    return out


def tlb_vmstat():
    """The TLB counters of /proc/vmstat (kernels built with CONFIG_DEBUG_TLBFLUSH have them), else {}."""
    try:
        text = Path("/proc/vmstat").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split() for line in text.splitlines()) if "tlb" in k}


def pin_thread(name, cpu):
    """Pins this process's threads named `name` to `cpu`; returns how many."""
    n = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == name:
                os.sched_setaffinity(int(task.name), {cpu})
                n += 1
        except OSError:
            pass
    return n


def maps_lines(va):
    """The /proc/self/maps lines that overlap [va, va + 64 MiB)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+)", line)
        if m and int(m.group(1), 16) < va + (64 << 20) and int(m.group(2), 16) > va:
            out.append(line)
    return out


def maps_check(so):
    """Each step of vmm_maps_step() with the maps lines after it, for host-located and device memory."""
    so.vmm_maps_step.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong)]
    result = {}
    for host in (1, 0):
        va = ctypes.c_ulonglong()
        steps = []
        for step, what in enumerate(("created and reserved", "mapped, device access", "unmapped", "freed")):
            err = so.vmm_maps_step(step, host, ctypes.byref(va))
            steps.append({"step": what, "error": err, "maps": maps_lines(va.value)})
        result["host" if host else "device"] = steps
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0, help="per row (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="rows per (load, kind) (default 2)")
    ap.add_argument("--kinds", default="alu,walk,cached,submit")
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--spin-cpu", type=int, default=2, help="the spinner's core (default 2: the Python thread's)")
    ap.add_argument("--load-cpu", type=int, default=6, help="the load's core (default 6: layerswap-move's)")
    ap.add_argument("--mib", type=int, default=24)
    ap.add_argument("--regions", type=int, default=8)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    kinds = a.kinds.split(",")
    loads = a.loads.split(",")
    for k in kinds:
        if k not in SPIN_KINDS and k not in TORCH_KINDS:
            raise SystemExit(f"--kinds: {k!r} is not one of {', '.join((*SPIN_KINDS, *TORCH_KINDS))}")
    for m in loads:
        if m not in LOADS:
            raise SystemExit(f"--loads: {m!r} is not one of {', '.join(LOADS)}")
    if a.seconds <= 0 or a.repeats < 1 or a.mib % 2 or a.regions < 1 or a.rate <= 0:
        raise SystemExit(f"--seconds {a.seconds}, --repeats {a.repeats}, --mib {a.mib}, --regions {a.regions}, "
                         f"--rate {a.rate}: give seconds > 0, repeats >= 1, an even mib, regions >= 1, rate > 0")
    ncpu = os.cpu_count() or 1
    if not (0 <= a.spin_cpu < ncpu and 0 <= a.load_cpu < ncpu):
        raise SystemExit(f"--spin-cpu {a.spin_cpu}, --load-cpu {a.load_cpu}: this machine has cores 0-{ncpu - 1}")
    with tempfile.TemporaryDirectory() as tmp:
        so = build_load(tmp)
        so.vmm_spin.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.c_int]
        so.vmm_spin.restype = ctypes.c_double
        maps = maps_check(so)
        for where, steps in maps.items():
            for s in steps:
                print(f"maps, {where}: {s['step']:22s} error {s['error']}  " + (" | ".join(s["maps"]) or "(none)"))
        rows = []
        for rep in range(a.repeats):
            for load in loads:
                for kind in kinds:
                    t_load = time.perf_counter()
                    if load != "off":
                        if so.vmm_engine_load_start(ENGINE_MODES[load], a.mib, a.regions, a.rate) != 0:
                            raise SystemExit("the load thread was already running")
                        time.sleep(0.05)
                        pin_thread("layerswap-move", a.load_cpu)
                    got = {}
                    irq0, vm0, t0 = read_interrupts(), tlb_vmstat(), time.perf_counter()
                    if kind in TORCH_KINDS:
                        th = threading.Thread(target=lambda: got.setdefault(
                            "units", torch_spin(kind, a.spin_cpu, a.seconds) * a.seconds))
                    else:
                        th = threading.Thread(target=lambda: got.setdefault(
                            "units", so.vmm_spin(a.spin_cpu, a.seconds, SPIN_KINDS[kind])))
                    th.start()
                    th.join()
                    wall = time.perf_counter() - t0
                    irq1, vm1 = read_interrupts(), tlb_vmstat()
                    if "units" not in got:
                        raise SystemExit(f"the spinner ({kind}) failed: see the traceback above")
                    row = {"load": load, "kind": kind, "repeat": rep, "units_per_s": got["units"] / a.seconds,
                           "irq_per_s_spin_cpu": {k: (irq1[k][a.spin_cpu] - irq0[k][a.spin_cpu]) / wall for k in irq1},
                           "irq_per_s_all": {k: (sum(irq1[k]) - sum(irq0[k])) / wall for k in irq1},
                           "vmstat_tlb_per_s": {k: (vm1[k] - vm0.get(k, 0)) / wall for k in vm1}}
                    if load != "off":
                        rounds, busy = ctypes.c_ulonglong(), ctypes.c_double()
                        err = so.vmm_load_stop(ctypes.byref(rounds), ctypes.byref(busy))
                        if err != 0:
                            raise SystemExit(f"the load thread failed (error {err}, see vmm_load.cpp)")
                        load_wall = time.perf_counter() - t_load
                        row["load_gbps_each_way"] = rounds.value * a.regions * a.mib * 2**20 / 1e9 / load_wall
                        row["load_busy_share"] = busy.value / load_wall
                    if got["units"] < 0:
                        raise SystemExit(f"the spinner failed ({kind})")
                    rows.append(row)
                    irq = row["irq_per_s_spin_cpu"]
                    print(f"{load:15s} {kind:7s} {row['units_per_s']:.4g}/s  spin core irq/s "
                          + " ".join(f"{k} {v:.0f}" for k, v in irq.items())
                          + "  all TLB/s {:.0f}".format(row["irq_per_s_all"].get("TLB", 0))
                          + (f"  load {row['load_gbps_each_way']:.1f} GB/s, busy {row['load_busy_share']:.0%}"
                             if load != "off" else ""), flush=True)
    summary = {}
    for kind in kinds:
        base = statistics.mean(r["units_per_s"] for r in rows if r["kind"] == kind and r["load"] == "off") \
            if "off" in loads else None
        for load in loads:
            got = [r for r in rows if r["kind"] == kind and r["load"] == load]
            rate = statistics.mean(r["units_per_s"] for r in got)
            tlb = statistics.mean(r["irq_per_s_spin_cpu"].get("TLB", 0) for r in got)
            cal = statistics.mean(r["irq_per_s_spin_cpu"].get("CAL", 0) for r in got)
            summary[f"{load}/{kind}"] = {"units_per_s": rate, "vs_off": rate / base if base else None,
                                         "spin_cpu_tlb_per_s": tlb, "spin_cpu_cal_per_s": cal}
            print(f"{load:15s} {kind:7s} rate {rate / base if base else float('nan'):.3f}x off, "
                  f"spin core TLB {tlb:.0f}/s CAL {cal:.0f}/s")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"seconds": a.seconds, "mib": a.mib, "regions": a.regions, "rate_gbps": a.rate,
                       "spin_cpu": a.spin_cpu, "load_cpu": a.load_cpu, "maps": maps, "rows": rows,
                       "summary": summary}, fh, indent=1)


if __name__ == "__main__":
    main()
