#!/usr/bin/env python3
"""Does the GPU's other work make a host remap dearer? In isolation `bench/vmm_host_probe.py` finds 8-13 us per MiB to
grant the GPU access to host memory; inside the training step the migration thread's set-access calls average ~19 us
per MiB remapped at LoRA's 25% and 34-42 at full fine-tuning's (`bench/results/swap.json`, session 35), where copies
run both ways beside them. This probe times one eviction's and one prefetch's VMM calls (map, set access, unmap of a
--mib range of host memory, then of device memory) while the GPU does one kind of work at a time, enqueued on streams of
its own before the timing starts and checked to be still running when it ends:

  none     nothing
  h2d      pinned host -> device copies of --copy-mib (the engine's prefetches)
  d2h      device -> pinned host copies (its write-backs)
  both     the two at once, on two streams
  gemm     bf16 products (the SMs and HBM busy, the link idle)
  tiny     a graph of 1,000 one-element kernels replayed back to back (the GPU's front end busy)
  d2h_blocked   the d2h copies enqueued behind a stream wait that holds them for the whole timing (queued, not
                running)
  d2d      device -> device copies (the copy engines busy, no host memory written)
  d2h_sm   a kernel writing device data into pinned host memory (host memory written over the link by the SMs, not by
           a copy engine)
  h2d_sm   a kernel reading pinned host memory into device memory (the engine's prefetches done by the SMs, every copy
           engine idle)
  h2d_sm16 the same by a Triton kernel of 16 programs (16 SMs; skipped without Triton)

The loads rotate in rounds (--rounds), so the machine's drift falls on all alike; each row is the median over every
round's reps, and says in how many rounds the load outlasted the timing. Prints a table and writes JSON to --out.

On an H100 (session 36: bench/results/vmm_copy_probe_s36_h100.json, docs/history.md) a set-access made while something
writes host memory took 0.6-0.9 ms longer, whatever it mapped (device memory: 0.7 -> 29 us per MiB at 32 MiB); copies
queued but not running cost nothing; host -> device and device -> device copies made host remaps 1.5-1.9x dearer.
Session 40 (bench/results/vmm_copy_probe_s40_h100.json) added h2d_sm and h2d_sm16: the SMs reading host memory make
a host remap far dearer than a copy engine does (access + unmap 33x with every SM, 3.5x with 16, against 1.6x), so
prefetches copied by a kernel would cost the migration thread more, not less."""
import argparse
import ctypes
import json
import statistics
import time

import torch

from vmm_sync_probe import CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_LOCATION_TYPE_DEVICE, \
    CU_MEM_LOCATION_TYPE_HOST, Access, CudaArray, Loc, create_pinned, open_driver, reserve_va, \
    timed_map_access_unmap

MIB = 1 << 20
LOADS = ("none", "h2d", "d2h", "both", "gemm", "tiny", "d2h_blocked", "d2d", "d2h_sm", "h2d_sm", "h2d_sm16")


def cuda_view(pinned, shape, typestr, loads):
    """Pinned host tensor `pinned` as a CUDA tensor of `shape` words of `typestr` (zero-copy, through its device
    pointer), for a kernel to read or write; None, with a line saying that `loads` are skipped, where torch refuses."""
    try:
        return torch.as_tensor(CudaArray(pinned.data_ptr(), shape, typestr), device="cuda")
    except Exception as e:  # noqa: BLE001 - a torch that refuses a host pointer: the rows are left out
        print(f"{loads}: torch would not view pinned host memory as a CUDA tensor ({e}); skipped")
        return None


def triton_copy(programs):
    """A copy kernel of `programs` Triton programs (one SM each), each striding over the words in 16 KiB blocks; None
    without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        print("h2d_sm16: no Triton; that load is skipped")
        return None

    @triton.jit
    def copy_words(src, dst, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    def run(src, dst):
        copy_words[(programs,)](src, dst, src.numel(), BLOCK=4096, PROGRAMS=programs, num_warps=16)
    return run


class Load:
    """One kind of GPU work, enqueued far enough ahead to outlast a round's timing."""

    def __init__(self, copy_mib):
        n = copy_mib * MIB
        self.host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        self.host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self.dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.one = torch.zeros(1, device="cuda")
        self.s1 = torch.cuda.Stream()
        self.s2 = torch.cuda.Stream()
        self.copy_bytes = n
        self.s3 = torch.cuda.Stream()
        self.dev3 = torch.empty(n, dtype=torch.uint8, device="cuda")
        # The pinned buffer seen as a CUDA tensor (zero-copy, through its device pointer), for a kernel to write; and
        # the h2d copies' pinned source seen the same way, as 32-bit words, for a kernel to read (16-byte loads).
        self.host_view = cuda_view(self.host2, (n,), "|u1", "d2h_sm")
        self.src_view = cuda_view(self.host, (n // 4,), "<i4", "h2d_sm and h2d_sm16")
        self.dev_words = self.dev.view(torch.int32)
        self.sm16 = triton_copy(16) if self.src_view is not None else None
        if self.sm16 is not None:  # compiled here, not inside a round's timing; checked once
            self.host.random_(0, 256)
            self.sm16(self.src_view, self.dev_words)
            torch.cuda.synchronize()
            assert torch.equal(self.dev.cpu(), self.host), "the Triton copy kernel copied wrong bytes"
        # 1,000 one-element kernels in a graph: one launch keeps the front end busy ~1-2 ms, so the queue outlasts
        # the timing (launched one by one from Python, the GPU would drain them as fast as they come).
        self.tiny = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.s1):
            self.one.add_(1)
            torch.cuda.synchronize()
            with torch.cuda.graph(self.tiny, stream=self.s1):
                for _ in range(1000):
                    self.one.add_(1)

    @staticmethod
    def enqueue(stream, reps, work):
        """`work` `reps` times on `stream`, then an event: the end of this load."""
        with torch.cuda.stream(stream):
            for _ in range(reps):
                work()
            end = torch.cuda.Event()
            end.record()
        return end

    def start(self, kind, seconds):
        """Enqueues about `seconds` of `kind`; returns the events that end it and the bytes it moves."""
        def moving(rate):  # the copies (or writes) that take `seconds` at `rate` bytes a second
            return max(1, int(seconds * rate / self.copy_bytes))

        h2d = (self.s1, moving(50e9), lambda: self.dev.copy_(self.host, non_blocking=True))
        d2h = (self.s2, moving(50e9), lambda: self.host2.copy_(self.dev2, non_blocking=True))
        plans = {
            "none": [],
            "h2d": [h2d],
            "d2h": [d2h],
            "both": [h2d, d2h],
            "d2h_blocked": [d2h],
            "d2d": [(self.s1, moving(1000e9), lambda: self.dev3.copy_(self.dev2, non_blocking=True))],
            "d2h_sm": [] if self.host_view is None else
                      [(self.s1, moving(40e9), lambda: torch.add(self.dev2, 0, out=self.host_view))],
            "h2d_sm": [] if self.src_view is None else
                      [(self.s1, moving(40e9), lambda: torch.add(self.src_view, 0, out=self.dev_words))],
            "h2d_sm16": [] if self.sm16 is None else
                        [(self.s1, moving(20e9), lambda: self.sm16(self.src_view, self.dev_words))],
            # ~0.2-0.3 ms a 4096^3 bf16 product on an H100; ~1-2 ms a replay of the tiny graph
            "gemm": [(self.s1, max(1, int(seconds / 0.25e-3)), lambda: torch.mm(self.a, self.b))],
            "tiny": [(self.s1, max(1, int(seconds / 1e-3)), self.tiny.replay)],
        }
        if kind == "d2h_blocked":  # the copies' stream waits behind a sleep that outlasts the timing (~1.98 GHz)
            with torch.cuda.stream(self.s3):
                torch.cuda._sleep(int(seconds * 2.0e9))
                gate = torch.cuda.Event()
                gate.record()
            self.s2.wait_event(gate)
        ends = [self.enqueue(*plan) for plan in plans[kind]]
        moved = 0 if kind in ("gemm", "tiny") else sum(reps * self.copy_bytes for _, reps, _ in plans[kind])
        return ends, moved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=32, help="the remapped range, MiB (default 32: a layer's weight)")
    ap.add_argument("--copy-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=16, help="remaps of each kind per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=0.25, help="work enqueued per load per round")
    ap.add_argument("--out", default="vmm_copy_probe.json")
    a = ap.parse_args()
    cu, dev = open_driver()
    size = a.mib * MIB
    handles = {"host": create_pinned(cu, dev, CU_MEM_LOCATION_TYPE_HOST, size),
               "device": create_pinned(cu, dev, CU_MEM_LOCATION_TYPE_DEVICE, size)}
    va = reserve_va(cu, size, 2 * MIB)
    acc = Access(Loc(CU_MEM_LOCATION_TYPE_DEVICE, dev), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    load = Load(a.copy_mib)
    torch.cuda.synchronize()
    samples = {(k, m): [] for k in LOADS for m in handles}
    covered = {k: [] for k in LOADS}
    rates = {k: [] for k in LOADS}
    for r in range(a.rounds):
        order = LOADS[r % len(LOADS):] + LOADS[:r % len(LOADS)]
        for kind in order:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ends, copied = load.start(kind, a.seconds)
            time.sleep(0.01)  # let the work start
            for _ in range(a.reps):
                for mem, h in handles.items():
                    samples[(kind, mem)].append(timed_map_access_unmap(cu, va, size, h, acc))
            covered[kind].append(kind == "none" or (bool(ends) and all(not e.query() for e in ends)))
            torch.cuda.synchronize()
            if copied:
                rates[kind].append(copied / (time.perf_counter() - t0) / 1e9)
    rows = []
    for kind in LOADS:
        for mem in handles:
            t = samples[(kind, mem)]

            def per_mib(ms):  # a time of the whole range, ms -> us per MiB
                return round(ms * 1e3 / a.mib, 2)

            row = {"load": kind, "memory": mem, "mib": a.mib,
                   "map_us_per_mib": per_mib(statistics.median(x[0] for x in t)),
                   "access_us_per_mib": per_mib(statistics.median(x[1] for x in t)),
                   "unmap_us_per_mib": per_mib(statistics.median(x[2] for x in t)),
                   "access_p90_us_per_mib": per_mib(sorted(x[1] for x in t)[int(0.9 * (len(t) - 1))]),
                   "samples": len(t),
                   "load_outlasted_timing": f"{sum(covered[kind])}/{len(covered[kind])}",
                   "copy_gbps": round(statistics.median(rates[kind]), 1) if rates[kind] else None}
            rows.append(row)
            print(json.dumps(row))
    base = {r["memory"]: r for r in rows if r["load"] == "none"}
    print(f"\n{'load':6} {'memory':6} {'map':>6} {'access':>7} {'unmap':>6} {'vs none (access+unmap)':>24} {'outlasted':>9}")
    for r in rows:
        b = base[r["memory"]]
        ratio = (r["access_us_per_mib"] + r["unmap_us_per_mib"]) / max(1e-9, b["access_us_per_mib"] + b["unmap_us_per_mib"])
        print(f"{r['load']:6} {r['memory']:6} {r['map_us_per_mib']:6.2f} {r['access_us_per_mib']:7.2f} "
              f"{r['unmap_us_per_mib']:6.2f} {ratio:23.2f}x {r['load_outlasted_timing']:>9}")
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a), "rows": rows},
                  f, indent=1)
    cu.cuMemAddressFree(va, ctypes.c_size_t(size))
    for h in handles.values():
        cu.cuMemRelease(h)


if __name__ == "__main__":
    main()
