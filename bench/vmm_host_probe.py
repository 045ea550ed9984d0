#!/usr/bin/env python3
"""Can a host-located VMM mapping be made cheaper? An eviction maps the region's host backing at its VA and sets the
GPU's access to it (residency.cpp, Note [Chunks]); a prefetch unmaps it. On the H200 those two calls are the
migration thread's dearest work (bench/results/swap_3b.json: 0.27 s of a 0.31 s step). This times cuMemMap,
cuMemSetAccess and cuMemUnmap per MiB (median of --reps) for device memory and for host memory of each location
type the driver takes (HOST, HOST_NUMA node 0, HOST_NUMA_CURRENT), read-write and read-only, and reports the
machine's transparent-huge-page mode and hugepage pool, so it can be rerun after changing them (as root:
`echo always > /sys/kernel/mm/transparent_hugepage/enabled; echo 8192 > /proc/sys/vm/nr_hugepages`). Prints one
JSON line per row and writes them to --out."""
import ctypes
import json
import os
import statistics
import time

import torch

from vmm_sync_probe import CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_LOCATION_TYPE_DEVICE, \
    CU_MEM_LOCATION_TYPE_HOST, Access, Loc, create_pinned, open_driver, reserve_va, size_probe_args, \
    timed_map_access_unmap

CU_MEM_LOCATION_TYPE_HOST_NUMA = 3
CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 4
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
MIB = 1 << 20


def read_text(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def time_one(cu, dev, loc_type, mib, reps, flags):
    """Create one allocation of `mib` MiB at `loc_type`, map / set access / unmap it `reps` times: us per MiB."""
    size = mib * MIB
    t0 = time.perf_counter()
    handle = create_pinned(cu, dev, loc_type, size)
    create_ms = (time.perf_counter() - t0) * 1e3
    va = reserve_va(cu, size, 2 * MIB)
    acc = Access(Loc(CU_MEM_LOCATION_TYPE_DEVICE, dev), flags)
    try:
        times = [timed_map_access_unmap(cu, va, size, handle, acc) for _ in range(reps)]
    finally:
        cu.cuMemAddressFree(va, ctypes.c_size_t(size))
        cu.cuMemRelease(handle)

    def per_mib(i):
        return round(statistics.median(t[i] for t in times) * 1e3 / mib, 2)

    return {"create_ms": round(create_ms, 2), "map_us_per_mib": per_mib(0), "access_us_per_mib": per_mib(1),
            "unmap_us_per_mib": per_mib(2)}


def main():
    a = size_probe_args("32,128", 7, "vmm_host_probe.json", "allocation sizes in MiB, comma-separated (default 32,128)",
                        lambda ap: ap.add_argument("--start-at", type=float, metavar="EPOCH_S",
                                                   help="wait until this wall-clock time (time.time()) before the first "
                                                        "row, so that several processes time their rows together"))
    cu, dev = open_driver()
    rw, ro = CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ACCESS_FLAGS_PROT_READ
    kinds = [("device", CU_MEM_LOCATION_TYPE_DEVICE, rw), ("host", CU_MEM_LOCATION_TYPE_HOST, rw),
             ("host_numa0", CU_MEM_LOCATION_TYPE_HOST_NUMA, rw),
             ("host_numa_current", CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT, rw),
             ("host read-only", CU_MEM_LOCATION_TYPE_HOST, ro)]
    out = {"device": torch.cuda.get_device_name(dev),
           "thp": read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
           "hugepages": [line.strip() for line in (read_text("/proc/meminfo") or "").splitlines() if "Huge" in line],
           "rows": []}
    print("THP:", out["thp"], "|", "; ".join(out["hugepages"][:4]), flush=True)
    if a.start_at is not None:
        late = time.time() - a.start_at
        if late > 0:
            print(f"--start-at passed {late:.1f} s before the driver was ready: the rows start now", flush=True)
        time.sleep(max(0.0, -late))
    for name, loc_type, flags in kinds:
        for mib in (int(x) for x in a.mib.split(",")):
            row = {"memory": name, "mib": mib, "start_s": round(time.time(), 3)}
            try:
                row.update(time_one(cu, dev, loc_type, mib, a.reps, flags))
            except RuntimeError as e:  # a location type this driver or machine refuses
                row["error"] = str(e)
            row["end_s"] = round(time.time(), 3)  # wall-clock times, to see which rows of two processes overlapped
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", os.path.abspath(a.out))


if __name__ == "__main__":
    main()
