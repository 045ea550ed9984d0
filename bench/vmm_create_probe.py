#!/usr/bin/env python3
"""What a chunk's life costs on the launching thread: cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and
cuMemRelease of one device allocation, by size (median of --reps), on an idle GPU. A large segment the allocator
makes under a tight budget pays create + map + access, and its destruction unmap (+ release when its chunk does not
fit the next request): residency.cpp, Note [Chunks]. Prints a table and writes JSON to --out."""
import ctypes
import json
import time

import torch

from vmm_sync_probe import CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ALLOCATION_TYPE_PINNED, \
    CU_MEM_LOCATION_TYPE_DEVICE, Access, Loc, Prop, ck, open_driver, reserve_va, size_probe_args, \
    timed_map_access_unmap


def main():
    a = size_probe_args("2,8,22,32,128", 15, "vmm_create_probe.json", "chunk sizes in MiB, comma-separated")
    cu, dev = open_driver()
    gran = 2 << 20
    sizes = [int(x) << 20 for x in a.mib.split(",")]
    va = reserve_va(cu, max(sizes), gran)
    acc = Access(Loc(CU_MEM_LOCATION_TYPE_DEVICE, dev), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    prop = Prop()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = Loc(CU_MEM_LOCATION_TYPE_DEVICE, dev)
    out = []
    for size in sizes:
        rows = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
        for _ in range(a.reps):
            h = ctypes.c_ulonglong()
            t0 = time.perf_counter()
            ck(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)),
               "create")
            t1 = time.perf_counter()
            map_ms, access_ms, unmap_ms = timed_map_access_unmap(cu, va, size, h, acc)
            t2 = time.perf_counter()
            ck(cu.cuMemRelease(h), "release")
            t3 = time.perf_counter()
            for k, ms in zip(rows, ((t1 - t0) * 1e3, map_ms, access_ms, unmap_ms, (t3 - t2) * 1e3)):
                rows[k].append(ms)
        med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
        out.append({"mib": size >> 20, "median_ms": med})
        print(f"{size >> 20:4d} MiB: " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()) + " ms")
    with open(a.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "chunks": out}, fh, indent=1)


if __name__ == "__main__":
    main()
