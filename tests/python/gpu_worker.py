"""The GPU work of tests/python/test_gpu_torch.py, one check per sub-command, each run in a fresh process.

PyTorch's CUDA allocator can be swapped only before CUDA memory is allocated, so every check starts a new
interpreter: `python gpu_worker.py <check> --allocator native|layerswap`. The caller sets the environment
(LAYERSWAP=1, LAYERSWAP_BUDGET=1GiB, LD_PRELOAD=...). A check prints what it measured, then one line
"RESULT <json>", and exits 0 when every assertion held, 1 otherwise (each failed one printed as "FAIL: ...").

`--allocator native` runs the same check on PyTorch's own allocator: a control that shows the check itself is
right (a check that fails there is wrong, not layerswap).
"""

import argparse
import json
import os
import random
import sys
import time
import traceback

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class Checks:
    """Collects assertion results, so that one run reports every failed check, not only the first."""

    def __init__(self):
        self.failed = []
        self.record = {}

    def check(self, ok, message):
        if not ok:
            self.failed.append(message)
            print(f"FAIL: {message}", flush=True)
        return bool(ok)

    def note(self, key, value):
        self.record[key] = value
        print(f"  {key} = {value}", flush=True)


def fmt(n):
    return f"{n / MiB:.3f} MiB" if abs(n) >= MiB else f"{n} B"


def start(allocator, c):
    """Imports torch (whose backend autoload enables layerswap when the environment asks), and makes sure the
    allocator in force is the one the test asked for. Returns (torch, layerswap module or None)."""
    import torch

    c.note("torch", torch.__version__)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU is visible to the worker process")
    ls = None
    if allocator == "layerswap":
        import layerswap

        c.note("enabled_by_autoload", layerswap.is_enabled())
        if not layerswap.is_enabled():
            # Keep going on an explicit enable() so the remaining checks still say something;
            # test_environment_enables_layerswap reports the autoload failure itself.
            print("WARNING: LAYERSWAP/LAYERSWAP_BUDGET is set but `import torch` did not enable layerswap; "
                  "calling layerswap.enable()", flush=True)
            budget = os.environ.get("LAYERSWAP_BUDGET") or None
            layerswap.enable(budget=budget)
        c.check(layerswap.is_enabled(), "layerswap.is_enabled() is False after enabling")
        ls = layerswap
    else:
        try:
            import layerswap

            c.check(not layerswap.is_enabled(), "layerswap is enabled in a run meant to use PyTorch's allocator")
        except ImportError:
            pass
    torch.cuda.init()
    c.note("device", torch.cuda.get_device_name())
    return torch, ls


# ---------------------------------------------------------------------------------------------------------
# probe: does the environment alone enable layerswap?
# ---------------------------------------------------------------------------------------------------------

def check_probe(args, c):
    import torch
    import layerswap

    c.check(layerswap.is_enabled(), "LAYERSWAP=1 is set but `import torch` did not make layerswap PyTorch's "
                                    "CUDA allocator (torch.backends entry-point autoload)")
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    c.check(float(x.sum().item()) == 499500.0, "a tensor allocated through layerswap computes a wrong sum")
    st = layerswap.stats()
    c.note("stats_devices", sorted(st))
    if c.check(torch.cuda.current_device() in st, "layerswap.stats() has no entry for the current device"):
        s = st[torch.cuda.current_device()]
        c.check(s["allocated_bytes"]["current"] >= x.numel() * 4,
                f"layerswap.stats() allocated_bytes.current {s['allocated_bytes']['current']} < tensor bytes")


# ---------------------------------------------------------------------------------------------------------
# memory_api: memory_allocated / reserved / max / reset / memory_stats against known tensors
# ---------------------------------------------------------------------------------------------------------

SMALL_LIMIT = 1 * MiB  # requests up to this are slab-packed by layerswap (small pool in PyTorch)


def rounding_bound(nbytes):
    """The most memory_allocated() may grow for one tensor of `nbytes`: size classes (<= 12.5% + 512 B) for
    small requests, whole 2 MiB granules (< 2 MiB extra) for large ones."""
    if nbytes <= SMALL_LIMIT:
        return int(nbytes * 1.125) + 512
    return nbytes + 2 * MiB - 1


def check_memory_api(args, c):
    torch, ls = start(args.allocator, c)
    dev = torch.cuda.current_device()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    base_requested = ls.stats().get(dev, {}).get("requested_bytes", {}).get("current", 0) if ls else 0
    c.note("base_allocated", base)

    sizes = [1, 100, 511, 512, 513, 1000, 4096, 4097, 5000, 65536, 100_000, 300_000, SMALL_LIMIT,
             SMALL_LIMIT + 1, 3 * MiB, 3 * MiB + 1, 17 * MiB + 12345, 64 * MiB, 256 * MiB]
    live = []
    for n in sizes:
        before = torch.cuda.memory_allocated()
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        grew = torch.cuda.memory_allocated() - before
        live.append(t)
        c.check(n <= grew <= rounding_bound(n),
                f"allocating {n} bytes grew memory_allocated() by {grew} (expected {n}..{rounding_bound(n)})")
    total = sum(sizes)
    allocated = torch.cuda.memory_allocated()
    c.note("allocated_after", allocated)
    c.check(allocated - base >= total, f"memory_allocated() grew by {allocated - base} < {total} bytes of tensors")
    # Use the memory, so that a bad mapping would fault or compute wrongly.
    for i, t in enumerate(live):
        t.fill_(i % 251)
    torch.cuda.synchronize()
    for i, t in enumerate(live):
        got = int(t.sum(dtype=torch.int64).item())
        c.check(got == (i % 251) * t.numel(), f"tensor {i} ({t.numel()} bytes) reads back a wrong sum {got}")

    reserved = torch.cuda.memory_reserved()
    c.note("reserved", reserved)
    c.check(reserved >= allocated, f"memory_reserved() {reserved} < memory_allocated() {allocated}")
    c.check(torch.cuda.max_memory_allocated() >= allocated,
            f"max_memory_allocated() {torch.cuda.max_memory_allocated()} < memory_allocated() {allocated}")
    c.check(torch.cuda.max_memory_reserved() >= reserved,
            f"max_memory_reserved() {torch.cuda.max_memory_reserved()} < memory_reserved() {reserved}")

    ms = torch.cuda.memory_stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.peak", "num_ooms"):
        c.check(key in ms, f"torch.cuda.memory_stats() has no {key!r} (keys: {sorted(ms)[:8]}...)")
    c.check(ms.get("allocated_bytes.all.current") == allocated,
            f"memory_stats()['allocated_bytes.all.current'] {ms.get('allocated_bytes.all.current')} != "
            f"memory_allocated() {allocated}")
    c.check(ms.get("reserved_bytes.all.peak", -1) >= reserved,
            f"memory_stats()['reserved_bytes.all.peak'] {ms.get('reserved_bytes.all.peak')} < reserved {reserved}")

    if ls is not None:
        st = ls.stats()
        if c.check(dev in st, f"layerswap.stats() has no entry for device {dev}: {sorted(st)}"):
            s = st[dev]
            c.note("layerswap_allocated_current", s["allocated_bytes"]["current"])
            c.check(s["allocated_bytes"]["current"] == allocated,
                    f"layerswap.stats() allocated_bytes.current {s['allocated_bytes']['current']} != "
                    f"memory_allocated() {allocated}")
            c.check(s["reserved_bytes"]["current"] == reserved,
                    f"layerswap.stats() reserved_bytes.current {s['reserved_bytes']['current']} != "
                    f"memory_reserved() {reserved}")
            req = s["requested_bytes"]["current"] - base_requested
            c.check(req == total, f"layerswap.stats() requested_bytes grew by {req}, the tensors hold {total}")
            c.check(s["device_bytes"]["current"] >= s["reserved_bytes"]["current"],
                    f"layerswap.stats() device_bytes.current {s['device_bytes']['current']} < reserved_bytes "
                    f"{s['reserved_bytes']['current']}")

    # Peak: a temporary big tensor raises it; reset_peak_memory_stats() brings it back to current.
    tmp = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    peak_with_tmp = torch.cuda.max_memory_allocated()
    del tmp
    now = torch.cuda.memory_allocated()
    c.check(now == allocated, f"freeing a temporary tensor left memory_allocated() at {now}, expected {allocated}")
    c.check(peak_with_tmp >= allocated + 128 * MiB,
            f"max_memory_allocated() {peak_with_tmp} did not count a live 128 MiB tensor on top of {allocated}")
    c.check(torch.cuda.max_memory_allocated() > now, "the peak fell when the temporary tensor was freed")
    torch.cuda.reset_peak_memory_stats()
    c.check(torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated(),
            f"after reset_peak_memory_stats(), max_memory_allocated() {torch.cuda.max_memory_allocated()} != "
            f"memory_allocated() {torch.cuda.memory_allocated()}")
    c.check(torch.cuda.memory_stats()["allocated_bytes.all.peak"] == torch.cuda.memory_allocated(),
            "after reset_peak_memory_stats(), memory_stats()['allocated_bytes.all.peak'] != current")

    # Free everything: back to the start.
    del t
    live.clear()
    torch.cuda.synchronize()
    end = torch.cuda.memory_allocated()
    c.note("allocated_at_end", end)
    c.check(end == base, f"after freeing every tensor memory_allocated() is {end}, it was {base} at the start")
    c.check(torch.cuda.memory_stats()["allocated_bytes.all.current"] == end,
            "memory_stats()['allocated_bytes.all.current'] != memory_allocated() after the frees")
    c.check(torch.cuda.max_memory_allocated() >= allocated,
            "max_memory_allocated() fell below the level reached since the reset")
    if ls is not None:
        s = ls.stats()[dev]
        c.check(s["allocated_bytes"]["current"] == end,
                f"layerswap.stats() allocated_bytes.current {s['allocated_bytes']['current']} != {end} after frees")
        c.check(s["requested_bytes"]["current"] == base_requested,
                f"layerswap.stats() requested_bytes.current {s['requested_bytes']['current']} != "
                f"{base_requested} after frees")


# ---------------------------------------------------------------------------------------------------------
# empty_cache: cached memory stays reserved until empty_cache() hands it back to the driver
# ---------------------------------------------------------------------------------------------------------

def check_empty_cache(args, c):
    torch, ls = start(args.allocator, c)
    keep = torch.ones(1000, device="cuda")  # a live small tensor through the whole check
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    alloc0 = torch.cuda.memory_allocated()
    free0, total = torch.cuda.mem_get_info()
    count, size = 8, 256 * MiB
    big = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(count)]
    for i, t in enumerate(big):
        t.fill_(i + 1)
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    c.note("held_by_tensors", free0 - free1)
    c.check(free0 - free1 >= count * size - 64 * MiB,
            f"mem_get_info() free fell by {fmt(free0 - free1)} for {fmt(count * size)} of tensors")
    c.check(all(int(t[-1].item()) == i + 1 for i, t in enumerate(big)), "a big tensor reads back wrong")

    del big, t
    torch.cuda.synchronize()
    reserved2 = torch.cuda.memory_reserved()
    allocated2 = torch.cuda.memory_allocated()
    free2 = torch.cuda.mem_get_info()[0]
    c.note("reserved_after_free", reserved2)
    c.check(allocated2 == alloc0, f"memory_allocated() is {allocated2} after the frees, was {alloc0}")
    c.check(reserved2 >= alloc0 + count * size,
            f"memory_reserved() {fmt(reserved2)} fell below {fmt(alloc0 + count * size)} on free: freed memory "
            "should stay cached until empty_cache()")
    c.check(free2 <= free1 + 64 * MiB,
            f"mem_get_info() free rose by {fmt(free2 - free1)} on a plain free: the memory should stay cached")

    torch.cuda.empty_cache()
    reserved3 = torch.cuda.memory_reserved()
    allocated3 = torch.cuda.memory_allocated()
    free3 = torch.cuda.mem_get_info()[0]
    c.note("reserved_after_empty_cache", reserved3)
    c.note("free_gain_after_empty_cache", free3 - free2)
    slack = 32 * MiB
    c.check(reserved3 <= allocated3 + slack,
            f"after empty_cache() memory_reserved() is {fmt(reserved3)}, more than allocated {fmt(allocated3)} "
            f"+ {fmt(slack)}")
    released = reserved2 - reserved3
    c.check(free3 - free2 >= 0.9 * released - 16 * MiB,
            f"empty_cache() released {fmt(released)} of reserved memory but mem_get_info() free rose only "
            f"{fmt(free3 - free2)}")
    c.check(float(keep.sum().item()) == 1000.0, "a live tensor was damaged by empty_cache()")
    if ls is not None:
        s = ls.stats()[torch.cuda.current_device()]
        c.note("layerswap_cached_bytes", s["cached_bytes"])
        c.note("layerswap_num_device_free", s["num_device_free"])
        c.check(s["num_device_free"] > 0, "layerswap.stats() num_device_free is 0 after empty_cache()")


# ---------------------------------------------------------------------------------------------------------
# oom: the budget (run with LAYERSWAP_BUDGET=1GiB)
# ---------------------------------------------------------------------------------------------------------

def check_oom(args, c):
    torch, ls = start("layerswap", c)
    dev = torch.cuda.current_device()
    budget = 1 * GiB
    torch.zeros(1, device="cuda")  # creates the device allocator
    st = ls.stats()[dev]
    c.note("budget", st["budget"])
    c.check(st["budget"] == budget, f"layerswap.stats() budget is {st['budget']}, LAYERSWAP_BUDGET=1GiB asked {budget}")

    # 1. One request bigger than the budget.
    err = None
    try:
        torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        c.check(False, "a 2 GiB allocation over a 1 GiB budget succeeded")
    except torch.OutOfMemoryError as e:
        err = e
    except Exception as e:  # the wrong type: report it
        c.check(False, f"a 2 GiB allocation over a 1 GiB budget raised {type(e).__name__}, not "
                       f"torch.OutOfMemoryError: {e}")
    if err is not None:
        msg = str(err)
        print(f"  OOM message: {msg[:600]}", flush=True)
        c.check(isinstance(err, RuntimeError), "torch.OutOfMemoryError is not a RuntimeError")
        c.check("LAYERSWAP_BUDGET" in msg, "the OOM message does not name LAYERSWAP_BUDGET")
        c.check("1.00 GiB" in msg, "the OOM message does not state the budget as '1.00 GiB'")
    # Catchable as a plain RuntimeError too.
    try:
        torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        c.check(False, "the second 2 GiB allocation did not fail")
    except RuntimeError as e:
        c.check(isinstance(e, torch.OutOfMemoryError), f"caught {type(e).__name__}, not torch.OutOfMemoryError")

    # 2. The process keeps working.
    x = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda").fill_(3)
    c.check(int(x.sum().item()) == 3 * 100 * MiB, "a 100 MiB tensor after the OOM computes a wrong sum")
    ms = torch.cuda.memory_stats()
    c.note("num_ooms", ms.get("num_ooms"))
    c.check(ms.get("num_ooms", 0) >= 1, f"memory_stats()['num_ooms'] is {ms.get('num_ooms')} after an OOM")
    c.check(ls.stats()[dev]["num_ooms"] >= 1, "layerswap.stats() num_ooms is 0 after an OOM")
    del x

    # 3. 600 MiB tensors past the budget. With swapping on (the tracker feeds the residency engine), earlier
    #    ones move to host memory and all 8 are allocated, each keeping its contents; without it
    #    (LAYERSWAP_TRACK=0) the second one is an OutOfMemoryError. Never above the budget either way.
    swapping = bool(ls.stats()[dev].get("residency", {}).get("active"))
    c.note("swapping", swapping)
    held, stopped = [], None
    for i in range(8):
        try:
            held.append(torch.empty(600 * MiB, dtype=torch.uint8, device="cuda").fill_(10 + i))
        except torch.OutOfMemoryError as e:
            stopped = e
            break
    c.note("tensors_of_600MiB_allocated", len(held))
    if swapping:
        c.check(stopped is None, f"with swapping on, only {len(held)} tensors of 600 MiB were allocated under a "
                                 f"1 GiB budget: {stopped}")
        for i in range(len(held)):
            c.check(int(held[i][::4096].sum().item()) == (10 + i) * (600 * MiB // 4096),
                    f"600 MiB tensor {i} lost its contents while swapped")
        res = ls.stats()[dev]["residency"]
        c.note("evictions", res.get("evictions"))
        c.check(res.get("evictions", 0) > 0, "no eviction happened although 8 x 600 MiB exceed the 1 GiB budget")
    else:
        c.check(stopped is not None, f"{len(held)} tensors of 600 MiB fit under a 1 GiB budget without swapping")
        c.check(len(held) == 1, f"{len(held)} tensors of 600 MiB were allocated under a 1 GiB budget (expected 1)")
        if stopped is not None:
            c.check("LAYERSWAP_BUDGET" in str(stopped), "the loop's OOM message does not name LAYERSWAP_BUDGET")
    s = ls.stats()[dev]
    c.note("device_bytes_peak", s["device_bytes"]["peak"])
    c.check(s["device_bytes"]["peak"] <= budget,
            f"layerswap held {fmt(s['device_bytes']['peak'])} of device memory at its peak, over the 1 GiB budget")
    c.check(torch.cuda.max_memory_reserved() <= budget,
            f"max_memory_reserved() {fmt(torch.cuda.max_memory_reserved())} is over the 1 GiB budget")
    # Freed memory is usable again.
    held.clear()
    y = torch.empty(600 * MiB, dtype=torch.uint8, device="cuda").fill_(2)
    c.check(int(y[::4096].sum().item()) == 2 * (600 * MiB // 4096), "a 600 MiB tensor after the frees reads wrong")


# ---------------------------------------------------------------------------------------------------------
# record_stream: a block used by a side stream is not reused while that stream still needs it
# ---------------------------------------------------------------------------------------------------------

SLEEP_CYCLES = 1_000_000_000  # ~0.5 s at H100 clocks


def spin(torch):
    """A long kernel on the current stream: torch.cuda._sleep, or a matmul loop if that is missing."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(SLEEP_CYCLES)
    else:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(200):
            a = (a @ a).clamp_(-1, 1)


def check_record_stream(args, c):
    torch, ls = start(args.allocator, c)
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    # A first, unchecked pass loads every kernel the check uses: with CUDA's lazy module loading the first launch
    # of a kernel can wait for the device, which would let the side stream finish before the reallocation.
    for n, checked in ((16 * KiB, False), (16 * KiB, True), (1536 * KiB, True), (16 * MiB, True)):
        # floats: 64 KiB (slab), 6 MiB and 64 MiB (own region)
        src = torch.arange(n, device="cuda", dtype=torch.float32).remainder_(1000)
        x = torch.full((n,), 3.0, device="cuda")  # allocated on the main stream
        old_ptr = x.data_ptr()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            spin(torch)
            y = x * 2 + 1            # the side stream reads x late: 7
            x.copy_(src)             # ... produces x's contents on the side stream
            w = x.clone()            # ... and reads them back: src
        x.record_stream(side)
        del x                        # freed on the main stream while the side stream still sleeps
        z = torch.empty(n, device="cuda")  # the same size on the main stream
        z.fill_(-1.0)
        z2 = torch.empty(n, device="cuda").fill_(-2.0)
        side_busy = not side.query()
        reused = old_ptr in (z.data_ptr(), z2.data_ptr())
        torch.cuda.synchronize()
        if not checked:
            del y, w, z, z2, src
            continue
        label = f"{n * 4 // KiB} KiB"
        c.note(f"{label}: side stream busy when reallocating", side_busy)
        c.note(f"{label}: freed block handed out again", reused)
        c.check(side_busy, f"{label}: the side stream had finished before the reallocation: the allocation on the "
                           "main stream waited for it, or the sleep kernel is too short")
        c.check(not (reused and side_busy), f"{label}: the block freed while a recorded stream still used it was "
                                            "handed to a main-stream allocation")
        c.check(bool((y == 7).all().item()), f"{label}: the side stream read a corrupted x (expected 7 everywhere)")
        c.check(bool(torch.equal(w, src)), f"{label}: the side stream's copy of x was overwritten")
        c.check(bool((z == -1).all().item()) and bool((z2 == -2).all().item()),
                f"{label}: a new main-stream tensor was overwritten by the side stream's writes to the freed x")
        del y, w, z, z2, src


# ---------------------------------------------------------------------------------------------------------
# stream_reuse: random allocations and frees on two streams with compute in between, checked exactly
# ---------------------------------------------------------------------------------------------------------

def check_stream_reuse(args, c):
    torch, ls = start(args.allocator, c)
    rng = random.Random(args.seed)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    busy = []  # one matrix per stream, made and used only there: compute that keeps the streams running
    for s in streams:
        with torch.cuda.stream(s):
            busy.append(torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16))
    live = []        # [tensor, expected value (an integer held exactly in float32), stream it was made on]
    mismatches = []  # device scalars: elements that differed from their expected value
    checked = 0

    def use_on(entry, s):
        """Makes `s` safe to use entry's tensor: wait for its stream, and tell the allocator (record_stream)."""
        t, _, made_on = entry
        if s != made_on:
            s.wait_stream(made_on)
            t.record_stream(s)

    def verify(entry, s):
        nonlocal checked
        use_on(entry, s)
        with torch.cuda.stream(s):
            mismatches.append((entry[0] != entry[1]).sum())
        checked += 1

    for it in range(args.iters):
        k_s = rng.randrange(2)
        s = streams[k_s]
        r = rng.random()
        if len(live) >= 400:
            r = 1.0  # cap the live set: free one
        with torch.cuda.stream(s):
            if r < 0.35 or not live:
                n = int(2 ** rng.uniform(0, 23))  # 1 .. 8M floats: slabs and regions of every size
                v = rng.randint(-1000, 1000)
                live.append([torch.full((n,), float(v), device="cuda"), v, s])
            elif r < 0.50:
                src = live[rng.randrange(len(live))]
                use_on(src, s)
                v = (src[1] * 3 + 7) % 1009
                live.append([torch.remainder(src[0] * 3 + 7, 1009), v, s])
            elif r < 0.60:
                # Matmul-based op: y = x @ ones(k, k) / k keeps the value; keeps cuBLAS busy on both streams.
                src = live[rng.randrange(len(live))]
                n = src[0].numel()
                k = 8
                if n >= k:
                    use_on(src, s)
                    m = n // k
                    y = (src[0][: m * k].view(m, k) @ torch.ones(k, k, device="cuda")).div_(k)
                    live.append([y.reshape(-1).contiguous(), src[1], s])
            else:
                victim = live.pop(rng.randrange(len(live)))
                verify(victim, s)
                del victim
            if it % 25 == 0:
                busy[k_s] = (busy[k_s] @ busy[k_s]).clamp_(-1, 1)
    for entry in live:
        verify(entry, streams[0])
    torch.cuda.synchronize()
    bad = [i for i, m in enumerate(mismatches) if int(m.item()) != 0]
    c.note("tensors_checked", checked)
    c.note("tensors_wrong", len(bad))
    c.check(not bad, f"{len(bad)} of {checked} tensors held wrong values when checked")
    # A CPU reference of the survivors, element by element.
    for t, v, _ in live[:50]:
        ref = torch.full((t.numel(),), float(v))
        c.check(torch.equal(t.cpu(), ref), f"a surviving tensor of {t.numel()} floats differs from its CPU reference")
    c.note("allocated_at_end", torch.cuda.memory_allocated())


# ---------------------------------------------------------------------------------------------------------
# preload: LD_PRELOAD=liblayerswap_preload.so with PyTorch's caching off: every tensor is a cudaMalloc
# ---------------------------------------------------------------------------------------------------------

def check_preload(args, c):
    import ctypes

    import torch

    lib_path = os.environ.get("LD_PRELOAD", "")
    maps = open("/proc/self/maps").read()
    c.check("liblayerswap_preload" in maps, f"liblayerswap_preload is not loaded in the process (LD_PRELOAD={lib_path})")
    c.check(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1", "PYTORCH_NO_CUDA_MEMORY_CACHING is not 1")
    torch.manual_seed(0)
    a_cpu = torch.randn(256, 512)
    b_cpu = torch.randn(512, 128)
    a, b = a_cpu.cuda(), b_cpu.cuda()
    got = (a @ b).cpu()
    ref = a_cpu.double() @ b_cpu.double()
    err = (got.double() - ref).abs().max().item()
    c.note("max_abs_error", err)
    c.check(err < 1e-2, f"a matmul through interposed cudaMalloc is wrong by {err}")
    for _ in range(20):  # many mallocs and frees (caching is off)
        t = torch.randn(1 << 20, device="cuda")
        c.check(abs(float(t.float().mean().item())) < 0.05, "a random tensor has a wrong mean")
    del t
    torch.cuda.synchronize()
    lib = ctypes.CDLL(lib_path.split(":")[0])
    lib.layerswap_stats_report.restype = ctypes.c_size_t
    buf = ctypes.create_string_buffer(4096)
    lib.layerswap_stats_report(buf, ctypes.c_size_t(len(buf)))
    report = buf.value.decode(errors="replace").strip()
    print(f"  layerswap report: {report}", flush=True)
    c.check("no device memory was allocated through layerswap" not in report and "device" in report,
            "liblayerswap_preload's report shows no allocation: cudaMalloc was not interposed")
    if args.expect_budget_oom:
        # LAYERSWAP_BUDGET (set by the caller) is below this request: only layerswap can refuse it.
        try:
            torch.empty(args.expect_budget_oom * MiB, dtype=torch.uint8, device="cuda")
            c.check(False, f"a {args.expect_budget_oom} MiB cudaMalloc over LAYERSWAP_BUDGET="
                           f"{os.environ.get('LAYERSWAP_BUDGET')} succeeded: the interposer did not apply the budget")
        except RuntimeError as e:
            print(f"  over-budget cudaMalloc failed as expected: {type(e).__name__}: {str(e)[:200]}", flush=True)
            c.check("out of memory" in str(e).lower(), f"the over-budget error is not an out-of-memory error: {e}")
        x = torch.ones(1 << 20, device="cuda")
        c.check(float(x.sum().item()) == float(1 << 20), "the process does not work after the refused cudaMalloc")


# ---------------------------------------------------------------------------------------------------------
# pointer_tables: kernels that reach their tensors through a pack of addresses copied from the host
# (profiler/launch_recorder.hpp, Note [Pointer tables])
# ---------------------------------------------------------------------------------------------------------

def check_pointer_tables(args, c):
    """FSDP2's copy-out (split_with_sizes_copy into the unsharded parameters) and copy-in (_chunk_cat of the
    gradients into the reduce-scatter input), as FSDP2 calls them: their kernels must be recorded with the
    tensors they write and read, which are in the pack of addresses, not in their arguments."""
    torch, ls = start(args.allocator, c)
    import layerswap.tracker as lt

    world, sizes = 2, [3 << 20, 1 << 20, 5 << 19]  # elements per rank: bf16 tensors of 2-6 MiB, regions of their own
    src = torch.arange(world * sum(sizes), device="cuda", dtype=torch.float32).to(torch.bfloat16).view(world, -1)
    outs = [torch.empty(world, n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    grads = [torch.full((world * n,), float(i + 1), device="cuda", dtype=torch.bfloat16) for i, n in enumerate(sizes)]
    rs_input = torch.empty(world * sum(sizes), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    time.sleep(0.05)
    lt.drain()
    torch.split_with_sizes_copy(src, sizes, dim=1, out=outs)
    torch._chunk_cat(grads, dim=0, num_chunks=world, out=rs_input.view(world, -1))
    torch.cuda.synchronize()
    time.sleep(0.05)  # the tracker's consumer hands launches to drain() every millisecond
    launches = lt.drain()
    kernels = [(name, set(regions)) for _, _, name, regions in launches if name not in ("memcpy", "memset")]
    c.note("launches", [(name, sorted(r)) for _, _, name, r in launches])
    stats = lt.stats()
    c.note("pointer_tables", stats.get("pointer_tables"))
    c.note("table_launches", stats.get("table_launches"))
    for label, tensors in (("split_with_sizes_copy", outs), ("chunk_cat", grads)):
        wanted = {lt.region_of(t.data_ptr()) for t in tensors}
        c.check(0 not in wanted, f"{label}: a tensor has no region")
        users = [(name, r) for name, r in kernels if wanted & r]
        c.check(any(wanted <= r for _, r in users),
                f"{label}: no kernel was recorded with all of {sorted(wanted)}; kernels: "
                f"{[(n[:80], sorted(r)) for n, r in kernels]}")
    # The values, against a CPU reference: the copies did what they do.
    ref = src.cpu().split(sizes, dim=1)
    c.check(all(torch.equal(o.cpu(), r) for o, r in zip(outs, ref)), "split_with_sizes_copy wrote wrong values")
    ref = torch.cat([g.cpu().view(world, -1) for g in grads], dim=1).view(-1)
    c.check(torch.equal(rs_input.cpu(), ref), "_chunk_cat wrote wrong values")


CHECKS = {
    "pointer_tables": check_pointer_tables,
    "probe": check_probe,
    "memory_api": check_memory_api,
    "empty_cache": check_empty_cache,
    "oom": check_oom,
    "record_stream": check_record_stream,
    "stream_reuse": check_stream_reuse,
    "preload": check_preload,
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=sorted(CHECKS))
    p.add_argument("--allocator", choices=("native", "layerswap"), default="layerswap")
    p.add_argument("--iters", type=int, default=3000, help="stream_reuse: operations")
    p.add_argument("--seed", type=int, default=1, help="stream_reuse: seed")
    p.add_argument("--expect-budget-oom", type=int, default=0, metavar="MIB",
                   help="preload: a request of this many MiB must be refused (LAYERSWAP_BUDGET is below it)")
    args = p.parse_args(argv)
    c = Checks()
    print(f"== {args.check} ({args.allocator})", flush=True)
    t0 = time.perf_counter()
    try:
        CHECKS[args.check](args, c)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        c.failed.append(f"{args.check} raised: {traceback.format_exc().strip().splitlines()[-1]}")
    c.record["seconds"] = round(time.perf_counter() - t0, 3)
    c.record["failed"] = c.failed
    print("RESULT " + json.dumps(c.record, default=str), flush=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
