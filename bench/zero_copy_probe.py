#!/usr/bin/env python3
"""Can a kernel read a swapped-out weight where it lies, in host memory, instead of having it copied in first?

An evicted region stays mapped to its host copy (DESIGN.md invariant 3), so a kernel that touches it runs, reading
over PCIe ("zero-copy"). The residency engine instead copies every region in before its use and out after, and at
25% of the 1.1B LoRA's weights its remaps keep the migration thread busy ~96% of the forward pass
(docs/history.md, session 31). If a GEMM reading its weight from host memory runs near the link's speed, a region
left on the host costs the GPU about what its copy costs the copy engine, and the engine no VMM call at all.

This times, per weight shape of the 1.1B Llama (M tokens = --tokens), bf16:
  fwd    F.linear(x, W)          (x: M x K, W: N x K)
  dgrad  g @ W                   (g: M x N): the input gradient, the backward pass's read of a frozen weight
with W in device memory, in host-located VMM memory mapped at a VA of its own (what an evicted region is), and in
cudaHostAlloc memory (torch's pinned allocator); each result is compared bitwise with the device one (the same
kernel must run), and times are CUDA-event medians. Also: the link's raw rates (a copy engine H2D copy, and a
kernel summing the host-located weight), and one decoder layer's seven projections forward and dgrad.
Prints a table and writes JSON to --out."""
import argparse
import ctypes
import json
import math
import statistics

import torch

from vmm_sync_probe import CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_LOCATION_TYPE_DEVICE, \
    CU_MEM_LOCATION_TYPE_HOST, Access, CudaArray, Loc, ck, create_pinned, open_driver, reserve_va

MIB = 1 << 20
GRAN = 2 * MIB


def host_vmm_tensor(cu, dev, shape, keep):
    """A bf16 CUDA tensor of `shape` backed by host-located VMM memory at a VA of its own (an evicted region)."""
    size = -(-(2 * math.prod(shape)) // GRAN) * GRAN
    handle = create_pinned(cu, dev, CU_MEM_LOCATION_TYPE_HOST, size)
    va = reserve_va(cu, size, GRAN)
    ck(cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)), "cuMemMap")
    acc = Access(Loc(CU_MEM_LOCATION_TYPE_DEVICE, dev), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    ck(cu.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1)), "cuMemSetAccess")
    keep.append((va, size, handle))
    return torch.as_tensor(CudaArray(va.value, shape, "<i2"), device=f"cuda:{dev}").view(torch.bfloat16)


def pinned_tensor(shape, keep):
    """A bf16 CUDA tensor of `shape` over cudaHostAlloc memory (unified addressing: the host pointer serves the GPU)."""
    host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    keep.append(host)
    return torch.as_tensor(CudaArray(host.data_ptr(), shape, "<i2"), device="cuda").view(torch.bfloat16)


def timed(fn, reps, warm=3):
    """Median milliseconds of fn() by CUDA events."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="zero_copy_probe.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    cu, dev = open_driver()
    keep = []
    shapes = {"q/o": (2048, 2048), "k/v": (256, 2048), "gate/up": (5632, 2048), "down": (2048, 5632)}
    rows = []
    M = args.tokens
    for name, (n, k) in shapes.items():
        w_dev = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        w_vmm = host_vmm_tensor(cu, dev, (n, k), keep)
        w_pin = pinned_tensor((n, k), keep)
        w_vmm.copy_(w_dev)
        w_pin.copy_(w_dev)
        torch.cuda.synchronize()
        x = torch.randn(M, k, device="cuda").to(torch.bfloat16)
        g = torch.randn(M, n, device="cuda").to(torch.bfloat16)
        mb = n * k * 2 / 1e6
        row = {"weight": name, "shape": [n, k], "mbytes": round(mb, 2)}
        for op, f in (("fwd", lambda w: torch.nn.functional.linear(x, w)), ("dgrad", lambda w: g @ w)):
            ref = f(w_dev)
            for where, w in (("device", w_dev), ("host_vmm", w_vmm), ("pinned", w_pin)):
                ms = timed(lambda: f(w), args.reps)
                same = bool(torch.equal(f(w).view(torch.int16), ref.view(torch.int16)))
                row[f"{op}_{where}_ms"] = round(ms, 4)
                row[f"{op}_{where}_bitwise"] = same
                if where != "device":
                    row[f"{op}_{where}_gbps"] = round(mb / ms, 1)  # MB per ms = GB/s
        dst = torch.empty_like(w_dev)
        row["h2d_copy_ms"] = round(timed(lambda: dst.copy_(w_pin, non_blocking=True), args.reps), 4)
        row["h2d_copy_gbps"] = round(mb / row["h2d_copy_ms"], 1)
        row["sum_host_vmm_gbps"] = round(mb / timed(lambda: w_vmm.sum(dtype=torch.float32), args.reps), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    # One decoder layer's projections (q, k, v, o, gate, up, down), forward then dgrad, all weights in one place.
    layer = {"q": (2048, 2048), "k": (256, 2048), "v": (256, 2048), "o": (2048, 2048), "gate": (5632, 2048),
             "up": (5632, 2048), "down": (2048, 5632)}
    per_place = {}
    for where in ("device", "host_vmm"):
        ws = {}
        for key, (n, k) in layer.items():
            w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
            if where == "host_vmm":
                h = host_vmm_tensor(cu, dev, (n, k), keep)
                h.copy_(w)
                w = h
            ws[key] = w
        xs = {key: torch.randn(M, k, device="cuda").to(torch.bfloat16) for key, (n, k) in layer.items()}
        gs = {key: torch.randn(M, n, device="cuda").to(torch.bfloat16) for key, (n, k) in layer.items()}

        def fwd():
            for key in layer:
                torch.nn.functional.linear(xs[key], ws[key])

        def dgrad():
            for key in layer:
                gs[key] @ ws[key]

        per_place[where] = {"fwd_ms": round(timed(fwd, args.reps), 3), "dgrad_ms": round(timed(dgrad, args.reps), 3)}
    layer_mb = sum(n * k * 2 for n, k in layer.values()) / 1e6
    result = {"device": torch.cuda.get_device_name(), "tokens": M, "rows": rows,
              "layer": {"mbytes": round(layer_mb, 1), **per_place}}
    torch.cuda.synchronize()
    print(f"\n{'weight':8} {'MB':>6} | {'fwd dev':>8} {'fwd vmm':>8} {'GB/s':>6} {'pin':>8} | {'dgr dev':>8} "
          f"{'dgr vmm':>8} {'GB/s':>6} | {'copy GB/s':>9} {'sum GB/s':>8} bitwise")
    for r in rows:
        same = all(v for key, v in r.items() if key.endswith("_bitwise"))
        print(f"{r['weight']:8} {r['mbytes']:6.1f} | {r['fwd_device_ms']:8.3f} {r['fwd_host_vmm_ms']:8.3f} "
              f"{r['fwd_host_vmm_gbps']:6.1f} {r['fwd_pinned_ms']:8.3f} | {r['dgrad_device_ms']:8.3f} "
              f"{r['dgrad_host_vmm_ms']:8.3f} {r['dgrad_host_vmm_gbps']:6.1f} | {r['h2d_copy_gbps']:9.1f} "
              f"{r['sum_host_vmm_gbps']:8.1f} {same}")
    print(f"one layer ({layer_mb:.0f} MB): device fwd {per_place['device']['fwd_ms']} ms dgrad "
          f"{per_place['device']['dgrad_ms']} ms; host fwd {per_place['host_vmm']['fwd_ms']} ms dgrad "
          f"{per_place['host_vmm']['dgrad_ms']} ms")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
