"""The launch tracker on a GPU: overhead per launch (PyTorch and C++) and coverage of one training step.

    python bench/tracker.py [--abba-processes 3] [--processes 4] [--cpu 2] [--out bench/results/tracker.json]
    python bench/tracker.py --self-test     # the estimates' arithmetic, no GPU
    python bench/tracker.py --abba-only --out F.json   # the interleaved headline alone (compare two installs)

Each measurement runs in a fresh subprocess (CUPTI state and torch's caches do not leak between them):
  0. torch loop, interleaved (the headline, added_us_per_launch_torch; Note [Interleaved blocks] at
     child_torch_abba): --abba-processes processes, each alternating short blocks (--abba-n = 2,000 ops of
     `a.add_(1)`, ~15 ms) of the shipped tracker (driver) and the tracker paused (CUPTI released: no subscriber,
     so no callback), in ABBA quads, for --abba-seconds. Each quad gives on - paused; the headline is the median
     over every quad of every process, with a 95% bootstrap interval, in wall time and in the thread's CPU time.
     Long blocks in separate processes (below) drift by more than the tracker costs; adjacent short blocks share
     the drift.
  1. torch loop, across processes: blocks of 20,000 `a.add_(1)` on a 16-element tensor (launch-bound: the time is
     the CPU's time to issue), layerswap enabled; microseconds per op. Sides (docs/tracker.md, "What it costs"):
       off                    LAYERSWAP_TRACK=0: CUPTI never loaded (its own processes)
       paused                 the tracker paused (CUPTI loaded once, unsubscribed)
       subscribe-only-both    CUPTI subscribed with the tracker's callbacks, runtime and driver, doing nothing
       subscribe-only-driver  the same, driver callbacks only
       both                   the tracker, LAYERSWAP_TRACK_API=both
       driver                 the tracker, LAYERSWAP_TRACK_API=driver (the package's default)
     Note [Process noise]: two processes of the same side differed by 3 us per op on the H100 (core placement,
     boost state), more than the 1 us the tracker may add. So every measuring process is treated alike:
       - its launching thread is pinned to one fixed core (--cpu, default 2), and its other threads (the tracker's
         consumer, CUDA's and torch's helpers) to the other cores minus that core's SMT siblings, re-checked
         before every block (--pin process puts every thread on the one core instead);
       - it warms the GPU and the core up (--warmup-s of continuous launches) before timing, and launches 1,000
         untimed ops after every switch of side;
       - it times --blocks blocks per side (median per process; garbage collection off while timing).
     These processes run strictly alternating: off, driver, off, driver, ... (--processes of each). A driver
     process starts in the package's default mode (LAYERSWAP_TRACK_API unset; checked to be `driver`) and
     alternates blocks of the tracker on and paused. Three more estimates of the added time per launch:
       added_us_per_launch_torch_processes   median of driver process medians - median of off process medians
       added_us_per_launch_torch_paired      median over every adjacent (off, driver) process pair of driver - off
       added_us_per_launch_torch_in_process  median over driver processes of (driver blocks - paused blocks)
     and torch_paused_minus_off checks that paused is a fair stand-in for off. Breakdown processes
     (--breakdown-processes, after the headline ones, while --torch-budget-s lasts) rotate in one process through
     paused, the other sides of --sides and driver, the order rotating every round; their costs are in-process
     differences: subscribe-only minus paused is CUPTI's own cost, driver (both) minus subscribe-only is ours.
  2. C++ loop: the GPU tests *TrackerGpu* (an empty kernel through cudaLaunchKernel in every mode against the
     tracker paused, interleaved in one process: TRACKER_CPP_US_PER_LAUNCH, whose `with` side is `both`;
     TRACKER_CPP_SIDE per mode, `driver` reported as added_us_per_launch_cpp_driver; the coverage of every
     runtime and driver path in both modes: TRACKER_API_COVERAGE; the clock's cost: TRACKER_CLOCK).
  3. one training step (token embedding, a transformer block with SDPA in bf16, a Conv2d branch on cuDNN, Linear
     layers large enough for cuBLASLt's nvjet kernels, a torch.compile'd MLP (Triton), AdamW foreach=True on some
     parameters and fused=True on the others), after two warm-up steps. The tracker is drained after each phase
     (forward, backward, optimizer; torch.cuda.synchronize() first), and every parameter's region is looked for in
     each phase. A launch counts as decoded when its arguments were read (a layout, an extra buffer, or a word
     that matched a region). Kernel families with launches where no argument resolved to a region are listed. Run
     twice: LAYERSWAP_TRACK_API=both (the headline decoded_fraction) and =driver (train_driver in the JSON).
Writes bench/results/tracker.json (every block's time included) and prints progress and a table. About 3 minutes
on an H200 with the defaults (the cross-process loop starts no process that would end past --torch-budget-s).
Needs layerswap importable (pip install .) and a GPU; the parent process imports neither torch nor layerswap.
"""

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADLINE = "driver"  # LAYERSWAP_TRACK_API's default (runtime/config.cpp); a driver process checks it starts in it


# ---------------------------------------------------------------------------------------------- CPU pinning

def parse_cpus(text):
    """'0-3,8' -> {0, 1, 2, 3, 8} (the kernel's cpu list format)."""
    cpus = set()
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.update(range(int(lo), int(hi) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


def format_cpus(cpus):
    """{0, 1, 2, 3, 8} -> '0-3,8'."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cpu_siblings(cpu):
    """The SMT siblings of a core (itself included); just the core when sysfs does not say."""
    try:
        return parse_cpus(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text())
    except (OSError, ValueError):
        return {cpu}


def pin_plan(cpu, pin):
    """The cores for the launching thread and for every other thread of a measuring process."""
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        raise SystemExit(f"--cpu {cpu} is not one of this process's cores ({format_cpus(allowed)}): pick one of them")
    if pin == "process":
        return {cpu}
    others = allowed - cpu_siblings(cpu) - {cpu}
    return others or (allowed - {cpu}) or {cpu}


def pin_threads(cpu, others):
    """The calling (launching) thread onto `cpu`, every other thread of the process onto `others` (Linux: a
    thread's affinity is its own; threads inherit their creator's). Returns the number of threads."""
    me = threading.get_native_id()
    os.sched_setaffinity(0, {cpu})  # pid 0: the calling thread
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in tids:
        if tid != me:
            try:
                os.sched_setaffinity(tid, others)
            except OSError:  # the thread has exited since
                pass
    return len(tids)


# ---------------------------------------------------------------------------------------------- children

def launch_ops(torch, a, n):
    """n untimed `a.add_(1)` launches, then a device sync."""
    for _ in range(n):
        a.add_(1)
    torch.cuda.synchronize()


def time_ops(torch, a, n):
    """n `a.add_(1)` launches timed on the host with garbage collection off: (wall, thread CPU) microseconds per op."""
    gc.collect()
    gc.disable()
    torch.cuda.synchronize()
    w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(n):
        a.add_(1)
    w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    torch.cuda.synchronize()
    gc.enable()
    return (w1 - w0) / n / 1e3, (c1 - c0) / n / 1e3


SIDES = {  # name: (paused, api, subscribe_only); "off" is a process of its own (LAYERSWAP_TRACK=0)
    "paused": (True, "both", False),
    "subscribe-only-both": (False, "both", True),
    "subscribe-only-driver": (False, "driver", True),
    "both": (False, "both", False),
    "driver": (False, "driver", False),
}


def child_torch_loop(args):
    """Times blocks of the sides in args.sides, rotating their order every round (see Note [Process noise])."""
    sides = args.sides.split(",")
    others = parse_cpus(args.other_cpus)
    os.sched_setaffinity(0, {args.cpu} if args.pin == "process" else others)  # before any thread exists
    import torch
    import layerswap
    from layerswap import tracker

    layerswap.enable()
    ext = tracker._C()
    tracked = sides != ["off"]
    start_mode = dict(ext.tracker_mode()) if tracked else None
    if tracked and not tracker.is_active():
        raise SystemExit(f"the tracker did not start: {tracker.stats().get('problem')}")
    api_default = next((s.default for s in layerswap.settings() if s.name == "LAYERSWAP_TRACK_API"), None)
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

    def launch(n):
        launch_ops(torch, a, n)

    threads = pin_threads(args.cpu, others)
    for side in sides:  # each mode once (the layout cache, lazy module loading), then the GPU and the core warm
        switch(side)
        launch(2000)
    switch(sides[0])
    t_end = time.perf_counter() + args.warmup_s
    while time.perf_counter() < t_end:
        launch(1000)
    per_side = {side: [] for side in sides}
    for r in range(args.blocks):
        for i in range(len(sides)):
            side = sides[(i + r) % len(sides)]
            switch(side)
            threads = max(threads, pin_threads(args.cpu, others))  # threads started since inherit the launcher's core
            launch(1000)
            per_side[side].append(time_ops(torch, a, args.n)[0])
            tracker.drain()  # keep the recent buffer small (as a learner would consume it)
    st = tracker.stats()
    print("RESULT " + json.dumps({
        "us_per_op": per_side, "start_mode": start_mode, "api_default": api_default, "threads": threads,
        "launcher_cpus": format_cpus(os.sched_getaffinity(0)), "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "launches": st.get("launches", 0), "dropped": st.get("dropped", 0),
        "problem": st.get("problem", "")}), flush=True)


def child_torch_abba(args):
    """Note [Interleaved blocks]: short blocks of the tracker on (HEADLINE) and paused (CUPTI released), in ABBA
    quads (on, paused, paused, on; then paused, on, on, paused; ...) for --abba-seconds. A quad's difference (mean
    of its two on blocks - mean of its two paused blocks) cancels any drift that is linear over the quad's ~0.1 s,
    which the process-to-process and block-to-block noise of the long blocks is not. Every block is preceded by
    the same untimed launches (--abba-warm), whether or not the side switched. Wall and thread CPU time both."""
    others = parse_cpus(args.other_cpus)
    os.sched_setaffinity(0, others)
    import torch
    import layerswap
    from layerswap import tracker

    layerswap.enable()
    ext = tracker._C()
    if not tracker.is_active():
        raise SystemExit(f"the tracker did not start: {tracker.stats().get('problem')}")
    start_mode = dict(ext.tracker_mode())
    a = torch.zeros(16, device="cuda")
    state = {"on": True}

    def switch(on):
        if on == state["on"]:
            return
        if on:
            if not tracker.resume():
                raise SystemExit(f"the tracker did not resume: {tracker.stats().get('problem')}")
        else:
            tracker.pause()
        state["on"] = on

    def launch(n):
        launch_ops(torch, a, n)

    def block(on):
        switch(on)
        launch(args.abba_warm)
        return time_ops(torch, a, args.abba_n)

    threads = pin_threads(args.cpu, others)
    for on in (False, True):  # each side once (layouts, lazy loading), then the GPU and the core warm
        switch(on)
        launch(2000)
    t_end = time.perf_counter() + args.warmup_s
    while time.perf_counter() < t_end:
        launch(1000)
    quads = []  # [on wall, on cpu, paused wall, paused cpu] means per quad
    t_end = time.perf_counter() + args.abba_seconds
    lead_on = True
    while time.perf_counter() < t_end or len(quads) < 4:
        threads = max(threads, pin_threads(args.cpu, others))
        order = (True, False, False, True) if lead_on else (False, True, True, False)
        got = {True: [], False: []}
        for on in order:
            got[on].append(block(on))
        quads.append([statistics.fmean(w for w, _ in got[True]), statistics.fmean(c for _, c in got[True]),
                      statistics.fmean(w for w, _ in got[False]), statistics.fmean(c for _, c in got[False])])
        lead_on = not lead_on
        tracker.drain()  # keep the recent buffer small (as a learner would consume it)
    switch(True)
    st = tracker.stats()
    print("RESULT " + json.dumps({
        "quads": quads, "start_mode": start_mode, "threads": threads, "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "launcher_cpus": format_cpus(os.sched_getaffinity(0)),
        "dropped": st.get("dropped", 0), "problem": st.get("problem", "")}), flush=True)


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

def run_child(kind, env_extra, timeout, extra_args=(), env_drop=()):
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
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


def spread(values):
    """Median, quartiles, min, max and max - min of a list."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": round(q[1], 4), "q1": round(q[0], 4), "q3": round(q[2], 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "spread": round(max(values) - min(values), 4), "n": len(values)}


def rounded(values):
    return [round(v, 4) for v in values]


def bootstrap_median_ci(values, resamples=2000, seed=0):
    """95% percentile-bootstrap interval of the median of `values` (a fixed seed: the same data, the same interval)."""
    import random
    rng = random.Random(seed)
    k = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=k)) for _ in range(resamples))
    return [round(meds[int(0.025 * resamples)], 4), round(meds[int(0.975 * resamples) - 1], 4)]


def run_torch_abba(args, log):
    """Note [Interleaved blocks]: --abba-processes processes, each alternating short blocks of the tracker on and
    paused in ABBA quads. Returns the JSON fields; the headline is the median of every quad's difference."""
    others = pin_plan(args.cpu, args.pin)
    env = {"LAYERSWAP": "1", "LAYERSWAP_TRACE": "none", "LAYERSWAP_TRACK": "1"}
    common = ["--abba-seconds", str(args.abba_seconds), "--abba-n", str(args.abba_n), "--abba-warm",
              str(args.abba_warm), "--warmup-s", str(args.warmup_s), "--cpu", str(args.cpu), "--other-cpus",
              format_cpus(others)]
    log(f"torch loop, interleaved: {args.abba_processes} processes x {args.abba_seconds:.0f} s of ABBA quads of "
        f"{args.abba_n}-op blocks (tracker {HEADLINE} / paused), launching thread on cpu {args.cpu}")
    t0 = time.time()
    procs = []
    for i in range(args.abba_processes):
        t = time.time()
        r = run_child("torch-abba", env, 120 + 2 * args.abba_seconds, common, env_drop=("LAYERSWAP_TRACK_API",))
        if r["start_mode"] != {"api": HEADLINE, "subscribe_only": False}:
            raise SystemExit(f"the tracker started in {r['start_mode']}, not in {HEADLINE!r}: update HEADLINE")
        procs.append({"index": i, "wall_s": round(time.time() - t, 2), "threads": r["threads"],
                      "launcher_cpus": r["launcher_cpus"], "dropped": r["dropped"], **summarize_quads(r["quads"]),
                      "device": r["device"], "torch": r["torch"]})
        p = procs[-1]
        log(f"  process {i + 1}: {p['quads']} quads, {HEADLINE} {p['on_us']:.3f} / paused {p['paused_us']:.3f} us/op, "
            f"added {p['added_us']:+.3f} us (wall), {p['added_cpu_us']:+.3f} us (thread CPU); {p['wall_s']:.1f} s")
    return {"device": procs[0]["device"], "torch": procs[0]["torch"], **pool_quads(procs),
            "setup": {"cpu": args.cpu, "other_cpus": format_cpus(others), "n": args.abba_n, "warm": args.abba_warm,
                      "seconds_per_process": args.abba_seconds, "processes": args.abba_processes,
                      "seconds": round(time.time() - t0, 1)},
            "processes": [{k: v for k, v in p.items() if k not in ("device", "torch")} for p in procs]}


def summarize_quads(quads):
    """One interleaved process's quads ([on wall, on cpu, paused wall, paused cpu] us per op) -> its figures."""
    wall = [on - off for on, _, off, _ in quads]
    cpu = [on - off for _, on, _, off in quads]
    return {"quads": len(quads), "added_us": round(statistics.median(wall), 4),
            "added_cpu_us": round(statistics.median(cpu), 4),
            "on_us": round(statistics.median(on for on, _, _, _ in quads), 4),
            "paused_us": round(statistics.median(off for _, _, off, _ in quads), 4),
            "quad_diffs_us": rounded(wall), "quad_cpu_diffs_us": rounded(cpu)}


def pool_quads(procs):
    """Every process's quad differences pooled: the median (the headline) with its 95% bootstrap interval."""
    wall = [d for p in procs for d in p["quad_diffs_us"]]
    cpu = [d for p in procs for d in p["quad_cpu_diffs_us"]]
    return {
        "added_us": round(statistics.median(wall), 4),
        "added_us_ci95": bootstrap_median_ci(wall),
        "added_cpu_us": round(statistics.median(cpu), 4),
        "added_cpu_us_ci95": bootstrap_median_ci(cpu),
        "quads": len(wall), "quads_over_1us": sum(d > 1.0 for d in wall),
        "quad_spread": spread(wall),
        "on_us_per_op": round(statistics.median(p["on_us"] for p in procs), 4),
        "paused_us_per_op": round(statistics.median(p["paused_us"] for p in procs), 4),
        "process_added_us": [p["added_us"] for p in procs],
    }


def self_test():
    """The interleaved estimate's arithmetic on made-up quads (no GPU): a known offset is found under a drift of the
    baseline across the quads, and the bootstrap interval is reproducible, holds the median and is narrow."""
    import random
    rng = random.Random(1)
    quads = []
    for i in range(200):  # the paused side drifts from 7 to 9 us/op; the tracker adds 0.5 us; noise of 0.3 us
        base = 7.0 + 2.0 * i / 200
        noise = [rng.gauss(0, 0.3) for _ in range(4)]
        quads.append([base + 0.5 + noise[0], base + 0.4 + noise[1], base + noise[2], base + noise[3]])
    p = summarize_quads(quads)
    assert p["quads"] == 200 and abs(p["added_us"] - 0.5) < 0.1 and abs(p["added_cpu_us"] - 0.4) < 0.1, p
    assert abs(p["paused_us"] - 8.0) < 0.2 and abs(p["on_us"] - 8.5) < 0.2, p
    pooled = pool_quads([p, summarize_quads(quads[:50])])
    assert pooled["quads"] == 250 and pooled["process_added_us"] == [p["added_us"], pooled["process_added_us"][1]]
    lo, hi = pooled["added_us_ci95"]
    assert lo <= pooled["added_us"] <= hi and hi - lo < 0.2, pooled
    assert bootstrap_median_ci([1.0, 2.0, 3.0, 4.0]) == bootstrap_median_ci([1.0, 2.0, 3.0, 4.0])
    assert bootstrap_median_ci([2.0] * 9) == [2.0, 2.0]
    assert pooled["quads_over_1us"] == sum(d > 1.0 for d in p["quad_diffs_us"] + p["quad_diffs_us"][:50])
    print("tracker.py self-test: ok")


def run_torch_loop(args, log):
    """Note [Process noise]: the headline processes (off, driver, off, driver, ...), then the breakdown processes.
    Returns the JSON fields of the torch loop."""
    breakdown = [s for s in args.sides.split(",") if s not in ("off", HEADLINE)]
    others = pin_plan(args.cpu, args.pin)
    base = {"LAYERSWAP": "1", "LAYERSWAP_TRACE": "none"}
    common = ["--blocks", str(args.blocks), "--n", str(args.n), "--warmup-s", str(args.warmup_s),
              "--cpu", str(args.cpu), "--other-cpus", format_cpus(others), "--pin", args.pin]
    kinds = {  # kind: (env, sides timed in the process)
        "off": ({**base, "LAYERSWAP_TRACK": "0"}, ["off"]),
        HEADLINE: ({**base, "LAYERSWAP_TRACK": "1"}, [HEADLINE, "paused"]),
        "breakdown": ({**base, "LAYERSWAP_TRACK": "1"}, list(dict.fromkeys(["paused", *breakdown, HEADLINE]))),
    }
    log(f"torch loop: launching thread on cpu {args.cpu}, other threads on {format_cpus(others)} (--pin {args.pin}); "
        f"{args.processes} x (off, {HEADLINE}) processes, then {args.breakdown_processes if breakdown else 0} "
        f"breakdown processes ({', '.join(kinds['breakdown'][1])}); budget {args.torch_budget_s:.0f} s")
    t0 = time.time()
    procs = []  # one entry per process, in the order they ran

    def run(kind):
        env, sides = kinds[kind]
        t = time.time()
        r = run_child("torch-loop", env, 240, ["--sides", ",".join(sides), *common], env_drop=("LAYERSWAP_TRACK_API",))
        if kind == HEADLINE and (r["start_mode"] != {"api": HEADLINE, "subscribe_only": False}
                                 or r["api_default"] != HEADLINE):
            raise SystemExit(f"the tracker started in {r['start_mode']} (LAYERSWAP_TRACK_API default "
                             f"{r['api_default']!r}), not in {HEADLINE!r}: update HEADLINE in bench/tracker.py")
        if r["dropped"]:
            log(f"  warning: the {kind} process dropped {r['dropped']} events")
        medians = {side: statistics.median(v) for side, v in r["us_per_op"].items()}
        procs.append({"index": len(procs), "kind": kind, "wall_s": round(time.time() - t, 2),
                      "threads": r["threads"], "launcher_cpus": r["launcher_cpus"], "medians": medians,
                      "us_per_op": {side: rounded(v) for side, v in r["us_per_op"].items()},
                      "device": r["device"], "torch": r["torch"]})
        log(f"  process {len(procs):2d} {kind:<9} "
            + ", ".join(f"{side} {m:.3f}" for side, m in medians.items())
            + f" us/op (median of {args.blocks}); {procs[-1]['wall_s']:.1f} s")
        return procs[-1]

    pairs = 0
    while pairs < args.processes:
        per_pair = (time.time() - t0) / pairs if pairs else 0.0
        if pairs >= 2 and time.time() - t0 + per_pair > args.torch_budget_s:
            log(f"  the budget of {args.torch_budget_s:.0f} s would be passed: stopping after {pairs} pairs")
            break
        run("off")
        run(HEADLINE)
        pairs += 1
    on_procs = [p for p in procs if p["kind"] == HEADLINE]
    on_us = statistics.median(p["medians"][HEADLINE] for p in on_procs)
    skipped_breakdown = 0
    if breakdown:
        for i in range(args.breakdown_processes):
            # a breakdown process: a driver process plus the blocks of its other sides
            per_proc = (statistics.mean(p["wall_s"] for p in on_procs)
                        + (len(kinds["breakdown"][1]) - 2) * args.blocks * (args.n * on_us * 1e-6 + 0.05))
            if time.time() - t0 + per_proc > args.torch_budget_s:
                skipped_breakdown = args.breakdown_processes - i
                log(f"  the budget of {args.torch_budget_s:.0f} s would be passed: {skipped_breakdown} breakdown "
                    f"processes skipped")
                break
            run("breakdown")

    def medians_of(kind, side):
        return [p["medians"][side] for p in procs if p["kind"] == kind]

    def blocks_of(kind, side):
        return [p["us_per_op"][side] for p in procs if p["kind"] == kind]

    off_med = statistics.median(medians_of("off", "off"))
    sides = {}
    for kind, side in (("off", "off"), (HEADLINE, HEADLINE), (HEADLINE, "paused")):
        m = medians_of(kind, side)
        s = spread(m)
        sides[side] = {"us_per_op": s["median"], "added_vs_off": round(s["median"] - off_med, 4),
                       "process_medians": rounded(m), "process_spread": s["spread"],
                       "process_quartiles": [s["q1"], s["q3"]], "processes": len(m),
                       "runs": sum(len(b) for b in blocks_of(kind, side)), "blocks": blocks_of(kind, side)}
    sides["paused"]["from"] = f"the {HEADLINE} processes, alternating with {HEADLINE} blocks"

    headline = [p for p in procs if p["kind"] in ("off", HEADLINE)]  # strictly alternating, off first
    pair_rows = []
    for a, b in zip(headline, headline[1:]):
        off_p, on_p = (a, b) if a["kind"] == "off" else (b, a)
        pair_rows.append({"processes": [a["index"], b["index"]], "order": f"{a['kind']},{b['kind']}",
                          "off": round(off_p["medians"]["off"], 4), HEADLINE: round(on_p["medians"][HEADLINE], 4),
                          "diff": round(on_p["medians"][HEADLINE] - off_p["medians"]["off"], 4)})
    diffs = [r["diff"] for r in pair_rows]
    paired = {**spread(diffs), "pairs_over_1us": sum(d > 1.0 for d in diffs), "pairs": pair_rows}
    for order in (f"off,{HEADLINE}", f"{HEADLINE},off"):
        d = [r["diff"] for r in pair_rows if r["order"] == order]
        paired[f"median_{order.replace(',', '_then_')}"] = round(statistics.median(d), 4) if d else None

    in_proc = [p["medians"][HEADLINE] - p["medians"]["paused"] for p in procs if p["kind"] == HEADLINE]
    in_process = {**spread(in_proc), "process_diffs": rounded(in_proc)}

    breakdown_rows, cost = {}, {}
    bprocs = [p for p in procs if p["kind"] == "breakdown"]
    if bprocs:
        def added(side, ref):
            return [p["medians"][side] - p["medians"][ref] for p in bprocs]

        for side in kinds["breakdown"][1]:
            m = medians_of("breakdown", side)
            d = added(side, "paused")
            breakdown_rows[side] = {"us_per_op": round(statistics.median(m), 4),
                                    "added_vs_paused_in_process": round(statistics.median(d), 4),
                                    "process_added_vs_paused": rounded(d), "process_medians": rounded(m),
                                    "added_vs_off": round(statistics.median(m) - off_med, 4),
                                    "blocks": blocks_of("breakdown", side)}
        for api in ("both", "driver"):
            if api in breakdown_rows and f"subscribe-only-{api}" in breakdown_rows:
                cost[api] = {"cupti_us": round(statistics.median(added(f"subscribe-only-{api}", "paused")), 4),
                             "ours_us": round(statistics.median(added(api, f"subscribe-only-{api}")), 4),
                             "total_us": round(statistics.median(added(api, "paused")), 4)}

    with_us = sides[HEADLINE]["us_per_op"]
    return {
        "device": procs[0]["device"], "torch": procs[0]["torch"],
        "added_us_per_launch_torch": round(with_us - off_med, 4),
        "added_us_per_launch_torch_paired": paired["median"],
        "added_us_per_launch_torch_in_process": in_process["median"],
        "torch_paused_minus_off": sides["paused"]["added_vs_off"],
        "torch_headline_side": HEADLINE,
        "torch_us_per_op_with_tracker": with_us,
        "torch_us_per_op_without_tracker": round(off_med, 4),
        "torch_sides": sides,
        "torch_paired": paired,
        "torch_in_process": in_process,
        "torch_breakdown_sides": breakdown_rows,
        "torch_cost_breakdown": cost,
        "torch_setup": {"cpu": args.cpu, "other_cpus": format_cpus(others), "pin": args.pin, "n": args.n,
                        "blocks": args.blocks, "warmup_s": args.warmup_s, "processes_asked": args.processes,
                        "pairs_run": pairs, "breakdown_processes_run": len(bprocs),
                        "breakdown_processes_skipped": skipped_breakdown, "budget_s": args.torch_budget_s,
                        "seconds": round(time.time() - t0, 1)},
        "torch_processes": [{k: v for k, v in p.items() if k not in ("us_per_op", "device", "torch")}
                            | {"medians": {s: round(m, 4) for s, m in p["medians"].items()}} for p in procs],
    }


def write_json(path, data):
    """Writes `data` as indented JSON to `path` (its folder made if missing); returns the Path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Defaults take about 3 to 4 minutes on "
                                 "an H100, the torch loop at most about --torch-budget-s.")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--gtest-bin", default=str(REPO / "build" / "tests" / "layerswap_gpu_tests"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "tracker.json"))
    ap.add_argument("--sides", default=",".join(["off", *SIDES]),
                    help=f"torch-loop sides: off and {HEADLINE} (the headline, always measured) and any of "
                         f"{', '.join(s for s in SIDES if s != HEADLINE)} (breakdown processes); "
                         f"'--sides off,{HEADLINE}' runs no breakdown processes (default: all)")
    ap.add_argument("--abba-processes", type=int, default=3,
                    help="processes of the interleaved measurement (the headline; Note [Interleaved blocks]; "
                         "default 3)")
    ap.add_argument("--abba-seconds", type=float, default=20.0, help="seconds of ABBA quads per process (default 20)")
    ap.add_argument("--abba-n", type=int, default=2000, help="ops per interleaved block (default 2000)")
    ap.add_argument("--abba-warm", type=int, default=200,
                    help="untimed ops before every interleaved block (default 200)")
    ap.add_argument("--processes", type=int, default=4, help=f"processes of each cross-process side, off and "
                    f"{HEADLINE}, run alternating (default 4)")
    ap.add_argument("--breakdown-processes", type=int, default=1,
                    help="processes timing every side of --sides in one process, after the headline (default 2)")
    ap.add_argument("--blocks", type=int, default=6, help="timed blocks per side in each cross-process "
                    "process (default 6)")
    ap.add_argument("--n", type=int, default=20_000, help="ops per timed block (default 20000)")
    ap.add_argument("--warmup-s", type=float, default=1.0,
                    help="seconds of untimed launches in each process before timing (default 1)")
    ap.add_argument("--cpu", type=int, default=2, help="the core of every measuring process's launching thread "
                    "(default 2; keep it off core 0, which takes most interrupts)")
    ap.add_argument("--pin", choices=("thread", "process"), default="thread",
                    help="thread: only the launching thread on --cpu, the others on the other cores minus --cpu's "
                         "SMT siblings (default); process: every thread of the process on --cpu")
    ap.add_argument("--torch-budget-s", type=float, default=80.0,
                    help="no new torch-loop process once it would end past this many seconds (at least 2 pairs "
                         "run; default 80)")
    ap.add_argument("--other-cpus", help=argparse.SUPPRESS)  # for the children
    ap.add_argument("--skip-train-driver", action="store_true", help="train once, with LAYERSWAP_TRACK_API=both")
    ap.add_argument("--abba-only", action="store_true",
                    help="run the interleaved torch loop (the headline) alone, write its figures to --out and stop: "
                         "a quick comparison of two builds, each run with its own install")
    ap.add_argument("--self-test", action="store_true", help="test the estimates' arithmetic (no GPU) and exit")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if args.child == "torch-loop":
        return child_torch_loop(args)
    if args.child == "torch-abba":
        return child_torch_abba(args)
    if args.child == "train":
        return child_train()

    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in ("off", *SIDES)]
    if unknown:
        ap.error(f"unknown side(s) {', '.join(unknown)} in --sides; the sides are off, {', '.join(SIDES)}")
    if "off" not in sides or HEADLINE not in sides:
        ap.error(f"--sides must hold off and {HEADLINE} (the headline compares them): {args.sides}")
    if min(args.processes, args.blocks, args.n, args.abba_processes, args.abba_n) < 1 or args.breakdown_processes < 0 \
            or args.abba_warm < 0 or args.abba_seconds <= 0:
        ap.error("--processes, --blocks, --n, --abba-processes and --abba-n must be at least 1, --breakdown-processes "
                 "and --abba-warm at least 0, --abba-seconds above 0")
    pin_plan(args.cpu, args.pin)  # a bad --cpu fails here, before any child

    t_start = time.time()

    def log(line):
        print(f"[{time.time() - t_start:6.1f} s] {line}", flush=True)

    abba = run_torch_abba(args, log)
    log(f"torch loop, interleaved: added per launch {abba['added_us']:+.3f} us, 95% interval {abba['added_us_ci95']} "
        f"over {abba['quads']} quads ({abba['added_cpu_us']:+.3f} us of thread CPU)")
    if args.abba_only:
        out = write_json(args.out, {"benchmark": "tracker (interleaved torch loop only)", **abba,
                                    "seconds": round(time.time() - t_start, 1)})
        log(f"wrote {out}")
        return 0
    tl = run_torch_loop(args, log)
    log(f"torch loop done: added per launch {tl['added_us_per_launch_torch']:+.3f} us (process medians), "
        f"{tl['added_us_per_launch_torch_paired']:+.3f} (adjacent pairs), "
        f"{tl['added_us_per_launch_torch_in_process']:+.3f} (in process, vs paused)")
    device = tl["device"]
    log(f"C++ loop: {args.gtest_bin} --gtest_filter=*TrackerGpu*")
    cpp = run_cpp(args.gtest_bin)
    cpp_driver = (cpp.get("sides") or {}).get(HEADLINE, {}).get("added_vs_paused")
    base = {"LAYERSWAP": "1", "LAYERSWAP_TRACE": "none"}
    log("training step, LAYERSWAP_TRACK_API=both")
    train = run_child("train", {**base, "LAYERSWAP_TRACK": "1", "LAYERSWAP_TRACK_API": "both"}, 300)
    train_driver = None
    if not args.skip_train_driver:
        log("training step, LAYERSWAP_TRACK_API=driver")
        train_driver = run_child("train", {**base, "LAYERSWAP_TRACK": "1", "LAYERSWAP_TRACK_API": "driver"}, 300)

    decoded_fraction = train["decoded"] / max(train["launches"], 1)
    m = train["missing"]
    torch_added = abba["added_us"]
    result = {
        "device": device,
        "added_us_per_launch_torch": torch_added,
        "added_us_per_launch_torch_ci95": abba["added_us_ci95"],
        "added_cpu_us_per_launch_torch": abba["added_cpu_us"],
        "torch_interleaved": {k: v for k, v in abba.items() if k not in ("device", "torch")},
        **{k: v for k, v in tl.items() if k not in ("device", "added_us_per_launch_torch")},
        "added_us_per_launch_torch_processes": tl["added_us_per_launch_torch"],
        "added_us_per_launch_cpp": cpp.get("added_us"),
        "added_us_per_launch_cpp_driver": cpp_driver,
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
            "torch_added_us<=1": torch_added <= 1.0,
            "torch_added_us_ci95_upper<=1": abba["added_us_ci95"][1] <= 1.0,
            "torch_added_us_processes<=1": tl["added_us_per_launch_torch"] <= 1.0,
            "torch_added_us_paired<=1": tl["added_us_per_launch_torch_paired"] <= 1.0,
            "cpp_added_us<=1": cpp.get("added_us") is not None and cpp["added_us"] <= 1.0,
            "cpp_added_us_driver<=1": cpp_driver is not None and cpp_driver <= 1.0,
        },
        "seconds": round(time.time() - t_start, 1),
    }
    if "error" in cpp or cpp.get("rc"):
        result["cpp_output_tail"] = cpp.get("tail", cpp.get("error"))
    out = write_json(args.out, result)

    sides = tl["torch_sides"]
    paired, in_process = tl["torch_paired"], tl["torch_in_process"]
    rows = [
        ("device", device),
        (f"torch add_ us/op {HEADLINE} / off (medians of process medians)",
         f"{tl['torch_us_per_op_with_tracker']:.3f} / {tl['torch_us_per_op_without_tracker']:.3f}"),
        ("added us per launch (torch, interleaved ABBA quads)",
         f"{torch_added:.3f}, 95% interval {abba['added_us_ci95']}, over {abba['quads']} quads "
         f"({abba['quads_over_1us']} over 1 us); thread CPU {abba['added_cpu_us']:.3f} "
         f"{abba['added_cpu_us_ci95']}; per process {abba['process_added_us']}"),
        (f"  interleaved {HEADLINE} / paused us/op", f"{abba['on_us_per_op']:.3f} / {abba['paused_us_per_op']:.3f}"),
        ("added us per launch (torch, process medians)", f"{tl['added_us_per_launch_torch']:.3f}"),
        (f"  adjacent (off, {HEADLINE}) pairs: median [min, max]",
         f"{paired['median']:.3f} [{paired['min']:.3f}, {paired['max']:.3f}] over {paired['n']} pairs "
         f"({paired['pairs_over_1us']} over 1 us)"),
        (f"  in process, {HEADLINE} - paused: median [min, max]",
         f"{in_process['median']:.3f} [{in_process['min']:.3f}, {in_process['max']:.3f}] over {in_process['n']} "
         "processes"),
        ("  paused - off (is paused a fair baseline?)", f"{tl['torch_paused_minus_off']:.3f}"),
        ("added us per launch (C++)", f"{cpp.get('added_us')}  (with {cpp.get('with_us')}, without {cpp.get('without_us')})"),
        (f"added us per launch (C++, {HEADLINE})", str(cpp_driver)),
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
    for side, v in sides.items():
        rows.append((f"torch {side} us/op (+ vs off)",
                     f"{v['us_per_op']:.3f} ({v['added_vs_off']:+.3f}); process medians {v['process_medians']}"))
    for side, v in tl["torch_breakdown_sides"].items():
        rows.append((f"torch breakdown {side} us/op (+ vs paused)",
                     f"{v['us_per_op']:.3f} ({v['added_vs_paused_in_process']:+.3f} in process); "
                     f"per process {v['process_added_vs_paused']}"))
    for api, v in tl["torch_cost_breakdown"].items():
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
