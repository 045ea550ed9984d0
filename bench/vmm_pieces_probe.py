#!/usr/bin/env python3
"""What would a region backed by several chunks cost (docs/swapping.md, next step 3)? A prefetch that takes idle
segments' chunks of other sizes, instead of releasing them and making one of its own, maps them side by side at the
region's VA. This times, on an idle GPU, a region of --region MiB brought in from its host copy and sent back, for
each layout in --layouts (MiB per piece, '+'-separated; the pieces may overhang the region, into VA reserved
beyond it):

  in:    unmap the host copy's mapping, map each piece at its offset, grant access (one call over all the pieces, and
         again with one per piece);
  out:   unmap the pieces (one call over all of them, and again one per piece), map the host copy, grant access;
  make:  what a single chunk costs when none of its size is spare: cuMemCreate + cuMemRelease of one region-sized
         device allocation (the one-piece layout's alternative).

It also checks that a call spanning several mappings is accepted and that the pieces hold what is written through
the region's VA (a torch copy in and out). Medians of --reps, in ms; prints a table and writes JSON to --out.

    python3 bench/vmm_pieces_probe.py --region 22 --layouts 22,12+12,8+8+8,12+6+4 --out pieces.json"""
import argparse
import ctypes
import json
import statistics
import time

import torch

from vmm_sync_probe import CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_LOCATION_TYPE_DEVICE, \
    CU_MEM_LOCATION_TYPE_HOST, Access, CudaArray, Loc, ck, create_pinned, open_driver, reserve_va

MIB = 1 << 20
GRAN = 2 * MIB


def parse_layouts(text, region_mib):
    """'22,12+12' -> [[22], [12, 12]]; each piece a positive multiple of 2 MiB, the pieces covering the region."""
    layouts = []
    for item in text.split(","):
        pieces = [int(p) for p in item.split("+")]
        if any(p <= 0 or p % 2 for p in pieces):
            raise ValueError(f"--layouts: {item!r}: pieces are positive multiples of 2 MiB")
        if sum(pieces) < region_mib:
            raise ValueError(f"--layouts: {item!r} covers {sum(pieces)} MiB, less than the region's {region_mib}")
        layouts.append(pieces)
    return layouts


def timed(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def probe_layout(cu, dev, va, region, host, pieces, reps, per_piece):
    """Times `reps` round trips of the region at `va` between its host copy and `pieces` (handles, bytes)."""
    dacc = Access(Loc(CU_MEM_LOCATION_TYPE_DEVICE, dev), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    span = sum(b for _, b in pieces)

    def map_host():
        ck(cu.cuMemMap(va, ctypes.c_size_t(region), ctypes.c_size_t(0), host, ctypes.c_ulonglong(0)), "map host")
        ck(cu.cuMemSetAccess(va, ctypes.c_size_t(region), ctypes.byref(dacc), ctypes.c_size_t(1)), "access host")

    def unmap_host():
        ck(cu.cuMemUnmap(va, ctypes.c_size_t(region)), "unmap host")

    def map_pieces():
        off = 0
        for h, b in pieces:
            ck(cu.cuMemMap(ctypes.c_ulonglong(va.value + off), ctypes.c_size_t(b), ctypes.c_size_t(0), h,
                           ctypes.c_ulonglong(0)), "map piece")
            if per_piece:
                ck(cu.cuMemSetAccess(ctypes.c_ulonglong(va.value + off), ctypes.c_size_t(b), ctypes.byref(dacc),
                                     ctypes.c_size_t(1)), "access piece")
            off += b
        if not per_piece:
            ck(cu.cuMemSetAccess(va, ctypes.c_size_t(span), ctypes.byref(dacc), ctypes.c_size_t(1)), "access span")

    def unmap_pieces():
        if per_piece:
            off = 0
            for _, b in pieces:
                ck(cu.cuMemUnmap(ctypes.c_ulonglong(va.value + off), ctypes.c_size_t(b)), "unmap piece")
                off += b
        else:
            ck(cu.cuMemUnmap(va, ctypes.c_size_t(span)), "unmap span")

    rows = {"in": [], "out": []}
    map_host()
    try:
        for i in range(reps):
            rows["in"].append(timed(lambda: (unmap_host(), map_pieces())))
            if i == 0:  # what is written through the VA lands in the pieces and comes back
                check_reads_back(va, region, pieces)
            rows["out"].append(timed(lambda: (unmap_pieces(), map_host())))
    except RuntimeError as err:  # a call the driver refused: recorded, and the VA cleared for the next layout
        offsets = [sum(b for _, b in pieces[:i]) for i in range(len(pieces))]
        for off, b in [(0, region)] + list(zip(offsets, (b for _, b in pieces))):  # the host mapping, or the pieces'
            try:
                ck(cu.cuMemUnmap(ctypes.c_ulonglong(va.value + off), ctypes.c_size_t(b)), "unmap")
            except RuntimeError:
                pass
        return {"error": str(err)}
    unmap_host()
    return {k: statistics.median(v) for k, v in rows.items()}


def check_reads_back(va, region, pieces):
    """A torch copy into the region's VA and a comparison: the pieces hold what was written."""
    expected = torch.arange(region, device="cuda", dtype=torch.int64).remainder(251).to(torch.uint8)
    t = torch.as_tensor(CudaArray(va.value, (region,), "|u1"), device="cuda")
    t.copy_(expected)
    torch.cuda.synchronize()
    ok = bool(torch.equal(t, expected))
    del t
    if not ok:
        raise RuntimeError(f"pieces {[b // MIB for _, b in pieces]}: the region does not read back")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--region", type=int, default=22, help="the region's size in MiB (a multiple of 2)")
    ap.add_argument("--layouts", default="22,12+12,8+8+8,12+6+4", help="pieces in MiB, e.g. 22,12+12")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--per-piece", action="store_true",
                    help="only one access and one unmap call per piece (by default also one over all the pieces)")
    ap.add_argument("--out", default="vmm_pieces_probe.json")
    a = ap.parse_args()
    if a.region <= 0 or a.region % 2:
        raise SystemExit(f"--region {a.region}: a positive multiple of 2 MiB")
    layouts = parse_layouts(a.layouts, a.region)
    cu, dev = open_driver()
    region = a.region * MIB
    longest = max(sum(p) for p in layouts) * MIB
    va = reserve_va(cu, longest, GRAN)
    host = create_pinned(cu, dev, CU_MEM_LOCATION_TYPE_HOST, region)
    make = []
    for _ in range(a.reps):
        h = None

        def create():
            nonlocal h
            h = create_pinned(cu, dev, CU_MEM_LOCATION_TYPE_DEVICE, region)

        ms = timed(create)
        ms += timed(lambda: ck(cu.cuMemRelease(h), "release"))
        make.append(ms)
    out = {"region_mib": a.region, "reps": a.reps, "device": torch.cuda.get_device_name(),
           "make_ms": statistics.median(make), "layouts": []}
    print(f"region {a.region} MiB; medians of {a.reps}, ms")
    print(f"  make (create + release one {a.region} MiB chunk): {out['make_ms']:.3f}")
    print(f"  {'pieces':16s} {'calls':10s} {'in':>8s} {'out':>8s}")
    for pieces_mib in layouts:
        for per_piece in ([True] if a.per_piece else [False, True]):
            handles = [(create_pinned(cu, dev, CU_MEM_LOCATION_TYPE_DEVICE, p * MIB), p * MIB) for p in pieces_mib]
            try:
                row = probe_layout(cu, dev, va, region, host, handles, a.reps, per_piece)
            finally:
                for h, _ in handles:
                    ck(cu.cuMemRelease(h), "release piece")
            row.update(pieces_mib=pieces_mib, per_piece=per_piece)
            out["layouts"].append(row)
            calls = "per piece" if per_piece else "spanning"
            if "error" in row:
                print(f"  {'+'.join(map(str, pieces_mib)):16s} {calls:10s} refused: {row['error']}")
            else:
                print(f"  {'+'.join(map(str, pieces_mib)):16s} {calls:10s} {row['in']:8.3f} {row['out']:8.3f}")
    ck(cu.cuMemRelease(host), "release host")
    ck(cu.cuMemAddressFree(va, ctypes.c_size_t(longest)), "free va")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
