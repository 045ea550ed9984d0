"""Diagnostics: what the launch tracker sees in a few training steps of one of bench/swap.py's models.

    python bench/diag_tracker_model.py [--case llama-lora|llama-full|unet] [--steps 3] [--quick]

Enables layerswap (no budget), trains, and prints the tracker's counters: launches, decoded share, undecoded
launches by reason, the kernel families whose launches touched no layerswap region (pointers hidden from the
arguments, or pointing outside layerswap's memory), and the learner's view of the step.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="llama-lora")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dump", metavar="PATH.json.gz", help="write the launches (launch_no, stream, kernel, regions) "
                    "and each region's persistence, to replay through the learner off the GPU")
    args = ap.parse_args()
    import layerswap
    layerswap.enable()
    import torch
    import swap_models as sm
    cfg = sm.RunConfig(case=args.case, quick=args.quick, steps=args.steps, warmup=1)
    built = sm.build_case(cfg)
    layerswap.tracker.drain()
    sm.train(built, cfg)
    torch.cuda.synchronize()
    st = layerswap.tracker.stats()
    out = {k: v for k, v in st.items() if k != "no_region_families"}
    fams = sorted(st.get("no_region_families", {}).items(), key=lambda kv: -kv[1])
    print("TRACKER " + json.dumps(out, default=str))
    print("NO_REGION_FAMILIES " + json.dumps(fams[:40]))
    print("ALLOCATOR " + json.dumps(layerswap.stats(0).get("residency", {})))
    from layerswap import _C
    params = list(built.model.parameters())
    infos = [_C.region_info(p.data_ptr()) for p in params]
    big = [i for p, i in zip(params, infos) if p.numel() * p.element_size() > (1 << 20)]
    print("PARAMS " + json.dumps({"params": len(params), "large": len(big),
                                  "large_persistent": sum(1 for i in big if i["persistent"]),
                                  "large_regions": len({i["region"] for i in big}),
                                  "sample": big[:3]}))
    print("LEARNER " + json.dumps(_C.learner_stats()))
    if args.dump:
        import gzip
        events = layerswap.tracker.drain()
        regions = {r for e in events for r in e[3]}
        # Persistence is known for the parameters' regions (region_info takes an address).
        persistent = {i["region"]: i["persistent"] for i in infos}
        with gzip.open(args.dump, "wt") as f:
            json.dump({"events": [[e[0], e[1], e[2], list(e[3])] for e in events],
                       "param_regions": {str(k): v for k, v in persistent.items()}}, f)
        print(f"DUMP {len(events)} launches, {len(regions)} regions -> {args.dump}")


if __name__ == "__main__":
    main()
