#!/usr/bin/env python3
"""How much do processes of the same side differ, and what do the sides' ratios become pooled over several? The
1.1B LoRA case: K processes each of the resident run, layerswap at the 25% budget and accelerate's cpu_offload
(without the cap, under which it runs out of memory), all taking turns in one interleaved run (swap.py's --interleave
machinery: BLOCK steps each, CYCLES cycles of rotating order). Prints each process's median step, the paired ratio
of every pair of processes (per cycle, one block median over the other's, then the median over cycles), and the
pooled ratios (per cycle, the median over a side's processes of their block medians). swap.py's record runs one
process per side; this says how far one process of a side can sit from another.

    K=3 CYCLES=8 BLOCK=3 OUTFILE=spread.json python3 bench/process_spread.py

Environment: K (3), CYCLES (8), BLOCK (3), B25 (the 25% budget in bytes; default the record's, 3456106496),
SIDES (resident,layerswap,accelerate_cpu_offload), OUTFILE (/tmp/process_spread.json). Arguments go to swap.py's
parser (--pin-threads is always on). Needs layerswap installed and a GPU."""
import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import swap  # noqa: E402

K = int(os.environ.get("K", "3"))
CYCLES = int(os.environ.get("CYCLES", "8"))
BLOCK = int(os.environ.get("BLOCK", "3"))
B25 = int(os.environ.get("B25", "3456106496"))
PLAN = {"capacity_bytes": 568046592, "movable_bytes": 2272186368}  # the record's (the block swapper reads them)
SIDES = [s for s in os.environ.get("SIDES", "resident,layerswap,accelerate_cpu_offload").split(",") if s]


def members(args):
    cfg = {"case": "llama-lora", "device": "cuda", "quick": False, "steps": args.warmup + CYCLES * BLOCK,
           "warmup": args.warmup, "batch": args.batch, "seq": args.seq, "seed": args.seed, "unet_batch": 0,
           "unet_resolution": 0, "llama": "1b", "pin_threads": True, "pin_cores": ""}
    out = []
    for i in range(K):
        for side in SIDES:
            m = {"key": f"{side}#{i}", "side": side, "run_cfg": cfg, "tag": f"{side}#{i}"}
            if side == "layerswap":
                m["env"] = swap.worker_env(B25, {})
                m["extra"] = {"budget_bytes": B25}
            elif side != "resident":
                m["extra"] = {"cap_bytes": B25, "peer_plan": PLAN, "enforce_cap": False}
            out.append(m)
    return out


def pooled(blocks, side):
    """Per cycle, the median over the side's processes of their block medians."""
    return swap.pooled_blocks([blocks[f"{side}#{i}"] for i in range(K) if blocks.get(f"{side}#{i}")])


def pairs(blocks, side, ref, out):
    for i in range(K):
        for j in range(K):
            a, b = blocks.get(f"{side}#{i}"), blocks.get(f"{ref}#{j}")
            if a and b:
                out[f"{side}#{i}/{ref}#{j}"] = swap.paired_ratios(a, b)["median_ratio"]


def main():
    args = swap.parse_args(["--pin-threads"] + sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        got = swap.Runner(args, tmp).interleave(members(args), CYCLES, BLOCK)
    blocks = {k: swap.block_medians(r) for k, r in got.items() if k != "order"}
    reference = got.get("resident#0")
    out = {"K": K, "cycles": CYCLES, "block": BLOCK, "order": got.get("order"), "processes": {}, "pairs": {}}
    for k, r in got.items():
        if k == "order":
            continue
        tr = r.get("train") or {}
        equal, first = swap.compare_losses(reference, r)
        out["processes"][k] = {"error": r.get("error"), "median_step_s": tr.get("median_step_s"),
                               "blocks": blocks[k], "losses_bitwise_equal": equal, "first_differing_step": first,
                               "threads_per_step": tr.get("threads_per_step")}
        print(f"{k:28s} median {tr.get('median_step_s')}  losses equal to resident#0: {equal}  "
              f"error {r.get('error')}", flush=True)
    pool = {s: pooled(blocks, s) for s in SIDES}
    out["pooled_blocks"] = pool
    for s in SIDES:
        if s != "resident" and pool[s] and pool.get("resident"):
            pr = swap.paired_ratios(pool[s], pool["resident"])
            out[f"pooled_{s}_vs_resident"] = pr
            print(f"pooled {s} / resident: median {pr['median_ratio']:.3f}, quartiles {pr.get('quartiles')}")
            pairs(blocks, s, "resident", out["pairs"])
    if pool.get("layerswap") and pool.get("accelerate_cpu_offload"):
        pr = swap.paired_ratios(pool["accelerate_cpu_offload"], pool["layerswap"])
        out["pooled_accelerate_over_layerswap"] = pr
        print(f"pooled accelerate_cpu_offload / layerswap: median {pr['median_ratio']:.3f}, "
              f"quartiles {pr.get('quartiles')}")
        pairs(blocks, "accelerate_cpu_offload", "layerswap", out["pairs"])
    for k, v in sorted(out["pairs"].items()):
        print(f"   {k}: {v:.3f}")
    with open(os.environ.get("OUTFILE", "/tmp/process_spread.json"), "w") as fh:
        json.dump(out, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
