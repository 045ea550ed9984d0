"""The launch tracker on a GPU: overhead per launch (PyTorch and C++) and coverage of one training step.

    python bench/tracker.py [--gtest-bin build/tests/layerswap_gpu_tests] [--out bench/results/tracker.json]

Each measurement runs in a fresh subprocess (CUPTI state and torch's caches do not leak between them):
  1. torch loop: runs of 20,000 `a.add_(1)` on a 16-element tensor, layerswap enabled; median microseconds per op.
     Sides (docs/tracker.md, "What it costs"):
       off                    LAYERSWAP_TRACK=0: CUPTI never loaded (its own processes)
       paused                 the tracker paused (CUPTI loaded once, unsubscribed)
       subscribe-only-both    CUPTI subscribed with the tracker's callbacks, runtime and driver, doing nothing
       subscribe-only-driver  the same, driver callbacks only
       both                   the tracker, LAYERSWAP_TRACK_API=both (the default)
       driver                 the tracker, LAYERSWAP_TRACK_API=driver
     All but `off` run in one process, switched between runs (pause, mode, resume) in an order that rotates every
     round; --procs processes of them alternate with --procs processes of `off`. Reported per side: the median of
     all runs, and the median, min and max of the per-process medians (the spread between processes).
     subscribe-only minus off is CUPTI's own cost; both (driver) minus subscribe-only-both (-driver) is ours.
  2. C++ loop: the GPU tests *TrackerGpu* (an empty kernel through cudaLaunchKernel in every mode against the
     tracker paused, interleaved in one process: TRACKER_CPP_US_PER_LAUNCH, TRACKER_CPP_SIDE; the coverage of every
     runtime and driver path in both modes: TRACKER_API_COVERAGE; the clock's cost: TRACKER_CLOCK).
  3. one training step (token embedding, a transformer block with SDPA in bf16, a Conv2d branch on cuDNN, Linear
     layers large enough for cuBLASLt's nvjet kernels, a torch.compile'd MLP (Triton), AdamW foreach=True on some
     parameters and fused=True on the others), after two warm-up steps. The tracker is drained after each phase
     (forward, backward, optimizer; torch.cuda.synchronize() first), and every parameter's region is looked for in
     each phase. A launch counts as decoded when its arguments were read (a layout, an extra buffer, or a word
     that matched a region). Kernel families with launches where no argument resolved to a region are listed. Run
     twice: LAYERSWAP_TRACK_API=both (the headline decoded_fraction) and =driver (train_driver in the JSON).
Writes bench/results/tracker.json and prints a table. Needs layerswap importable (pip install .) and a GPU.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- children

SIDES = {  # name: (paused, api, subscribe_only)
    "paused": (True, "both", False),
    "subscribe-only-both": (False, "both", True),
    "subscribe-only-driver": (False, "driver", True),
    "both": (False, "both", False),
    "driver": (False, "driver", False),
}


def child_torch_loop(sides, rounds):
    import torch
    import layerswap
    from layerswap import tracker

    layerswap.enable()
    ext = tracker._C()
    n = 20_000
    a = torch.zeros(16, device="cuda")

    def switch(side):
        if side == "off":
            return
        paused, api, subscribe_only = SIDES[side]
        if tracker.is_active():
            tracker.pause()
        if paused:
            return
        ext.tracker_set_mode(api, subscribe_only)
        if not tracker.resume():
            raise SystemExit(f"the tracker did not resume in mode {side}: {tracker.stats().get('problem')}")
        mode = ext.tracker_mode()
        assert (mode["api"], mode["subscribe_only"]) == (api, subscribe_only), (side, mode)

    def run():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            a.add_(1)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / n * 1e6

    for side in sides:  # warm-up: each mode once
        switch(side)
        for _ in range(2000):
            a.add_(1)
        torch.cuda.synchronize()
    per_side = {side: [] for side in sides}
    for r in range(rounds):
        for i in range(len(sides)):
            side = sides[(i + r) % len(sides)]
            switch(side)
            per_side[side].append(run())
            layerswap.tracker.drain()  # keep the recent buffer small (as a learner would consume it)
    st = tracker.stats()
    print("RESULT " + json.dumps({"us_per_op": per_side, "active": True,  # every switch() succeeded
                                  "launches": st.get("launches", 0), "dropped": st.get("dropped", 0),
                                  "problem": st.get("problem", "")}), flush=True)


def family(name):
    """Python twin of profiler::kernel_family (for names the tracker could not attribute)."""
    if name.startswith("_Z"):
        i, nested, last = 2, False, ""
        if i < len(name) and name[i] == "N":
            nested, i = True, i + 1
            while i < len(name) and name[i] in "KVr":
                i += 1
        while i < len(name):
            if name.startswith("St", i):
                i += 2
                continue
            if name[i] == "L":
                i += 1
            m = re.match(r"\d+", name[i:])
            if not m:
                break
            length = int(m.group(0))
            i += len(m.group(0))
            last = name[i:i + length]
            i += length
            if not nested:
                break
        return last or name[:32]
    parts = name.split("_")
    return "_".join(parts[:2]) if len(parts) > 2 else name


def child_train():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import layerswap

    layerswap.enable()
    torch.manual_seed(0)
    dev = "cuda"
    vocab, d, heads, seq, batch = 4096, 1024, 16, 256, 8

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x):
            return self.down(F.gelu(self.up(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = MLP()
            self.conv = nn.Conv2d(3, 64, 3, padding=1)
            self.conv_out = nn.Linear(64, d)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens, image, mlp):
            x = self.embed(tokens)
            img = F.relu(self.conv(image)).mean(dim=(2, 3))            # cuDNN convolution
            x = x + self.conv_out(img)[:, None, :]
            h = self.ln1(x)
            q, k, v = self.qkv(h).view(batch, seq, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash/efficient SDPA in bf16
            x = x + self.proj(att.transpose(1, 2).reshape(batch, seq, d))
            x = x + mlp(self.ln2(x))
            return self.head(x)

    model = Model().to(dev)
    compiled_mlp = torch.compile(model.mlp)  # Triton kernels
    named = dict(model.named_parameters())
    foreach_names = [n for n in named if n.startswith(("embed", "ln1", "qkv", "proj", "head"))]
    fused_names = [n for n in named if n not in foreach_names]
    opt_a = torch.optim.AdamW([named[n] for n in foreach_names], lr=1e-4, foreach=True)
    opt_b = torch.optim.AdamW([named[n] for n in fused_names], lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (batch, seq), device=dev)
    image = torch.randn(batch, 3, 32, 32, device=dev)
    target = torch.randint(0, vocab, (batch, seq), device=dev)

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens, image, compiled_mlp)
        return F.cross_entropy(logits.float().view(-1, vocab), target.view(-1))

    def optimize():
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad(set_to_none=False)
        opt_b.zero_grad(set_to_none=False)

    for _ in range(2):  # warm-up: compile, autotune, allocate optimizer state
        loss = forward()
        loss.backward()
        optimize()
    torch.cuda.synchronize()
    layerswap.tracker.drain()
    before = layerswap.tracker.stats()

    def phase(fn):
        out = fn()
        torch.cuda.synchronize()
        return out, layerswap.tracker.drain()

    loss, ev_fwd = phase(forward)
    _, ev_bwd = phase(loss.backward)
    _, ev_opt = phase(optimize)
    after = layerswap.tracker.stats()

    def regions(events):
        s = set()
        for _, _, _, r in events:
            s.update(r)
        return s

    r_fwd, r_bwd, r_opt = regions(ev_fwd), regions(ev_bwd), regions(ev_opt)
    region_of = layerswap.tracker.region_of
    missing = {"forward": [], "backward": [], "backward_strict": [], "optimizer": [], "no_region": []}
    for n, p in named.items():
        rp = region_of(p.data_ptr())
        rg = region_of(p.grad.data_ptr()) if p.grad is not None else 0
        if rp == 0:
            missing["no_region"].append(n)
        if rp not in r_fwd:
            missing["forward"].append(n)
        if rp not in r_bwd:
            missing["backward_strict"].append(n)
        if rp not in r_bwd and rg not in r_bwd:  # a bias is never read in backward: its gradient is written
            missing["backward"].append(n)
        if rp not in r_opt:
            missing["optimizer"].append(n)

    families = {}
    for name, count in after.get("no_region_families", {}).items():
        delta = count - before.get("no_region_families", {}).get(name, 0)
        if delta:
            families[name] = delta
    launches = after["launches"] - before["launches"]
    decoded = after["decoded"] - before["decoded"]
    reasons = {k: v - before["undecoded_by_reason"].get(k, 0) for k, v in after["undecoded_by_reason"].items()}
    all_events = ev_fwd + ev_bwd + ev_opt
    kernels = sorted({family(k) for _, _, k, _ in all_events})
    print("RESULT " + json.dumps({
        "active": bool(after.get("active")), "problem": after.get("problem", ""),
        "launches": launches, "decoded": decoded, "events": len(all_events),
        "events_by_phase": {"forward": len(ev_fwd), "backward": len(ev_bwd), "optimizer": len(ev_opt)},
        "undecoded_by_reason": reasons, "dropped": after["dropped"] - before["dropped"],
        "nested_skipped": after["nested_skipped"] - before["nested_skipped"],
        "truncated": after["truncated"] - before["truncated"],
        "params": len(named), "missing": missing, "no_region_families": families, "kernel_families": kernels,
        "loss": float(loss.item()),
    }), flush=True)


# ---------------------------------------------------------------------------------------------- driver

def run_child(kind, env_extra, timeout, extra_args=()):
    env = dict(os.environ)
    env.update(env_extra)
    proc = subprocess.run([sys.executable, __file__, "--child", kind, *extra_args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child {kind} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def run_cpp(gtest_bin):
    if not gtest_bin or not Path(gtest_bin).exists():
        return {"error": f"gtest binary not found: {gtest_bin}"}
    proc = subprocess.run([gtest_bin, "--gtest_filter=*TrackerGpu*"], capture_output=True, text=True, timeout=300)
    m = re.search(r"TRACKER_CPP_US_PER_LAUNCH with=([\d.]+) without=([\d.]+) added=(-?[\d.]+)", proc.stdout)
    out = {"rc": proc.returncode, "tail": proc.stdout[-2500:] + proc.stderr[-1500:]}
    if m:
        out.update(with_us=float(m.group(1)), without_us=float(m.group(2)), added_us=float(m.group(3)))
    out["sides"] = {m.group(1): {"us": float(m.group(2)), "added_vs_paused": float(m.group(3)),
                                 "min": float(m.group(4)), "max": float(m.group(5))}
                    for m in re.finditer(r"TRACKER_CPP_SIDE side=(\S+) us=([\d.]+) added=(-?[\d.]+) "
                                         r"min=([\d.]+) max=([\d.]+)", proc.stdout)}
    out["api_coverage"] = {m.group(1): m.group(2) for m in
                           re.finditer(r"TRACKER_API_COVERAGE api=(\S+) (.*)", proc.stdout)}
    clock = re.search(r"TRACKER_CLOCK now_ns=([\d.]+)ns clocksource=(\S+)", proc.stdout)
    if clock:
        out["clock"] = {"now_ns": float(clock.group(1)), "clocksource": clock.group(2)}
    out["failed_tests"] = list(dict.fromkeys(t.rstrip(",") for t in re.findall(r"\[  FAILED  \] (\S+)", proc.stdout)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--gtest-bin", default=str(REPO / "build" / "tests" / "layerswap_gpu_tests"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "tracker.json"))
    ap.add_argument("--sides", default=",".join(SIDES), help="torch-loop sides measured in one process")
    ap.add_argument("--procs", type=int, default=3, help="processes per torch-loop group")
    ap.add_argument("--rounds", type=int, default=7, help="runs per side in each torch-loop process")
    ap.add_argument("--skip-train-driver", action="store_true", help="train once, with LAYERSWAP_TRACK_API=both")
    args = ap.parse_args()
    if args.child == "torch-loop":
        return child_torch_loop(args.sides.split(","), args.rounds)
    if args.child == "train":
        return child_train()

    import torch

    device = torch.cuda.get_device_name(0)
    t_start = time.time()
    base = {"LAYERSWAP": "1", "LAYERSWAP_TRACE": "none"}
    sides = args.sides.split(",")
    all_runs = {side: [] for side in ["off", *sides]}
    proc_medians = {side: [] for side in all_runs}
    for _ in range(args.procs):  # alternate the in-process group and the never-subscribed baseline
        r_on = run_child("torch-loop", {**base, "LAYERSWAP_TRACK": "1"}, 300,
                         ["--sides", ",".join(sides), "--rounds", str(args.rounds)])
        r_off = run_child("torch-loop", {**base, "LAYERSWAP_TRACK": "0"}, 120,
                          ["--sides", "off", "--rounds", str(args.rounds)])
        if not r_on["active"] and any(not SIDES[s][0] for s in sides):
            raise SystemExit(f"the tracker did not start in the tracked child: {r_on['problem']}")
        for side, values in {**r_on["us_per_op"], **r_off["us_per_op"]}.items():
            all_runs[side] += values
            proc_medians[side].append(statistics.median(values))
    torch_sides = {}
    off_us = statistics.median(all_runs["off"])
    for side, values in all_runs.items():
        med = statistics.median(values)
        torch_sides[side] = {"us_per_op": round(med, 4), "added_vs_off": round(med - off_us, 4),
                             "process_medians": [round(v, 4) for v in proc_medians[side]],
                             "process_spread": round(max(proc_medians[side]) - min(proc_medians[side]), 4),
                             "runs": len(values)}
    headline = "both" if "both" in all_runs else sides[-1]
    torch_with, torch_without = statistics.median(all_runs[headline]), off_us
    breakdown = {}
    for api in ("both", "driver"):
        if api in all_runs and f"subscribe-only-{api}" in all_runs:
            sub = statistics.median(all_runs[f"subscribe-only-{api}"])
            breakdown[api] = {"cupti_us": round(sub - off_us, 4),
                              "ours_us": round(statistics.median(all_runs[api]) - sub, 4),
                              "total_us": round(statistics.median(all_runs[api]) - off_us, 4)}
    cpp = run_cpp(args.gtest_bin)
    train = run_child("train", {**base, "LAYERSWAP_TRACK": "1", "LAYERSWAP_TRACK_API": "both"}, 300)
    train_driver = None
    if not args.skip_train_driver:
        train_driver = run_child("train", {**base, "LAYERSWAP_TRACK": "1", "LAYERSWAP_TRACK_API": "driver"}, 300)

    decoded_fraction = train["decoded"] / max(train["launches"], 1)
    m = train["missing"]
    result = {
        "device": device,
        "torch": torch.__version__,
        "added_us_per_launch_torch": round(torch_with - torch_without, 4),
        "torch_headline_side": headline,
        "torch_sides": torch_sides,
        "torch_cost_breakdown": breakdown,
        "torch_us_per_op_with_tracker": round(torch_with, 4),
        "torch_us_per_op_without_tracker": round(torch_without, 4),
        "added_us_per_launch_cpp": cpp.get("added_us"),
        "cpp_us_per_launch_with_tracker": cpp.get("with_us"),
        "cpp_us_per_launch_without_tracker": cpp.get("without_us"),
        "cpp_gtest_rc": cpp.get("rc"),
        "cpp_sides": cpp.get("sides"),
        "cpp_failed_tests": cpp.get("failed_tests"),
        "api_coverage": cpp.get("api_coverage"),
        "clock": cpp.get("clock"),
        "decoded_fraction": round(decoded_fraction, 5),
        "step_launches": train["launches"],
        "step_decoded": train["decoded"],
        "undecoded_by_reason": train["undecoded_by_reason"],
        "events_by_phase": train["events_by_phase"],
        "dropped": train["dropped"],
        "nested_skipped": train["nested_skipped"],
        "params": train["params"],
        "params_missing": m,
        "no_region_families": train["no_region_families"],
        "kernel_families_in_step": train["kernel_families"],
        "train_driver": None if train_driver is None else {
            "decoded_fraction": round(train_driver["decoded"] / max(train_driver["launches"], 1), 5),
            "launches": train_driver["launches"], "decoded": train_driver["decoded"],
            "undecoded_by_reason": train_driver["undecoded_by_reason"],
            "events_by_phase": train_driver["events_by_phase"],
            "params_missing": {k: len(v) for k, v in train_driver["missing"].items()},
            "no_region_families": train_driver["no_region_families"],
            "dropped": train_driver["dropped"],
        },
        "criteria": {
            "decoded_fraction>=0.99": decoded_fraction >= 0.99,
            "every_param_in_forward": not m["forward"],
            "every_param_or_grad_in_backward": not m["backward"],
            "every_param_in_optimizer": not m["optimizer"],
            "torch_added_us<=1": torch_with - torch_without <= 1.0,
            "cpp_added_us<=1": cpp.get("added_us") is not None and cpp["added_us"] <= 1.0,
        },
        "seconds": round(time.time() - t_start, 1),
    }
    if "error" in cpp or cpp.get("rc"):
        result["cpp_output_tail"] = cpp.get("tail", cpp.get("error"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    rows = [
        ("device", device),
        ("torch add_ us/op with / without tracker", f"{torch_with:.3f} / {torch_without:.3f}"),
        ("added us per launch (torch)", f"{torch_with - torch_without:.3f}"),
        ("added us per launch (C++)", f"{cpp.get('added_us')}  (with {cpp.get('with_us')}, without {cpp.get('without_us')})"),
        ("training step launches / decoded", f"{train['launches']} / {train['decoded']} ({decoded_fraction:.2%})"),
        ("  same with LAYERSWAP_TRACK_API=driver", "-" if train_driver is None else
         f"{train_driver['launches']} / {train_driver['decoded']} "
         f"({train_driver['decoded'] / max(train_driver['launches'], 1):.2%}), params missing "
         + json.dumps({k: len(v) for k, v in train_driver["missing"].items()})),
        ("undecoded by reason", json.dumps(train["undecoded_by_reason"])),
        ("params missing fwd / bwd(param or grad) / opt",
         f"{len(m['forward'])} / {len(m['backward'])} / {len(m['optimizer'])} of {train['params']}"),
        ("params not read in backward (strict)", ", ".join(m["backward_strict"]) or "-"),
        ("families with launches and no region", json.dumps(train["no_region_families"])),
        ("events dropped", str(train["dropped"])),
    ]
    for side, v in torch_sides.items():
        rows.append((f"torch {side} us/op (+ vs off)",
                     f"{v['us_per_op']:.3f} (+{v['added_vs_off']:.3f}); process medians {v['process_medians']}"))
    for api, v in breakdown.items():
        rows.append((f"torch added, api={api}: CUPTI / ours / total", f"{v['cupti_us']:.3f} / {v['ours_us']:.3f} / "
                     f"{v['total_us']:.3f}"))
    for side, v in (cpp.get("sides") or {}).items():
        rows.append((f"C++ {side} us/launch (+ vs paused)", f"{v['us']:.3f} (+{v['added_vs_paused']:.3f})"))
    for api, line in (cpp.get("api_coverage") or {}).items():
        rows.append((f"C++ coverage api={api}", line))
    rows.append(("clock read / clocksource", json.dumps(cpp.get("clock"))))
    rows.append(("failed GPU tests", ", ".join(cpp.get("failed_tests") or []) or "-"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("criteria:", json.dumps(result["criteria"]))
    print(f"wrote {out} in {result['seconds']} s")


if __name__ == "__main__":
    main()
