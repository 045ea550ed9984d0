#!/usr/bin/env python3
"""Do CUDA VMM calls wait for the GPU? Times cuMemMap / cuMemSetAccess / cuMemUnmap of a range no kernel uses,
once with the GPU idle and once while a long kernel (torch.cuda._sleep) runs on another stream. If a call takes
about as long as the running kernel, it waits for the device, and every remap the residency engine makes stalls the
program's stream. Device and host-located pages are both tried. Then: map/access/unmap cost by mapping count (n pages
of 2 MiB against one n * 2 MiB allocation: is an unmap paid per mapping or per byte?), a GEMM loop and a tiny-launch
loop beside a thread that remaps (do remaps slow the GPU, or the launching thread?). Prints tables and writes JSON
to --out. Run on the H100 at 1d3a595: figures in allocator/residency.cpp, Note [Chunks]."""
import argparse
import ctypes
import json
import time

import torch

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class Access(ctypes.Structure):
    _fields_ = [("location", Loc), ("flags", ctypes.c_int)]


def ck(r, what):
    """Raises when a driver call did not return CUDA_SUCCESS."""
    if r != 0:
        raise RuntimeError(f"{what} failed: {r}")


def size_probe_args(mib, reps, out, mib_help, more=None):
    """The command line of a probe that times allocations by size: --mib (comma-separated MiB), --reps, --out, and
    what `more(parser)` adds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", default=mib, help=mib_help)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--out", default=out)
    if more:
        more(ap)
    return ap.parse_args()


class CudaArray:
    """What torch.as_tensor takes as a CUDA array: `shape` words of numpy type `typestr` (e.g. "<i2", "|u1") at a
    device-visible address `ptr` (a VMM range, or pinned host memory through unified addressing)."""

    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "version": 3, "strides": None}


def create_pinned(cu, dev, loc_type, size):
    """One pinned physical allocation of `size` bytes on device `dev` or on the host (`loc_type`), as a c_ulonglong."""
    prop = Prop()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = Loc(loc_type, dev if loc_type == CU_MEM_LOCATION_TYPE_DEVICE else 0)
    handle = ctypes.c_ulonglong()
    ck(cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)),
       "cuMemCreate")
    return handle


def open_driver():
    """torch's CUDA context made current; libcuda and the device index, for a probe's driver calls."""
    torch.zeros(1, device="cuda")
    return ctypes.CDLL("libcuda.so.1"), torch.cuda.current_device()


def reserve_va(cu, size, gran):
    """A VA range of `size` bytes, `gran`-aligned (cuMemAddressReserve), as a c_ulonglong."""
    va = ctypes.c_ulonglong()
    ck(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(gran), ctypes.c_ulonglong(0),
                              ctypes.c_ulonglong(0)), "reserve")
    return va


def timed_map_access_unmap(cu, va, size, handle, acc):
    """Maps `handle` at `va`, grants the device access, unmaps: the three calls' times in ms."""
    t = time.perf_counter()
    ck(cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)), "map")
    t1 = time.perf_counter()
    ck(cu.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1)), "access")
    t2 = time.perf_counter()
    ck(cu.cuMemUnmap(va, ctypes.c_size_t(size)), "unmap")
    t3 = time.perf_counter()
    return (t1 - t) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128, help="range size (default 128: room for 64 pages)")
    ap.add_argument("--sleep-ms", type=float, default=50.0)
    ap.add_argument("--out", default="vmm_sync_probe.json")
    a = ap.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    cu = ctypes.CDLL("libcuda.so.1")

    dev = torch.cuda.current_device()
    gran = 2 << 20
    size = a.mib << 20
    # cycles for --sleep-ms: calibrate
    s = torch.cuda.Stream()
    t0 = time.perf_counter(); torch.cuda._sleep(10_000_000); torch.cuda.synchronize(); dt = time.perf_counter() - t0
    cycles = int(10_000_000 * (a.sleep_ms / 1e3) / dt)

    def make(loc_type):
        return create_pinned(cu, dev, loc_type, size)

    va = reserve_va(cu, size, gran)
    acc = Access(Loc(CU_MEM_LOCATION_TYPE_DEVICE, dev), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    results = []
    for kind, lt in (("device", CU_MEM_LOCATION_TYPE_DEVICE), ("host", CU_MEM_LOCATION_TYPE_HOST)):
        h = make(lt)
        for busy in (False, True):
            rows = {"map": [], "set_access": [], "unmap": []}
            for _ in range(5):
                torch.cuda.synchronize()
                if busy:
                    with torch.cuda.stream(s):
                        torch.cuda._sleep(cycles)
                m, ac, u = timed_map_access_unmap(cu, va, size, h, acc)
                rows["map"].append(m); rows["set_access"].append(ac); rows["unmap"].append(u)
            torch.cuda.synchronize()
            med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
            results.append({"pages": kind, "gpu_busy": busy, "median_ms": med, "all_ms": rows})
            print(f"{kind:6s} busy={busy!s:5s} map {med['map']:.3f} ms  set_access {med['set_access']:.3f} ms  "
                  f"unmap {med['unmap']:.3f} ms  (kernel {a.sleep_ms} ms)")
        cu.cuMemRelease(h)
    # Cost by mapping count (residency.cpp, Note [Batched unmaps]): n pages of 2 MiB mapped one by one (as the
    # engine maps a region's pooled pages) against one physical allocation of n * 2 MiB mapped once. Is an
    # unmap paid per mapping or per byte?
    by_count = []
    for n in (1, 4, 16, 64):
        if n * gran > size:
            break
        pages = [create_pinned(cu, dev, CU_MEM_LOCATION_TYPE_DEVICE, gran) for _ in range(n)]
        big = create_pinned(cu, dev, CU_MEM_LOCATION_TYPE_DEVICE, n * gran)
        hbig = create_pinned(cu, dev, CU_MEM_LOCATION_TYPE_HOST, n * gran)
        rows = {"pages_map": [], "pages_access": [], "pages_unmap_each": [], "pages_unmap_one_call": [],
                "one_map": [], "one_access": [], "one_unmap": [], "host_map": [], "host_access": [], "host_unmap": []}
        for rep in range(6):
            t = time.perf_counter()
            for i, h in enumerate(pages):
                ck(cu.cuMemMap(ctypes.c_ulonglong(va.value + i * gran), ctypes.c_size_t(gran), ctypes.c_size_t(0), h,
                               ctypes.c_ulonglong(0)), "map page")
            t1 = time.perf_counter()
            ck(cu.cuMemSetAccess(va, ctypes.c_size_t(n * gran), ctypes.byref(acc), ctypes.c_size_t(1)), "access")
            t2 = time.perf_counter()
            if rep % 2 == 0:
                for i in range(n):
                    ck(cu.cuMemUnmap(ctypes.c_ulonglong(va.value + i * gran), ctypes.c_size_t(gran)), "unmap page")
                rows["pages_unmap_each"].append((time.perf_counter() - t2) * 1e3)
            else:
                ck(cu.cuMemUnmap(va, ctypes.c_size_t(n * gran)), "unmap run")
                rows["pages_unmap_one_call"].append((time.perf_counter() - t2) * 1e3)
            rows["pages_map"].append((t1 - t) * 1e3); rows["pages_access"].append((t2 - t1) * 1e3)
            # one allocation of n * 2 MiB mapped once: device, then host-located (an eviction maps the backing)
            for prefix, handle in (("one", big), ("host", hbig)):
                t = time.perf_counter()
                ck(cu.cuMemMap(va, ctypes.c_size_t(n * gran), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)),
                   f"map {prefix}")
                t1 = time.perf_counter()
                ck(cu.cuMemSetAccess(va, ctypes.c_size_t(n * gran), ctypes.byref(acc), ctypes.c_size_t(1)),
                   f"access {prefix}")
                t2 = time.perf_counter()
                ck(cu.cuMemUnmap(va, ctypes.c_size_t(n * gran)), f"unmap {prefix}")
                t3 = time.perf_counter()
                rows[prefix + "_map"].append((t1 - t) * 1e3)
                rows[prefix + "_access"].append((t2 - t1) * 1e3)
                rows[prefix + "_unmap"].append((t3 - t2) * 1e3)
        for h in pages:
            cu.cuMemRelease(h)
        cu.cuMemRelease(big)
        cu.cuMemRelease(hbig)
        med = {k: sorted(v)[len(v) // 2] for k, v in rows.items() if v}
        by_count.append({"pages": n, "mib": n * 2, "median_ms": med})
        print(f"{n:3d} x 2 MiB: map {med['pages_map']:.3f} access {med['pages_access']:.3f} unmap each "
              f"{med['pages_unmap_each']:.3f} / one call {med['pages_unmap_one_call']:.3f} ms | one {n * 2} MiB "
              f"allocation: map {med['one_map']:.3f} access {med['one_access']:.3f} unmap {med['one_unmap']:.3f} ms | "
              f"host: map {med['host_map']:.3f} access {med['host_access']:.3f} unmap {med['host_unmap']:.3f} ms")
    # GPU-side cost: a GEMM loop timed alone, beside a thread that remaps (map + set_access + unmap, the engine's
    # calls) device or host pages of an unused range, and beside H2D + D2H copies on side streams.
    import threading
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def gemms(n=400):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            torch.mm(x, w)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    hd, hh = make(CU_MEM_LOCATION_TYPE_DEVICE), make(CU_MEM_LOCATION_TYPE_HOST)
    host_buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev_buf = torch.empty(size, dtype=torch.uint8, device="cuda")

    def churn(stop, h, per_page, counter):
        while not stop.is_set():
            if per_page:
                for i in range(size // gran):
                    cu.cuMemMap(ctypes.c_ulonglong(va.value + i * gran), ctypes.c_size_t(gran), ctypes.c_size_t(0),
                                h, ctypes.c_ulonglong(i * gran))
            else:
                cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0))
            cu.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1))
            if per_page:
                for i in range(size // gran):
                    cu.cuMemUnmap(ctypes.c_ulonglong(va.value + i * gran), ctypes.c_size_t(gran))
            else:
                cu.cuMemUnmap(va, ctypes.c_size_t(size))
            counter[0] += 1

    def copies(stop, counter):
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        while not stop.is_set():
            with torch.cuda.stream(s1):
                dev_buf.copy_(host_buf, non_blocking=True)
            with torch.cuda.stream(s2):
                host_buf.copy_(dev_buf, non_blocking=True)
            s1.synchronize(); s2.synchronize()
            counter[0] += 1

    def beside(measure, cases, unit):
        """`measure()` alone and beside each background thread of `cases`; the median of 3 runs of each."""
        out = {}
        for name, target, args in cases:
            times, cycles_done, t_all = [], 0, 0.0
            for _ in range(3):
                stop, counter = threading.Event(), [0]
                th = threading.Thread(target=target, args=(stop, *args, counter)) if target else None
                if th:
                    th.start(); time.sleep(0.01)
                t = time.perf_counter()
                times.append(measure())
                stop.set()
                if th:
                    th.join()
                t_all += time.perf_counter() - t
                cycles_done += counter[0]
            rate = cycles_done / t_all if t_all else 0.0
            out[name] = {unit: sorted(times)[1], "all": times, "churn_cycles": cycles_done, "cycles_per_s": rate}
            print(f"{measure.__name__} {name:20s} {sorted(times)[1]:8.3f} {unit}  ({cycles_done} cycles beside it, "
                  f"{rate:.0f}/s)")
        return out

    gemms(50)
    gpu = beside(gemms, (("alone", None, None), ("remap device pages", churn, (hd, True)),
                         ("remap host pages", churn, (hh, False)), ("h2d+d2h copies", copies, ())), "ms")
    # Launch-side cost: tiny launches (the launching thread's enqueue rate) alone and beside the remapping thread:
    # do VMM calls hold a driver lock that launches need?
    small = torch.zeros(256, device="cuda")

    def launches(n=20000):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            small.add_(1.0)
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        return dt / n * 1e6

    # The remapping thread's own rate with nothing else running (cycles/s), against its rate beside launches.
    def idle(t=0.3):
        time.sleep(t)
        return t * 1e3
    beside(idle, (("remap device pages", churn, (hd, True)), ("remap host pages", churn, (hh, False))), "ms")
    launches(2000)
    launch = beside(launches, (("alone", None, None), ("remap device pages", churn, (hd, True)),
                               ("remap host pages", churn, (hh, False)), ("alone again", None, None)), "us")
    # What a new segment costs the allocating thread (create + map + access, then unmap + release of a 22 MiB
    # device chunk, the allocator's path under a tight budget) alone and beside the remapping thread: do the
    # migration thread's host remaps (whose set-access takes ~12 us per MiB) serialize the allocator's VMM calls?
    seg_va = reserve_va(cu, 32 << 20, gran)
    seg_prop = Prop(); seg_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    seg_prop.location = Loc(CU_MEM_LOCATION_TYPE_DEVICE, dev)
    seg_bytes = 22 << 20

    def segments(n=200):
        t = time.perf_counter()
        for _ in range(n):
            h = ctypes.c_ulonglong()
            ck(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(seg_bytes), ctypes.byref(seg_prop),
                              ctypes.c_ulonglong(0)), "create")
            timed_map_access_unmap(cu, seg_va, seg_bytes, h, acc)
            ck(cu.cuMemRelease(h), "release")
        return (time.perf_counter() - t) / n * 1e6

    segments(20)
    segment = beside(segments, (("alone", None, None), ("remap device pages", churn, (hd, True)),
                                ("remap host pages", churn, (hh, False)), ("alone again", None, None)), "us")
    json.dump({"device": torch.cuda.get_device_name(), "mib": a.mib, "sleep_ms": a.sleep_ms, "results": results,
               "by_mapping_count": by_count, "gpu_side": gpu, "launch_side": launch, "segment_side": segment},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
