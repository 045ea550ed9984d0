#!/usr/bin/env python3
"""Data-parallel training under layerswap: DistributedDataParallel over NCCL, one process per GPU.

Each case trains the same model twice through torchrun, without layerswap (resident) and with a LAYERSWAP_BUDGET
that keeps a fraction of the movable bytes on each GPU, and checks that every rank's losses and final parameters
are bitwise equal. DDP's gradient buckets are long-lived allocations that NCCL's kernels read and write on a stream
of their own, through pointers the launch tracker may not see in the kernels' arguments: this is the check that
swapping stays correct beside them. The layerswap side also reports what the tracker saw of NCCL's launches: one
all-reduce of a fresh tensor after training, and whether its kernel's decoded arguments held that tensor's region.

    python3 bench/ddp_check.py [--gpus 2] [--cases llama-full:0.25,llama-lora:0.25] [--steps 12] [--out F.json]

A case is model:fraction[:wrap]. The wrap is how the model is made data-parallel: `ddp` (the default),
DistributedDataParallel as most scripts call it; `ddp-views`, the same with gradient_as_bucket_view=True (the
gradients are views into DDP's buckets instead of a second copy of them); `fsdp`, FSDP2's fully_shard on each
decoder layer and on the model (each rank holds its shard of the parameters, gradients and optimizer state, and
all-gathers a layer's parameters around its use); `solo`, no data parallelism: each process trains its own model on
its own GPU, independently (the process group is made for the probe and the final barrier only). `solo` measures
what the processes of one host cost each other, apart from DDP's communication: the same case with --gpus 1 is one
GPU alone.

Needs 2+ GPUs (`solo` 1+); with fewer it says so and exits with status 0 (nothing checked). Exit status 1 when a
case's results differ, or when the NCCL probe's coalesced all-reduce went to NCCL's FIFO and the tracker recorded it
as a known launch (profiler/launch_recorder.hpp, Note [Work elsewhere]).
"""
import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
MIB = 1 << 20


WRAPS = ("ddp", "ddp-views", "fsdp", "solo")


def parse_cases(text):
    """"model:F[:wrap],..." -> [(model, F, wrap)]; the wrap is one of WRAPS, `ddp` when left out."""
    cases = []
    for item in text.split(","):
        name, fraction, wrap = (item.strip().split(":") + ["", ""])[:3]
        if name not in ("llama-full", "llama-lora") or not fraction or item.count(":") > 2:
            raise SystemExit(f"--cases: {item!r} is not llama-full:F[:WRAP] or llama-lora:F[:WRAP] (F a fraction "
                             f"such as 0.25, WRAP one of {', '.join(WRAPS)})")
        try:
            f = float(fraction)
        except ValueError:
            raise SystemExit(f"--cases: the fraction of {item!r} is not a number") from None
        if not 0 < f <= 1:
            raise SystemExit(f"--cases: the fraction of {item!r} must be in (0, 1]")
        wrap = wrap or "ddp"
        if wrap not in WRAPS:
            raise SystemExit(f"--cases: the wrap of {item!r} is not one of {', '.join(WRAPS)}")
        cases.append((name, f, wrap))
    return cases


# ---------------------------------------------------------------------------------------------------------
# A rank (run by torchrun)
# ---------------------------------------------------------------------------------------------------------

def param_digest(model):
    """sha256 of every parameter's bytes, in the model's order (the final weights, bit for bit; under FSDP the
    rank's shards)."""
    import torch
    h = hashlib.sha256()
    for p in model.parameters():
        p = p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard
        h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def tracked_nccl_launches(device, collective):
    """Runs `collective()` and returns what the tracker recorded of its NCCL kernel launches, [(kernel, [region
    ids])], and how many launches it counted as undecoded for `work_elsewhere` meanwhile (None if it counts none)."""
    import torch
    import layerswap.tracker as lt
    unknown = lambda: dict(lt.stats().get("undecoded_by_reason", {})).get("work_elsewhere")  # noqa: E731
    torch.cuda.synchronize(device)
    lt.drain()  # the launches before (the learner has read them)
    before = unknown()
    collective()
    torch.cuda.synchronize(device)
    time.sleep(0.05)  # the tracker's consumer moves launches to drain()'s buffer every millisecond
    after = unknown()
    launches = [(kernel, regions) for _, _, kernel, regions in lt.drain() if "nccl" in kernel.lower()]
    return launches, None if before is None or after is None else after - before


def nccl_probe(device):
    """One all-reduce of a fresh 64 MiB tensor, and what the tracker recorded of its kernel launches; then the
    coalesced probe."""
    import torch
    import torch.distributed as dist
    import layerswap.tracker as lt
    x = torch.ones(16 * MIB, device=device)  # its own region (a large allocation)
    region = lt.region_of(x.data_ptr())
    launches, _ = tracked_nccl_launches(device, lambda: dist.all_reduce(x))
    return {"region": region, "value_ok": bool((x == dist.get_world_size()).all().item()),
            "nccl_launches": len(launches), "kernels": sorted({k for k, _ in launches}),
            "with_the_region": sum(1 for _, r in launches if region in r),
            "regions_seen": sorted({r for _, rs in launches for r in rs})[:16],
            "coalesced": coalesced_probe(device)}


def coalesced_probe(device, tensors=128):
    """All-reduces of `tensors` fresh 2 MiB tensors in one NCCL group (a coalesced all-reduce), whose work is too
    large for the kernel's arguments: NCCL puts it in its FIFO. Note [Work elsewhere] (profiler/launch_recorder.hpp):
    every NCCL launch that names none of the tensors' regions must be an unknown launch (undecoded_by_reason's
    work_elsewhere). `safe` says so; `fifo` whether any launch named none (NCCL took the FIFO)."""
    import torch
    import torch.distributed as dist
    import layerswap.tracker as lt
    from torch.distributed.distributed_c10d import _coalescing_manager
    ys = [torch.full((MIB // 2,), float(i), device=device) for i in range(tensors)]
    regions = {lt.region_of(y.data_ptr()) for y in ys}

    def group():
        with _coalescing_manager(device=device):
            for y in ys:
                dist.all_reduce(y)

    tracked, unknown = tracked_nccl_launches(device, group)
    launches = [set(rs) & regions for _, rs in tracked]
    unnamed = sum(1 for rs in launches if not rs)
    n = dist.get_world_size()
    return {"tensors": tensors, "regions": len(regions), "nccl_launches": len(launches),
            "launches_naming_none": unnamed,
            "regions_named": len(set().union(*launches)) if launches else 0, "work_elsewhere_launches": unknown,
            "fifo": unnamed > 0, "safe": unnamed == 0 or unknown == unnamed,
            "value_ok": all(bool((y == float(i) * n).all().item()) for i, y in enumerate(ys))}


def worker(args):
    import torch
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    out = {"rank": rank, "side": args.side, "case": args.case, "wrap": args.wrap}
    sys.path.insert(0, str(HERE))
    import swap_models as sm
    ls = sm.layerswap_side(args.side, out)
    from swap import layerswap_traffic, ls_snapshot

    cfg = sm.RunConfig(case=args.case, steps=args.steps, warmup=min(3, args.steps), seq=args.seq, quick=args.quick)
    sm.make_deterministic(cfg.seed)
    dist.init_process_group("nccl", device_id=device)
    built = sm.build_case(cfg)  # the same seed on every rank: the same weights (DDP broadcasts rank 0's too)
    size = cfg.llama_size()
    batches = sm.sample.make_batches(size.vocab, cfg.batch, cfg.seq, cfg.steps, cfg.seed + 1000 * (rank + 1))
    if args.wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in built.blocks:
            fully_shard(block)
        model = fully_shard(built.model)
        # The optimizer over the sharded parameters (DTensors), as swap_models.build_case builds it.
        built.optimizer, _ = sm.llama_optimizer(built.model, cfg, args.case == "llama-lora")
    elif args.wrap == "solo":
        model = built.model
    else:
        model = torch.nn.parallel.DistributedDataParallel(built.model, device_ids=[local],
                                                          gradient_as_bucket_view=args.wrap == "ddp-views")
    meter = sm.TransientMeter(built.model, built.optimizer, device) if args.side == "resident" else None
    losses, times = [], []
    before = None
    for step, batch in enumerate(batches):
        if step == cfg.warmup and ls is not None:
            before = ls_snapshot(ls, local)
        if meter is not None and step == cfg.warmup:
            meter.remove()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        if meter is not None and step < cfg.warmup:
            meter.begin_step()
        with sm.attention_backends():
            loss = built.loss(model, batch, device)
        loss.backward()
        built.optimizer.step()
        built.optimizer.zero_grad(set_to_none=True)
        if meter is not None and step < cfg.warmup:
            meter.end_step()
        losses.append(float(loss.item()).hex())
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        if step == 0:
            out["cublas_config"] = sm.drop_cublas_config(device)
    out["losses_hex"] = losses
    out["step_times_s"] = times
    out["params_sha256"] = param_digest(built.model)
    # The movable bytes as bench/swap.py counts them (the same budget rule): parameters, gradients, optimizer state.
    out["movable_bytes"] = sum(g["frozen_bytes"] + g["trainable_bytes"] + g["grad_bytes"] + g["state_bytes"]
                               for g in sm.group_accounting(built))
    if meter is not None:
        out["transient_bytes"] = meter.peak_transient
        out["peak_allocated_bytes"] = meter.peak_allocated
    if ls is not None:
        after = ls_snapshot(ls, local)
        # Per timed step, as bench/swap.py reports them (bytes each way, hit rate, waits, allocator and VMM time).
        traffic = layerswap_traffic(before, after, max(1, cfg.steps - cfg.warmup))
        traffic.pop("sources", None)
        out["layerswap"] = traffic
        out["layerswap_peak_reserved_bytes"] = after["reserved_bytes"]["peak"]
        out["layerswap_budget"] = after.get("budget")
        import layerswap.tracker as lt
        ts = lt.stats()
        out["tracker"] = {"launches": ts.get("launches"), "pointer_tables": ts.get("pointer_tables"),
                          "table_launches": ts.get("table_launches"),
                          "undecoded_by_reason": dict(ts.get("undecoded_by_reason", {})),
                          "no_region_families": {k: v for k, v in dict(ts.get("no_region_families", {})).items()
                                                 if "nccl" in k.lower()}}
        out["nccl_probe"] = nccl_probe(device)
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(args.out_dir, f"{args.side}_{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)


# ---------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------

def run_side(args, case, wrap, side, out_dir, budget=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP")}
    if budget is not None:
        env["LAYERSWAP_BUDGET"] = str(budget)
        env["LAYERSWAP_STATS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
           str(pathlib.Path(__file__).resolve()), "--worker", "--side", side, "--case", case, "--wrap", wrap, "--steps",
           str(args.steps), "--seq", str(args.seq), "--out-dir", out_dir] + (["--quick"] if args.quick else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    ranks = []
    for r in range(args.gpus):
        path = os.path.join(out_dir, f"{side}_{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    if proc.returncode != 0 or len(ranks) != args.gpus:
        print(log[-6000:], file=sys.stderr)
        raise RuntimeError(f"{case} ({wrap}) {side}: torchrun exited with {proc.returncode}, {len(ranks)} of {args.gpus} "
                           f"ranks reported")
    stats = [line for line in log.splitlines() if line.startswith("layerswap:")]
    return ranks, took, stats


def check_case(args, case, fraction, wrap, tmp):
    sys.path.insert(0, str(HERE))
    from swap import swap_budget
    res_dir = tempfile.mkdtemp(dir=tmp)
    resident, took_r, _ = run_side(args, case, wrap, "resident", res_dir)
    r0 = resident[0]
    plan = swap_budget(fraction, r0["movable_bytes"], r0["transient_bytes"], 256 * MIB)
    repeat_equal = None
    if args.baseline_twice:  # is NCCL's all-reduce bitwise repeatable here? (else no comparison means anything)
        again, _, _ = run_side(args, case, wrap, "resident", tempfile.mkdtemp(dir=tmp))
        repeat_equal = all(a["losses_hex"] == b["losses_hex"] and a["params_sha256"] == b["params_sha256"]
                           for a, b in zip(resident, again))
    ls_dir = tempfile.mkdtemp(dir=tmp)
    swapped, took_l, stats = run_side(args, case, wrap, "layerswap", ls_dir, plan["budget_bytes"])
    equal = all(a["losses_hex"] == b["losses_hex"] and a["params_sha256"] == b["params_sha256"]
                for a, b in zip(resident, swapped))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    warm = min(3, args.steps)
    out = {"case": case, "wrap": wrap, "budget_fraction": fraction, **plan, "bitwise_equal": equal,
           "resident_repeat_bitwise_equal": repeat_equal,
           "resident_step_s": [med(r["step_times_s"][warm:]) for r in resident],
           "layerswap_step_s": [med(r["step_times_s"][warm:]) for r in swapped],
           "resident_peak_allocated_bytes": r0.get("peak_allocated_bytes"),
           "per_rank": [{"rank": s["rank"], "losses_equal": s["losses_hex"] == r["losses_hex"],
                         "params_equal": s["params_sha256"] == r["params_sha256"],
                         "layerswap_per_step": s.get("layerswap"), "layerswap_peak_reserved_bytes": s.get("layerswap_peak_reserved_bytes"),
                         "tracker": s.get("tracker"), "nccl_probe": s.get("nccl_probe")}
                        for r, s in zip(resident, swapped)],
           "losses_hex": {"resident": [r["losses_hex"] for r in resident],
                          "layerswap": [r["losses_hex"] for r in swapped]}, "run_s": {"resident": took_r, "layerswap": took_l},
           "layerswap_stats_lines": stats[:60]}
    return out


def fifo_unsafe_ranks(case_result):
    """The ranks whose NCCL probe saw a coalesced all-reduce in NCCL's FIFO recorded as a known launch touching none
    of its buffers (Note [Work elsewhere] in profiler/launch_recorder.hpp: it must be an unknown launch)."""
    return [p["rank"] for p in case_result.get("per_rank", [])
            if not ((p.get("nccl_probe") or {}).get("coalesced") or {}).get("safe", True)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--cases", default="llama-full:0.25,llama-lora:0.25")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="a tiny Llama (a smoke test of the script)")
    ap.add_argument("--baseline-twice", action="store_true",
                    help="run the resident side twice too: is the run without layerswap bitwise repeatable?")
    ap.add_argument("--out", help="write the results here (JSON)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=("resident", "layerswap"), help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--wrap", choices=WRAPS, default="ddp", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.gpus < 1:
        raise SystemExit(f"--gpus: {args.gpus} is not a GPU count (at least 1 for solo cases, 2 for the others)")
    if args.steps < 4:
        raise SystemExit("--steps: at least 4 (3 warm-up steps, then the timed ones)")
    cases = parse_cases(args.cases)
    if args.gpus < 2 and any(wrap != "solo" for _, _, wrap in cases):
        raise SystemExit("--gpus: data-parallel training needs at least 2 (only solo cases run on 1)")
    import torch
    visible = torch.cuda.device_count()
    if visible < args.gpus:
        print(f"ddp_check: {visible} GPU(s) visible, {args.gpus} needed: nothing checked")
        return 0
    results = {"device": torch.cuda.get_device_name(0), "gpus": args.gpus, "torch": torch.__version__,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())), "steps": args.steps, "cases": []}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for case, fraction, wrap in cases:
            try:
                c = check_case(args, case, fraction, wrap, tmp)
            except RuntimeError as err:
                c = {"case": case, "wrap": wrap, "budget_fraction": fraction, "error": str(err), "bitwise_equal": False}
            results["cases"].append(c)
            failed |= not c["bitwise_equal"]
            unsafe = fifo_unsafe_ranks(c)
            if unsafe:
                c["nccl_fifo_unsafe_ranks"] = unsafe
                print(f"{case} ({wrap}): ranks {unsafe}: an NCCL kernel reading its work from NCCL's FIFO was "
                      "recorded as a known launch touching none of its buffers", flush=True)
                failed = True
            per = c.get("per_rank", [])
            brief = ("bytes_h2d_per_step", "bytes_d2h_per_step", "hit_rate_timed", "call_s_per_step",
                     "host_wait_s_per_step", "launch_wait_s_per_step", "remap_s_per_step")
            moved = [{k.replace("_per_step", ""): round(v, 4) for k, v in (p["layerswap_per_step"] or {}).items()
                      if k in brief and v is not None} for p in per]
            print(f"{case} ({wrap}) at {fraction:g}: bitwise equal {c['bitwise_equal']}"
                  f" (resident twice: {c.get('resident_repeat_bitwise_equal')})"
                  + (f"; budget {c['budget_bytes'] / 2**30:.2f} GiB (resident peak "
                     f"{(c['resident_peak_allocated_bytes'] or 0) / 2**30:.2f} GiB); step resident "
                     f"{c['resident_step_s']} s, layerswap {c['layerswap_step_s']} s; per step and rank {moved}; "
                     f"NCCL probe {[p['nccl_probe'] for p in per]}" if "error" not in c else f": {c['error']}"),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
