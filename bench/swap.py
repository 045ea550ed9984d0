#!/usr/bin/env python3
"""The swapping benchmark of issue 4: layerswap against the resident run, the PCIe bound and two peers, in one run.

For each case (bench/swap_models.py: `llama-lora`, `llama-full`, `unet`) it runs, each side in a fresh process:

  resident    PyTorch's own allocator, no cap: the reference losses and step time; it also measures the bytes
              of every layer group (weights, gradients, optimizer state) and the run's peak memory, from which
              the budgets are set (see `swap_budget`).
  layerswap   the same training with LAYERSWAP=1 and LAYERSWAP_BUDGET=<bytes> in the environment (layerswap
              loads itself through torch's backend autoload), at each budget fraction (0.5, 0.25, 0.10);
              layerswap.stats() is snapshot after the warm-up steps and at the end.
  peers       for llama-lora at 0.25 (--peer-cases, --peer-fraction), at the same VRAM cap (enforced with
              torch.cuda.set_per_process_memory_fraction): `block_swap`, a tuned hook-based block swapper, and
              `accelerate_cpu_offload` (bench/peers.py says how each works). A peer that runs out of memory
              under the cap is run again without it, and reported as not within the cap.

and, first, one process that measures the host->device bandwidth B_h2d (pinned 256 MiB copies, median).

Per case it reports step_s (median step time after the warm-up steps), resident_step_s, bytes_h2d_per_step (from
layerswap's statistics when it counts them, else null), the Belady bytes S and bound_s = max(resident_step_s,
S / B_h2d) (see `belady_traffic`), hit_rate, losses_bitwise_equal (every step's loss, as float.hex, against the
resident run) and the peers' {step_s, peak_vram_bytes}. A side that fails (engine not ready, OOM, crash,
timeout) records its error text in the case; no figure is ever made up. Results go to bench/results/swap.json
(swap_quick.json with --quick, swap_cpu.json on a CPU), and a table is printed.

    python3 bench/swap.py                                # everything, on the GPU (estimated 5-8 minutes on an
                                                         # H100; --deadline 540 s by default)
    python3 bench/swap.py --cases llama-lora:0.25        # one case (model[:fraction[:fraction...]], comma-separated)
    python3 bench/swap.py --interleave 20 --pin-threads  # the sides take turns, 3 steps each, 20 cycles (lockstep.py):
                                                         # the machine's drift falls on all alike; paired ratios
    python3 bench/swap.py --interleave 10 --processes 3  # three processes of every side take turns; each side's
                                                         # step and ratios pooled over its processes
    python3 bench/swap.py --cases llama-lora:0.25 --sides layerswap --interleave 10 --processes 2 \
        --variant off:LAYERSWAP_PROGRAM_FIRST=0          # an A/B in one run: the layerswap side again with more
                                                         # environment (a setting, or PYTHONPATH=<another install>),
                                                         # per cycle against the default side ('variants')
    python3 bench/swap.py --cases llama-full:0.25 --adamw fused  # the full-training cases with another AdamW
                                                         # (single: foreach=False, the default; foreach; fused)
    python3 bench/swap.py --quick                        # tiny models: a smoke test of the whole harness
    python3 bench/swap.py --quick --device cpu           # the harness logic on a CPU (layerswap and H2D skipped;
                                                         # the peers run as logic checks, without streams)
    python3 bench/swap.py --self-test                    # tests of the Belady simulation, the budget rule and
                                                         # the block swapper (CPU, a few seconds)

Defaults: 30 steps per run, the first 5 left out of the medians; Llama batch 1 x sequence 1024; UNet batch 8 at
64x64; budgets at 0.5, 0.25 and 0.10 (swap_budget says what a fraction means); a 256 MiB budget margin
(--margin-share 0.1 makes it at least 10% of the transient bytes: at larger batches the peers need that much to run
under the cap, docs/history.md, session 21). The Llama cases need transformers and peft, the accelerate peer
accelerate.

Determinism: every side uses the same seeds, torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=
:4096:8, SDPA restricted to flash + math, and the same data each step; so the losses must be bit-identical. Every
side unsets CUBLAS_WORKSPACE_CONFIG after its first step where that keeps cuBLAS's workspace (sm90), because PyTorch
2.11 compiles a regex from it at every GEMM while it is set (--keep-cublas-config keeps it; Note [CUBLAS_WORKSPACE_
CONFIG after the first step] in swap_models.py).

This parent process never imports torch: only the workers touch the device.
"""

import argparse
import bisect
import collections
import datetime
import json
import math
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from step_phases import median_phases  # torch-free: the workers' phases, pooled here too

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent

CASES = ("llama-lora", "llama-full", "unet")
MODES = {"llama-lora": "lora", "llama-full": "full", "unet": "full"}
FRACTIONS = (0.5, 0.25, 0.10)
PEERS = ("block_swap", "accelerate_cpu_offload")
MIB = 1 << 20
GRANULARITY = 2 * MIB  # layerswap's VMM granularity: budgets are rounded up to it
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


# ---------------------------------------------------------------------------------------------------------
# The budget rule
# ---------------------------------------------------------------------------------------------------------

def swap_budget(fraction, movable_bytes, transient_bytes, margin_bytes, granularity=GRANULARITY, margin_share=0.0):
    """LAYERSWAP_BUDGET for the run that keeps `fraction` of the movable bytes on the device.

    The issue asks for budgets of 50%, 25% and 10% "of the parameter bytes". A budget of literally 10% of the
    parameters cannot hold a step's activations, so the budget has two parts, both measured on the resident run
    of the same case:
      movable   M = parameter + gradient + optimizer-state bytes: what layerswap may move to the host. For LoRA
                  that is essentially the frozen weights (the adapters, their gradients and state are ~1%).
      transient T = the peak of the memory that is none of those: activations, workspaces, temporaries, which
                  cannot move while a kernel uses them (DESIGN.md, invariant 6). It is max_memory_allocated minus
                  the movable bytes allocated at that moment (swap_models.TransientMeter); the naive "peak minus
                  M" is reported beside it, and is too small for full fine-tuning, whose peak comes at the start
                  of backward, before most gradients exist.
      budget    = fraction * M + T + margin, rounded up to the 2 MiB granularity; margin = max(margin_bytes,
                  margin_share * T) (--margin-mib, --margin-share). PyTorch's own allocator reserves 5-8% more than
                  its peak allocation on the Llama cases (fragmentation): with batches larger than the default, a
                  fixed 256 MiB leaves the peers' cap below what they can run in.
    fraction * M is the capacity the movable groups get; the Belady bound (`belady_traffic`) and the block
    swapper's plan use the same capacity. Returns {"budget_bytes", "movable_bytes", "transient_bytes",
    "margin_bytes", "capacity_bytes"}.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"budget fraction must be in (0, 1], not {fraction}")
    if not 0 <= margin_share < 1:
        raise ValueError(f"margin share must be in [0, 1), not {margin_share}")
    transient = max(0, int(transient_bytes))
    capacity = int(fraction * movable_bytes)
    margin = max(int(margin_bytes), int(margin_share * transient))
    raw = capacity + transient + margin
    budget = -(-raw // granularity) * granularity
    return {"budget_bytes": budget, "movable_bytes": int(movable_bytes), "transient_bytes": transient,
            "margin_bytes": margin, "capacity_bytes": capacity}


# ---------------------------------------------------------------------------------------------------------
# The Belady bound
# ---------------------------------------------------------------------------------------------------------

def step_accesses(groups):
    """One training step as a sequence of accesses to the movable items of `groups`.

    `groups`: dicts in forward order with "name", "frozen_bytes", "trainable_bytes", "grad_bytes", "state_bytes"
    and "bwd_reads" (bench/swap_models.group_accounting). Each group has up to four items: f:<name> (frozen
    weights), t:<name> (trainable weights), g:<name> (gradients), s:<name> (optimizer state). The step:
      forward   each group in order: use f, t;
      backward  each group in reverse order that gradients reach (it, or a group before it, has trainable
                weights): use f, t when the backward reads the weights (bwd_reads), create g (no copy in: new);
      optimizer each group with trainable weights, in order: use t, g, s; write t, s; free g (zero_grad).
    Returns (sizes {item: bytes}, [{"use": [...], "create": [...], "write": [...], "free": [...]}, ...]).
    Simplifications, each of which can only add bytes to S: a group's backward reads all of its weights (the
    first layer's need not), and the optimizer visits groups one by one (LoRA's foreach update does all at once).
    """
    sizes = {}
    for g in groups:
        for prefix, key in (("f", "frozen_bytes"), ("t", "trainable_bytes"), ("g", "grad_bytes"),
                            ("s", "state_bytes")):
            if g.get(key, 0) > 0:
                sizes[f"{prefix}:{g['name']}"] = int(g[key])

    def have(prefix, g):
        name = f"{prefix}:{g['name']}"
        return [name] if name in sizes else []

    seq = []
    for g in groups:
        use = have("f", g) + have("t", g)
        if use:
            seq.append({"use": use, "create": [], "write": [], "free": []})
    reached = []
    seen_trainable = False
    for g in groups:
        seen_trainable = seen_trainable or g.get("trainable_bytes", 0) > 0
        reached.append(seen_trainable)
    for g, reach in zip(reversed(groups), reversed(reached)):
        if not reach:
            continue
        use = (have("f", g) + have("t", g)) if g.get("bwd_reads", True) else []
        create = have("g", g)
        if use or create:
            seq.append({"use": use, "create": create, "write": list(create), "free": []})
    for g in groups:
        if g.get("trainable_bytes", 0) > 0:
            use = have("t", g) + have("g", g) + have("s", g)
            seq.append({"use": use, "create": [], "write": have("t", g) + have("s", g), "free": have("g", g)})
    return sizes, seq


def simulate(sizes, seq, capacity, lookahead=()):
    """Demand paging of `seq` (see step_accesses) in `capacity` bytes with Belady's rule, from an empty device.

    At each access, the items it needs that are not resident come in: H2D bytes for a `use`, none for a `create`.
    To make room, resident items the access does not need are evicted, the one whose next use is farthest
    first (never used again before being freed or re-created: first of all; ties: the larger, then by name);
    evicting a dirty item (written since it came in) costs D2H bytes. An item that cannot fit even on an
    otherwise empty device is streamed: it crosses the link on every use and is never resident. After the
    access, `write` items are dirty and `free` items are gone (no write-back). `lookahead` is a sequence that
    follows `seq` and is used only for next-use distances. Returns a list of (h2d, d2h) bytes per access.
    """
    full = list(seq) + list(lookahead)
    events = collections.defaultdict(list)  # item -> sorted [(position, is_use)]
    for p, access in enumerate(full):
        for x in access.get("use", ()):
            events[x].append((p, True))
        for x in access.get("create", ()):
            events[x].append((p, False))
        for x in access.get("free", ()):
            events[x].append((p + 0.5, False))
    keys = {x: [e[0] for e in ev] for x, ev in events.items()}

    def next_use(x, p):
        ev = events.get(x, ())
        k = bisect.bisect_right(keys.get(x, ()), p)
        if k < len(ev) and ev[k][1]:
            return ev[k][0]
        return math.inf

    resident = {}  # item -> dirty
    used = 0
    out = []
    for p, access in enumerate(seq):
        h2d = d2h = 0
        use = list(access.get("use", ()))
        create = list(access.get("create", ()))
        needed = set(use) | set(create)
        missing = [x for x in use + create if x not in resident]
        need = sum(sizes[x] for x in missing)
        while capacity - used < need:
            candidates = [x for x in resident if x not in needed]
            if not candidates:
                break
            victim = max(candidates, key=lambda x: (next_use(x, p), sizes[x], x))
            if resident.pop(victim):
                d2h += sizes[victim]
            used -= sizes[victim]
        writes = set(access.get("write", ()))
        for x in missing:
            if capacity - used >= sizes[x]:
                resident[x] = False
                used += sizes[x]
                if x in use:
                    h2d += sizes[x]
            else:  # streamed through the link, never resident
                if x in use:
                    h2d += sizes[x]
                if x in writes or x in create:
                    d2h += sizes[x]
        for x in writes | set(create):
            if x in resident:
                resident[x] = True
        for x in access.get("free", ()):
            if x in resident:
                used -= sizes[x]
                del resident[x]
        out.append((h2d, d2h))
    return out


def belady_traffic(groups, capacity_bytes, periods=3):
    """S, the bytes per step that the best (Belady) schedule moves in `capacity_bytes` of device memory for the
    movable items of `groups` (see step_accesses). The step repeats: `periods` steps are simulated from an empty
    device (with one more as lookahead) and the last one is reported, the steady state. Returns {"h2d_bytes",
    "d2h_bytes", "per_period_h2d"}. With equal-size items and one item per access, Belady's rule is the optimal
    offline schedule; with sizes that differ it is the standard heuristic (the "best (Belady) schedule" of the
    issue). A schedule that prefetches also needs room for the item in flight, so S is a lower bound."""
    sizes, seq = step_accesses(groups)
    per_access = simulate(sizes, seq * periods, capacity_bytes, lookahead=seq)
    n = len(seq)
    per_period = [(sum(h for h, _ in per_access[k * n:(k + 1) * n]), sum(d for _, d in per_access[k * n:(k + 1) * n]))
                  for k in range(periods)]
    return {"h2d_bytes": per_period[-1][0], "d2h_bytes": per_period[-1][1],
            "per_period_h2d": [h for h, _ in per_period]}


# ---------------------------------------------------------------------------------------------------------
# Self-tests (CPU; no GPU, no layerswap)
# ---------------------------------------------------------------------------------------------------------

def _optimal_misses(seq, capacity):
    """Exhaustive optimum of demand paging, unit sizes, one item per access (for the tests)."""
    states = {frozenset(): 0}
    for x in seq:
        nxt = {}
        for state, cost in states.items():
            if x in state:
                options = [(state, cost)]
            elif len(state) < capacity:
                options = [(state | {x}, cost + 1)]
            else:
                options = [((state - {y}) | {x}, cost + 1) for y in state]
            for s, c in options:
                if c < nxt.get(s, math.inf):
                    nxt[s] = c
        states = nxt
    return min(states.values())


def self_test_bound():
    rng = random.Random(4)
    checks = 0
    # 1. Unit sizes, one item per access: Belady equals the exhaustive optimum.
    for _ in range(200):
        n_items, cap = rng.randint(2, 6), rng.randint(1, 4)
        seq_items = [rng.randrange(n_items) for _ in range(rng.randint(1, 14))]
        sizes = {f"x{i}": 1 for i in range(n_items)}
        seq = [{"use": [f"x{i}"]} for i in seq_items]
        got = sum(h for h, _ in simulate(sizes, seq, cap))
        want = _optimal_misses(seq_items, cap)
        assert got == want, f"Belady {got} != optimum {want} for {seq_items}, capacity {cap}"
        checks += 1
    # 2. Forward 0..L-1 then backward L-1..0 over L equal layers (what LoRA does with frozen layers): in steady
    #    state a capacity of c < L layers moves 2 (L - c) layers a step; the whole run matches the exhaustive
    #    optimum.
    for n_layers in range(1, 7):
        for cap in range(1, n_layers + 2):
            fwd_bwd = [f"l{i}" for i in range(n_layers)] + [f"l{i}" for i in reversed(range(n_layers))]
            sizes = {f"l{i}": 10 for i in range(n_layers)}
            seq = [{"use": [x]} for x in fwd_bwd]
            per = simulate(sizes, seq * 3, cap * 10, lookahead=seq)
            steady = sum(h for h, _ in per[-len(seq):]) // 10
            assert steady == 2 * max(0, n_layers - cap), f"L={n_layers} c={cap}: {steady}"
            total = sum(h for h, _ in per) // 10
            assert total == _optimal_misses(fwd_bwd * 3, cap), f"L={n_layers} c={cap}: {total} not optimal"
            checks += 1
    # Frozen layers only: no gradients reach them, so no backward accesses at all.
    sizes, seq = step_accesses([{"name": f"l{i}", "frozen_bytes": 10} for i in range(3)])
    assert [a["use"] for a in seq] == [["f:l0"], ["f:l1"], ["f:l2"]], seq
    # 3. step_accesses for a LoRA-like model: embed has no backward, the head is read in backward.
    groups = [{"name": "embed", "frozen_bytes": 8, "bwd_reads": False},
              {"name": "l0", "frozen_bytes": 8, "trainable_bytes": 1, "grad_bytes": 1, "state_bytes": 2},
              {"name": "head", "frozen_bytes": 8, "bwd_reads": True}]
    sizes, seq = step_accesses(groups)
    uses = [a["use"] for a in seq]
    assert uses == [["f:embed"], ["f:l0", "t:l0"], ["f:head"], ["f:head"], ["f:l0", "t:l0"],
                    ["t:l0", "g:l0", "s:l0"]], uses
    assert seq[4]["create"] == ["g:l0"] and seq[5]["free"] == ["g:l0"] and seq[5]["write"] == ["t:l0", "s:l0"]
    checks += 1
    # 4. Everything fits: nothing moves in steady state. Nothing fits: every use streams.
    full = belady_traffic(groups, sum(sizes.values()))
    assert full["h2d_bytes"] == 0 and full["d2h_bytes"] == 0, full
    none = belady_traffic(groups, 0)
    assert none["h2d_bytes"] == sum(sizes[x] for a in seq for x in a["use"]), none
    checks += 1
    # 5. Dirty write-back: full fine-tuning at a small capacity writes back weights and state, never frozen ones.
    groups = [{"name": f"l{i}", "frozen_bytes": 0, "trainable_bytes": 4, "grad_bytes": 4, "state_bytes": 8,
               "bwd_reads": True} for i in range(4)]
    r = belady_traffic(groups, 24)
    assert r["d2h_bytes"] > 0 and r["h2d_bytes"] > 0, r
    lora = [{"name": f"l{i}", "frozen_bytes": 10, "trainable_bytes": 0, "bwd_reads": True} for i in range(4)]
    lora[0]["trainable_bytes"], lora[0]["grad_bytes"], lora[0]["state_bytes"] = 1, 1, 2
    r = belady_traffic(lora, 20)
    assert r["h2d_bytes"] > 0
    checks += 1
    # 6. The budget rule.
    b = swap_budget(1.0, 1000 * MIB, 500 * MIB, 0)
    assert b["budget_bytes"] == 1500 * MIB and b["transient_bytes"] == 500 * MIB
    b = swap_budget(0.25, 1000 * MIB, 500 * MIB, 64 * MIB)
    assert b["budget_bytes"] == 250 * MIB + 500 * MIB + 64 * MIB and b["capacity_bytes"] == 250 * MIB
    b = swap_budget(0.1, 3 * MIB, 1, 0)
    assert b["budget_bytes"] % GRANULARITY == 0 and b["budget_bytes"] >= int(0.3 * MIB) + 1
    assert swap_budget(0.5, 10, -5, 0)["transient_bytes"] == 0
    b = swap_budget(0.25, 1000 * MIB, 5000 * MIB, 256 * MIB, margin_share=0.1)
    assert b["margin_bytes"] == 500 * MIB and b["budget_bytes"] == 250 * MIB + 5500 * MIB  # the share wins
    assert swap_budget(0.25, 1000 * MIB, 500 * MIB, 256 * MIB, margin_share=0.1)["margin_bytes"] == 256 * MIB
    budgets = [swap_budget(f, 1 << 30, 2 << 30, MIB)["budget_bytes"] for f in (0.1, 0.25, 0.5)]
    assert budgets == sorted(budgets)
    try:
        swap_budget(0, 1, 1, 0)
        raise AssertionError("fraction 0 accepted")
    except ValueError:
        pass
    checks += 1
    return checks


def self_test_swapper():
    """The block swapper on a CPU: bit-identical losses to the resident model, device copies really dropped
    (saved views do not keep them alive), keep_resident() mid-run, accelerate's offload when it is installed."""
    import torch
    from torch import nn
    sys.path.insert(0, str(HERE))
    import peers

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.base = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d, bias=False)
            self.adapter_a = nn.Linear(d, 2, bias=False)
            self.adapter_b = nn.Linear(2, d, bias=False)

        def forward(self, x):
            h = self.out(torch.nn.functional.gelu(self.base(self.norm(x))))
            return x + h + self.adapter_b(self.adapter_a(x))

    class Net(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.inp = nn.Linear(d, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))
            self.head = nn.Linear(d, 1)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def make(seed=0):
        torch.manual_seed(seed)
        net = Net(16, 6).to(torch.float64)
        for name, p in net.named_parameters():
            p.requires_grad_("adapter" in name)
        return net

    data = [torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def run(net, swapper=None, on_forward=None):
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step, x in enumerate(data):
            loss = net(x).pow(2).mean()
            if on_forward:
                on_forward(step)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item().hex())
            if swapper is not None and step == 1:
                swapper.keep_resident([1])
        return losses

    checks = 0
    want = run(make())
    net = make()
    swapper = peers.BlockSwapper(net.blocks, swapped=range(6), device="cpu").attach(net)
    live = []
    got = run(net, swapper, on_forward=lambda step: live.append(swapper.live_copies()))
    assert got == want, f"block swapper losses differ: {got} vs {want}"
    assert max(live) <= 2, f"device copies alive after forward: {live} (saved tensors keep them?)"
    assert swapper.counters["saved_handles"] > 0 and swapper.swapped == {0, 2, 3, 4, 5}
    checks += 2
    # Without the saved-tensor hooks every copy stays alive until backward: the test above can fail.
    net = make()
    swapper = peers.BlockSwapper(net.blocks, swapped=range(6), device="cpu")
    for i, b in enumerate(swapper.blocks):
        b.register_forward_pre_hook(swapper._make_pre_hook(i))
        b.register_forward_hook(swapper._make_post_hook(i))
    live = []
    assert run(net, None, on_forward=lambda step: live.append(swapper.live_copies())) == want
    assert max(live) >= 5, f"expected saved views to pin the copies without the hooks, saw {live}"
    checks += 1
    # The transient meter's accounting: a stand-in "allocator" whose peak is the movable bytes that exist right
    # now plus 1000 bytes of activations; the meter must find exactly 1000, and stop after the warm-up steps.
    import swap_models as sm
    net = Net(16, 2).to(torch.float64)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
    params = list(net.parameters())
    cuts = []

    def fake_peak():
        cuts.append(1)
        live = sum(sm.tensor_bytes(p) + (sm.tensor_bytes(p.grad) if p.grad is not None else 0) for p in params)
        state = sum(sm.tensor_bytes(v) for st in opt.state.values() for k, v in st.items() if k != "step")
        return live + state + 1000

    meter = sm.TransientMeter(net, opt, "cpu", peak=fake_peak, reset=lambda: None)
    cfg = sm.RunConfig(case="toy", device="cpu", steps=4, warmup=2)
    built = sm.Built(net, opt, [data[0]] * 4, lambda m, b, d: m(b).pow(2).mean(), [])
    sm.train(built, cfg, meter=meter, log=lambda s: None)
    assert meter.peak_transient == 1000, meter.peak_transient
    assert len(cuts) == 2 * (len(params) + 1) and not meter.handles, len(cuts)  # 2 warm-up steps only
    checks += 1
    assert peers.plan_resident_blocks([10] * 6, 35) == 1 and peers.plan_resident_blocks([10] * 6, 60) == 6
    assert peers.plan_resident_blocks([10] * 6, 5) == 0 and peers.plan_resident_blocks([10] * 6, 59) == 3
    checks += 1
    try:
        import accelerate
        del accelerate
    except ImportError:
        print("self-test: accelerate is not installed here: its offload check skipped")
        return checks
    net = make()
    hooked = peers.accelerate_offload(list(net.blocks), range(6), "cpu")
    assert hooked == 18, hooked  # norm, base, out in each of 6 blocks
    assert run(net) == want, "accelerate cpu_offload changed the losses"
    checks += 1
    return checks


def self_test_parent():
    """The parent's GPU path with fake workers: budgets handed to the layerswap side, its statistics turned into
    per-step figures, losses compared, a peer that runs out of memory under the cap rerun without it."""
    import contextlib
    import io

    groups = [{"name": "embed", "frozen_bytes": 100, "trainable_bytes": 0, "grad_bytes": 0, "state_bytes": 0,
               "bwd_reads": False}] + \
             [{"name": f"layer.{i}", "frozen_bytes": 200, "trainable_bytes": 4, "grad_bytes": 4, "state_bytes": 8,
               "bwd_reads": True} for i in range(4)]
    movable = sum(g["frozen_bytes"] + g["trainable_bytes"] + g["grad_bytes"] + g["state_bytes"] for g in groups)
    losses = [float(x).hex() for x in (2.5, 2.25, 2.0, 1.75)]
    calls = []

    def train(step_s, hexes=losses):
        return {"losses_hex": hexes, "losses": [float.fromhex(h) for h in hexes], "median_step_s": step_s,
                "step_times_s": [step_s] * len(hexes), "warmup": 1}

    class FakeRunner:
        def __init__(self, args, tmpdir):
            pass

        def run(self, side, run_cfg=None, env=None, tag=None, **extra):
            calls.append((side, dict(env or {}), extra))
            if side == "h2d":
                return {"device": "Fake GPU", "h2d_gbps": 1e-6, "d2h_gbps": 1e-6, "torch": "x", "cuda": "y"}
            if side == "resident":
                return {"groups": groups, "peak_allocated": movable + 4000, "transient_bytes": 5000,
                        "train": train(0.1), "params": 1, "device": "Fake GPU"}
            if side == "layerswap":
                stats = {"after_warmup": {"bytes_h2d": {"allocated": 1000, "current": 5}, "launch_hits": 10,
                                          "launch_misses": 10},
                         "end": {"bytes_h2d": {"allocated": 4000, "current": 7}, "launch_hits": 100,
                                 "launch_misses": 20}}
                return {"train": train(0.2, losses[:3] + ["0x1.0p+0"]), "layerswap_stats": stats,
                        "traffic": layerswap_traffic(stats["after_warmup"], stats["end"], 3), "peak_reserved": 10}
            if side == "accelerate_cpu_offload" and extra.get("enforce_cap"):
                return {"error": "OutOfMemoryError: CUDA out of memory", "oom": True}
            return {"train": train(0.4), "peak_reserved": 10 ** 9 if side == "accelerate_cpu_offload" else 10,
                    "peer_plan": {"resident_blocks": 1}}

    args = parse_args(["--cases", "llama-lora:0.25", "--margin-mib", "0"])
    with contextlib.redirect_stdout(io.StringIO()) as text:
        res = run_all(args, runner_class=FakeRunner)
        print_table(res)
    (c,) = res["cases"]
    budget = swap_budget(0.25, movable, 5000, 0)["budget_bytes"]
    ls_env = [env for side, env, _ in calls if side == "layerswap"][0]
    assert ls_env["LAYERSWAP_BUDGET"] == str(budget) and ls_env["LAYERSWAP"] == "1", ls_env
    assert c["budget_bytes"] == budget and c["step_s"] == 0.2 and c["resident_step_s"] == 0.1
    assert c["bytes_h2d_per_step"] == 1000 and abs(c["hit_rate"] - 90 / 100) < 1e-12, c
    assert c["losses_bitwise_equal"] is False and c["first_differing_step"] == 4
    # h2d_gbps = 1e-6 is one byte a millisecond: the bound is S / 1000 seconds.
    s_bytes = belady_traffic(groups, swap_budget(0.25, movable, 5000, 0)["capacity_bytes"])["h2d_bytes"]
    assert c["belady_h2d_bytes_per_step"] == s_bytes > 0
    assert abs(c["bound_s"] - max(0.1, s_bytes / 1e3)) < 1e-12, (c["bound_s"], s_bytes)
    acc, bs = c["peers"]["accelerate_cpu_offload"], c["peers"]["block_swap"]
    assert acc["error_under_cap"] and acc["cap_enforced"] is False and acc["within_cap"] is False
    assert bs["cap_enforced"] is True and bs["within_cap"] is True and bs["losses_bitwise_equal"] is True
    assert [side for side, _, _ in calls] == ["h2d", "resident", "layerswap", "block_swap",
                                              "accelerate_cpu_offload", "accelerate_cpu_offload", "resident", "h2d"]
    assert res["models"]["llama-lora"]["resident_step_s_runs"] == [0.1, 0.1] and c["resident_step_s_runs"]
    assert "OOM under the cap" in text.getvalue() and "NO@4" in text.getvalue()
    assert compare_losses({"train": train(1)}, {"train": train(1, losses[:2])}) == (False, 3)
    assert compare_losses({"train": train(1)}, {"error": "x"}) == (None, None)
    t = layerswap_traffic({}, {"h2d_bytes": 10, "hit_rate": 0.5}, 2)
    assert t["bytes_h2d_per_step"] == 5 and t["hit_rate"] == 0.5
    assert layerswap_traffic(None, {"allocated_bytes": {"allocated": 5}}, 2)["bytes_h2d_per_step"] is None
    t = layerswap_traffic({"residency": {"bytes_h2d": 4, "bytes_d2h": 1}}, {"residency": {"bytes_h2d": 10,
                                                                                       "bytes_d2h": 9}}, 3)
    assert t["bytes_h2d_per_step"] == 2 and t["sources"]["bytes_h2d_per_step"] == "residency.bytes_h2d", t
    assert t["bytes_d2h_per_step"] == 8 / 3, t
    t = layerswap_traffic({"driver_call_s": {"program.map": 1.0, "engine.turn_wait": 0.5}},
                          {"driver_call_s": {"program.map": 2.0, "program.unmap": 1.0, "program.record": 9.0,
                                             "engine.map": 7.0, "engine.turn_wait": 1.5}}, 2)
    assert t["program_vmm_s_per_step"] == 1.0 and t["engine_turn_wait_s_per_step"] == 0.5, t
    assert "program_vmm_s_per_step" not in layerswap_traffic({}, {"driver_call_s": {"program.record": 1.0}}, 2)
    t = layerswap_traffic({}, {"residency": {"prefetch_limit": 16, "prefetch_tunings": 1, "prefetch_tune_steps": 12,
                                             "prefetch_tune_abandoned": 0}}, 2)
    assert t["prefetch_tune"] == {"prefetch_limit": 16, "prefetch_tunings": 1, "prefetch_tune_steps": 12,
                                  "prefetch_tune_abandoned": 0}, t
    assert "prefetch_tune" not in layerswap_traffic({}, {"residency": {"prefetch_limit": 0, "prefetch_tunings": 0}}, 2)
    return 13


def self_test_rounds():
    """--rounds: the peer case's sides run again in rotating order; each side's step is the mean of its runs, the
    resident mean feeds every case's bound, a capped peer that needed more runs uncapped at once later, and a
    later layerswap run with other losses marks the case."""
    import contextlib
    import io

    groups = [{"name": f"layer.{i}", "frozen_bytes": 200, "trainable_bytes": 4, "grad_bytes": 4, "state_bytes": 8,
               "bwd_reads": True} for i in range(4)]
    losses = [float(x).hex() for x in (2.5, 2.25, 2.0)]
    calls = []
    times = {"resident": iter([0.10, 0.12, 0.14, 0.16]), "layerswap": iter([0.20, 0.30, 0.40]),
             "block_swap": iter([0.5, 0.7, 0.9]), "accelerate_cpu_offload": iter([1.0, 2.0, 3.0])}

    class FakeRunner:
        def __init__(self, args, tmpdir):
            pass

        def run(self, side, run_cfg=None, env=None, tag=None, **extra):
            calls.append((side, bool(extra.get("enforce_cap"))))
            if side == "h2d":
                return {"device": "Fake GPU", "h2d_gbps": 1.0, "d2h_gbps": 1.0, "torch": "x", "cuda": "y"}
            if side == "accelerate_cpu_offload" and extra.get("enforce_cap"):
                return {"error": "OutOfMemoryError: CUDA out of memory", "oom": True}
            t = next(times[side])
            hexes = losses if not (side == "layerswap" and t == 0.40) else losses[:2] + ["0x1.0p+0"]
            out = {"train": {"losses_hex": hexes, "median_step_s": t, "step_times_s": [t] * 3, "warmup": 1},
                   "peak_reserved": 10, "peak_allocated": 10 ** 4, "peer_plan": {}}
            if side == "resident":
                out.update({"groups": groups, "transient_bytes": 100, "params": 1, "device": "Fake GPU"})
            return out

    args = parse_args(["--cases", "llama-lora:0.25", "--margin-mib", "0", "--rounds", "3"])
    with contextlib.redirect_stdout(io.StringIO()) as text:
        res = run_all(args, runner_class=FakeRunner)
        print_table(res)
    (c,) = res["cases"]
    order = [side for side, _ in calls[1:]]
    assert order == ["resident", "layerswap", "block_swap", "accelerate_cpu_offload", "accelerate_cpu_offload",
                     "resident",  # resident again, then round 2 from the second side, round 3 from the third
                     "layerswap", "block_swap", "accelerate_cpu_offload", "resident",
                     "block_swap", "accelerate_cpu_offload", "resident", "layerswap", "h2d"], order
    assert [capped for side, capped in calls if side == "accelerate_cpu_offload"] == [True, False, False, False]
    model = res["models"]["llama-lora"]
    assert model["resident_step_s_runs"] == [0.10, 0.12, 0.14, 0.16] and abs(c["resident_step_s"] - 0.13) < 1e-12
    assert c["step_s_runs"] == [0.20, 0.30, 0.40] and abs(c["step_s"] - 0.30) < 1e-12
    assert abs(c["bound_s"] - 0.13) < 1e-12 and abs(c["step_over_bound"] - 0.30 / 0.13) < 1e-12, c
    assert c["losses_bitwise_equal"] is False and c["errors_rounds"], c
    bs = c["peers"]["block_swap"]
    assert bs["step_s_runs"] == [0.5, 0.7, 0.9] and abs(bs["layerswap_speedup"] - 0.7 / 0.3) < 1e-12, bs
    assert c["peers"]["accelerate_cpu_offload"]["step_s_runs"] == [1.0, 2.0, 3.0]
    assert "over 3 rounds" in text.getvalue()
    return 9


def _assert_rejected(*argvs):
    """Each argument list must make parse_args exit with a usage error."""
    import contextlib
    import io

    for bad in argvs:
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                parse_args(bad)
            except SystemExit:
                continue
        raise AssertionError(f"accepted {bad}")


class _InterleaveFakeRunner:
    """The self-tests' runner for --interleave: the H2D and resident runs of a four-group model alone; the
    subclasses give interleave()."""
    GROUPS = [{"name": f"layer.{i}", "frozen_bytes": 200, "trainable_bytes": 4, "grad_bytes": 4, "state_bytes": 8,
               "bwd_reads": True} for i in range(4)]
    LOSSES = [float(x).hex() for x in (2.5, 2.25, 2.0, 1.75, 1.5, 1.25, 1.0)]

    def __init__(self, args, tmpdir):
        pass

    def run(self, side, run_cfg=None, env=None, tag=None, **extra):
        if side == "h2d":
            return {"device": "Fake GPU", "h2d_gbps": 1.0, "d2h_gbps": 1.0, "torch": "x", "cuda": "y"}
        assert side == "resident", side
        return {"groups": self.GROUPS, "transient_bytes": 100, "params": 1, "device": "Fake GPU",
                "train": {"losses_hex": self.LOSSES, "median_step_s": 0.5, "step_times_s": [0.5] * 7, "warmup": 1},
                "peak_allocated": 10 ** 4}


def self_test_interleave():
    """--interleave: after the resident run alone, the sides are handed to the runner together; the case's figures
    come from the interleaved runs (continuous-step medians, the interleaved resident), with paired ratios."""
    import contextlib
    import io

    losses = _InterleaveFakeRunner.LOSSES
    handed = {}
    clock = iter(range(100))

    def train(blocks, hexes=losses):
        k = next(clock)
        times = [9.0] + [t for b in blocks for t in b]  # one warm-up step
        first = [0] + [1 + 2 * k for k in range(len(blocks))]
        record = {"losses_hex": hexes, "step_times_s": times, "warmup": 1,
                  "lockstep": {"block": 2, "first_after_pause": first, "spans": [[k, k + 0.5]]}}
        lockstep_medians(record, 1)
        return record

    class FakeRunner(_InterleaveFakeRunner):
        def interleave(self, members, cycles, block):
            handed.update({m["key"]: m for m in members})
            assert cycles == 3 and block == 2
            res_blocks = [[5.0, 0.10], [5.0, 0.20], [5.0, 0.10]]  # first steps (after pauses) are left out
            ls_blocks = [[0.01, 0.12], [0.01, 0.22], [0.01, 0.13]]
            out = {"order": [(0, "x")], "resident": {"train": train(res_blocks)}}
            for m in members:
                if m["side"] == "layerswap" and m["key"][0] == "variant":  # --variant: twice the default's step,
                    out[m["key"]] = {"train": train([[0.01, 0.24], [0.01, 0.22], [0.01, 0.26]]),  # but in cycle 2
                                     "peak_reserved": 5,  # and from /old, but at 0.5 from the default's install
                                     "layerswap_module": "/site/layerswap" if m["key"][2] == 0.5 else "/old/layerswap"}
                elif m["side"] == "layerswap":
                    out[m["key"]] = {"train": train(ls_blocks), "peak_reserved": 5,
                                     "layerswap_module": "/site/layerswap"}
                elif m["side"] == "block_swap":
                    out[m["key"]] = {"train": train([[1, 0.24], [1, 0.44], [1, 0.26]]), "peak_reserved": 5}
                elif m["side"] == "accelerate_cpu_offload":
                    out[m["key"]] = {"train": train([[1, 0.3]] * 3, losses[:2] + ["0x1.0p+0"] * 5),
                                     "peak_reserved": 10 ** 9, "capped": False, "first_error": "OutOfMemoryError"}
            return out

    args = parse_args(["--cases", "llama-lora:0.5:0.25", "--margin-mib", "0", "--interleave", "2", "--block", "2",
                       "--warmup", "1", "--steps", "7",  # 2 cycles make 5 steps: raised to 3, for 7
                       "--variant", "old:LAYERSWAP_X=0,PYTHONPATH=/old"])
    with contextlib.redirect_stdout(io.StringIO()) as text:
        res = run_all(args, runner_class=FakeRunner)
        print_table(res)
    assert set(handed) == {"resident", ("layerswap", 0.5), ("layerswap", 0.25), ("block_swap", 0.25),
                           ("accelerate_cpu_offload", 0.25), ("variant", "old", 0.5), ("variant", "old", 0.25)}, handed
    v_env, ls_env = handed[("variant", "old", 0.25)]["env"], handed[("layerswap", 0.25)]["env"]
    assert v_env == dict(ls_env, LAYERSWAP_X="0", PYTHONPATH="/old") and "LAYERSWAP_X" not in ls_env, v_env
    assert handed[("block_swap", 0.25)]["extra"]["enforce_cap"] and handed[("block_swap", 0.25)]["uncapped"]
    assert handed[("layerswap", 0.25)]["run_cfg"]["steps"] == 1 + 3 * 2, handed[("layerswap", 0.25)]["run_cfg"]
    c50, c25 = res["cases"]
    model = res["models"]["llama-lora"]
    assert model["resident_step_s"] == 0.10 and model["interleave"]["resident_step_s_alone"] == 0.5, model
    assert [n for n in res["notes"] if "0.5000 s alone and 0.1000 s interleaved (-80%)" in n], res["notes"]
    assert drift_note("m", 0.115, 0.149).startswith("m: the resident step took 0.1150 s alone and 0.1490 s "
                                                    "interleaved (+30%)")
    assert drift_note("m", 0.115, 0.13) is None and drift_note("m", None, 0.1) is None
    assert c25["step_s"] == 0.13 and c25["resident_step_s"] == 0.10, c25  # median of 0.12, 0.22, 0.13
    assert abs(c25["step_over_bound"] - 1.3) < 1e-9, c25
    ratios = c25["interleave"]["ratios_per_cycle"]
    assert [round(r, 6) for r in ratios] == [1.2, 1.1, 1.3] and abs(c25["interleave"]["median_ratio"] - 1.2) < 1e-9
    bs, acc = c25["peers"]["block_swap"], c25["peers"]["accelerate_cpu_offload"]
    assert abs(bs["layerswap_speedup"] - 0.26 / 0.13) < 1e-9 and bs["interleave"]["layerswap_speedup"]["median_ratio"] == 2.0
    assert acc["cap_enforced"] is False and acc["error_under_cap"] == "OutOfMemoryError" and acc["within_cap"] is False
    assert acc["losses_bitwise_equal"] is False and bs["losses_bitwise_equal"] is True
    assert c50["peers"] == {} and c50["step_s"] == 0.13 and model["interleave"]["overlapping_turns"] == 0
    # Per place in the block: the step after each pause (left out of the figures), then the next.
    assert c25["interleave"]["block_position_s"] == [0.01, 0.13], c25["interleave"]
    assert model["interleave"]["resident_block_position_s"] == [5.0, 0.10], model["interleave"]
    assert bs["interleave"]["block_position_s"] == [1, 0.26], bs["interleave"]
    assert "paired per cycle" in text.getvalue() and "interleaved: 3 cycles" in text.getvalue()
    v = c25["variants"]["old"]
    assert v["step_s"] == 0.24 and v["losses_bitwise_equal"] is True and v["env"]["PYTHONPATH"] == "/old", v
    assert [round(r, 6) for r in v["against_layerswap"]["ratios_per_cycle"]] == [2.0, 1.0, 2.0], v
    assert v["against_layerswap"]["median_ratio"] == 2.0 and abs(v["interleave"]["median_ratio"] - 2.4) < 1e-9, v
    assert abs(v["step_over_bound"] - 2.4) < 1e-9 and "layerswap_stats" not in v and c50["variants"]["old"], v
    assert res["settings"]["variants"] == {"old": {"LAYERSWAP_X": "0", "PYTHONPATH": "/old"}}
    assert v["layerswap_module"] == "/old/layerswap" and c25["layerswap_module"] == "/site/layerswap", v
    same = [n for n in res["notes"] if "compares that build with itself" in n]
    assert len(same) == 1 and same[0].startswith("llama-lora 0.5: variant old sets PYTHONPATH=/old"), res["notes"]
    assert "variant old (LAYERSWAP_X=0,PYTHONPATH=/old): step 0.2400 s, per cycle 2.000x the default" in text.getvalue()
    _assert_rejected(["--interleave", "2", "--rounds", "2"], ["--interleave", "2", "--block", "1"],
                     ["--interleave", "-1"], ["--variant", "a:LAYERSWAP_X=1"],
                     ["--interleave", "2", "--variant", "a"], ["--interleave", "2", "--variant", ":X=1"],
                     ["--interleave", "2", "--variant", "a:X"], ["--interleave", "2", "--variant", "a:1X=2"],
                     ["--interleave", "2", "--variant", "a b:X=1"], ["--interleave", "2", "--variant", "a:X=1,"],
                     ["--interleave", "2", "--variant", "a:X=1", "--variant", "a:Y=2"],
                     ["--interleave", "2", "--variant", "a:first,X=1"], ["--interleave", "2", "--variant", "a:X=1,,y"],
                     ["--interleave", "2", "--sides", "block_swap", "--variant", "a:X=1"])
    ok = parse_args(["--interleave", "2", "--variant", "a:X=", "--variant", "b-2:X=1,Y_Z=q=r",
                     "--variant", "c:P=first:1,last:1,Q=2,R=a,b"]).variant
    assert ok == [("a", {"X": ""}), ("b-2", {"X": "1", "Y_Z": "q=r"}),
                  ("c", {"P": "first:1,last:1", "Q": "2", "R": "a,b"})], ok
    import lockstep
    return 27 + lockstep.self_test()


def self_test_processes():
    """--processes K: K processes of every side take turns; a side's step is the median over cycles of the median
    over its processes of their block medians, ratios are pooled the same way, and every process's losses count."""
    import contextlib
    import io

    losses = _InterleaveFakeRunner.LOSSES
    handed = {}

    def train(values, hexes=losses):  # one block per value: a first step (left out), then the value
        times = [9.0] + [t for v in values for t in (5.0, v)]
        record = {"losses_hex": hexes, "step_times_s": times, "warmup": 1,
                  "lockstep": {"block": 2, "first_after_pause": [0] + [1 + 2 * i for i in range(len(values))],
                               "spans": []}}
        lockstep_medians(record, 1)
        return record

    class FakeRunner(_InterleaveFakeRunner):
        def interleave(self, members, cycles, block):
            handed.update({m["key"]: m for m in members})
            values = {"resident": [[0.10, 0.10, 0.10], [0.12, 0.11, 0.13], [0.20, 0.30, 0.10]],
                      "layerswap": [[0.11, 0.12, 0.13], [0.14, 0.12, 0.12], [0.50, 0.13, 0.13]],
                      "block_swap": [[0.2, 0.2, 0.2], [0.3, 0.3, 0.3], [0.25, 0.25, 0.25]]}
            out = {"order": []}
            for m in members:
                i = m["key"][1] if m["tag"].endswith(("#1", "#2")) else 0
                hexes = losses if (m["side"], i) != ("block_swap", 2) else losses[:3] + ["0x1.0p+0"] * 4
                out[m["key"]] = {"train": train(values[m["side"]][i], hexes), "peak_reserved": 5}
            return out

    args = parse_args(["--cases", "llama-lora:0.25", "--margin-mib", "0", "--interleave", "3", "--block", "2",
                       "--warmup", "1", "--steps", "7", "--processes", "3", "--sides", "layerswap,block_swap",
                       "--variant", "same:LAYERSWAP_X=1"])
    with contextlib.redirect_stdout(io.StringIO()):
        res = run_all(args, runner_class=FakeRunner)
        print_table(res)
    assert len(handed) == 12 and ("resident", 2) in handed and (("layerswap", 0.25), 1) in handed, sorted(
        map(str, handed))
    assert handed[(("variant", "same", 0.25), 2)]["env"]["LAYERSWAP_X"] == "1"
    assert handed[(("block_swap", 0.25), 2)]["uncapped"]["key"] == (("block_swap", 0.25), 2)
    (c,) = res["cases"]
    model = res["models"]["llama-lora"]
    # resident per cycle: median(0.10, 0.12, 0.20) = 0.12, median(0.10, 0.11, 0.30) = 0.11, median(0.10, 0.13, 0.10)
    # = 0.10; its step is their median
    assert model["resident_step_s"] == 0.11 and model["interleave"]["processes_per_side"] == 3, model
    # layerswap per cycle: 0.14 (process 2's 0.50 left out), 0.12, 0.13
    assert abs(c["step_s"] - 0.13) < 1e-12 and [p["step_s"] for p in c["processes"]] == [0.12, 0.12, 0.13], c
    assert abs(c["step_over_bound"] - 0.13 / 0.11) < 1e-9 and c["losses_bitwise_equal"] is True, c
    ratios = c["interleave"]["ratios_per_cycle"]
    assert [round(r, 6) for r in ratios] == [round(x, 6) for x in (0.14 / 0.12, 0.12 / 0.11, 0.13 / 0.10)], ratios
    bs = c["peers"]["block_swap"]
    assert bs["step_s"] == 0.25 and bs["losses_bitwise_equal"] is False, bs  # process 2's losses differ
    assert [p["losses_bitwise_equal"] for p in bs["processes"]] == [True, True, False], bs["processes"]
    assert abs(bs["layerswap_speedup"] - 0.25 / 0.13) < 1e-9, bs
    v = c["variants"]["same"]  # the layerswap side's values: pooled the same way, 1.0x the default in every cycle
    assert abs(v["step_s"] - 0.13) < 1e-12 and [p["step_s"] for p in v["processes"]] == [0.12, 0.12, 0.13], v
    assert v["against_layerswap"]["ratios_per_cycle"] == [1.0, 1.0, 1.0] and v["losses_bitwise_equal"] is True, v
    _assert_rejected(["--processes", "2"], ["--interleave", "2", "--processes", "0"])
    assert not [n for n in res["notes"] if "steal" in n], res["notes"]  # the fakes report none
    quiet, stolen = dict(c, steal_s_per_step=0.006, step_s=0.13), dict(c, steal_s_per_step=0.052, step_s=0.2)
    notes = steal_notes({"cases": [quiet, dict(stolen, resident_steal_s_per_step=0.0)]})
    assert len(notes) == 1 and "52 ms" in notes[0] and "26%" in notes[0] and "resident side: 0 ms" in notes[0], notes
    assert "not measured" in steal_notes({"cases": [stolen]})[0]
    return 18


def self_test_memory():
    """An interleaved run whose processes would not fit the device together runs nothing and says which --processes
    fits; one that fits is handed to the runner; a resident run that measured no overhead skips the check."""
    import contextlib
    import io

    handed = []

    class FakeRunner(_InterleaveFakeRunner):
        overhead = 50
        total = 7000

        def run(self, side, run_cfg=None, env=None, tag=None, **extra):
            out = super().run(side, run_cfg, env, tag, **extra)
            if side == "resident":  # 3 sides: resident 1000, layerswap <= budget, block_swap max(cap, 1000)
                out.update({"peak_reserved": 1000, "total_memory": self.total,
                            "process_overhead_bytes": self.overhead})
            return out

        def interleave(self, members, cycles, block):
            handed.append(len(members))
            return {"order": []}

    def run(processes, overhead=50, total=7000):
        FakeRunner.overhead, FakeRunner.total = overhead, total
        args = parse_args(["--cases", "llama-lora:0.25", "--margin-mib", "0", "--interleave", "3", "--block", "2",
                           "--warmup", "1", "--steps", "7", "--processes", str(processes),
                           "--sides", "layerswap,block_swap"])
        with contextlib.redirect_stdout(io.StringIO()):
            res = run_all(args, runner_class=FakeRunner)
            print_table(res)
        return res

    # The fake budget is one 2 MiB granule, so the block swapper's cap is too: per process set (1000 + 50) +
    # (2 MiB + 50) + (2 MiB + 50), over the 6790 planned of 7000: not even one set fits
    per_set = 1050 + 2 * (2 * MIB + 50)
    res = run(2)
    (c,) = res["cases"]
    fit = res["models"]["llama-lora"]["interleave_memory"]
    assert handed == [] and fit["device_bytes"] == 6790 and fit["need_bytes"] == 2 * per_set, fit
    assert c["error"].startswith("not run: 2 processes of each of 3 sides") and "--sides" in c["error"], c["error"]
    # A device that holds 2.5 sets: 3 processes a side do not fit, 2 do.
    holds_two_and_a_half = int(2.5 * per_set / INTERLEAVE_MEMORY_SLACK)
    res = run(3, total=holds_two_and_a_half)
    assert handed == [] and "run it with --processes 2" in res["cases"][0]["error"], res["cases"][0]["error"]
    run(2, total=holds_two_and_a_half)
    assert handed == [6], handed  # 3 sides x 2 processes handed over
    res = run(3, overhead=None)  # nothing measured: no check
    assert handed == [6, 9] and res["models"]["llama-lora"]["interleave_memory"]["need_bytes"] is None, handed
    return 8


def self_test_report():
    """The report's launch figures: waits always, the driver's part only where the tracker timed the launches."""
    timed = launch_text({"launch_wait_s_per_step": 0.0029, "launch_driver_s_per_step": 0.0294})
    assert timed == ", launch waits 2.9 ms/step, launches in the driver 29.4 ms/step", timed
    untimed = launch_text({"launch_wait_s_per_step": 0.0, "launch_driver_s_per_step": 0.0})  # LAYERSWAP_TRACK=0
    assert untimed == ", launch waits 0.0 ms/step", untimed
    assert launch_text({}) == "", launch_text({})  # not a layerswap side
    # LAYERSWAP_TRACK=attribute: the engine states by total time; buckets from the first whose lower bound is 16 us.
    a = {"launch_engine_none_calls": 4000, "launch_engine_none_s": 0.018, "launch_engine_map_calls": 500,
         "launch_engine_map_s": 0.005, "launch_engine_copy_calls": 0, "launch_engine_copy_s": 0.0}
    for b, (n, s, upper) in enumerate([(4000, 0.016, 8e-6), (400, 0.004, 16e-6), (90, 0.002, 32e-6), (10, 0.001, 0)]):
        a.update({f"launch_hist_{b}_calls": n, f"launch_hist_{b}_s": s, f"launch_hist_{b}_upper_s": upper})
    lines = attribution_lines({"launch_attribution_per_step": a})
    assert lines == ["launches a step by the engine's driver call they met: none 4000 x 4.5 us = 18.0 ms; "
                     "map 500 x 10.0 us = 5.0 ms",
                     "launches of 16 us or more in the driver: 100.0 a step, 3.00 ms"], lines
    assert attribution_lines({"launch_wait_s_per_step": 0.0}) == []  # not measured (LAYERSWAP_TRACK=1)
    # layerswap_traffic takes the figures per step from the tracker's counters; the bounds as they are.
    t = layerswap_traffic({"tracker": {"launch_engine_map_calls": 100, "launch_hist_0_upper_s": 4e-6}},
                          {"tracker": {"launch_engine_map_calls": 300, "launch_hist_0_upper_s": 4e-6}}, 2)
    assert t["launch_attribution_per_step"] == {"launch_engine_map_calls": 100.0, "launch_hist_0_upper_s": 4e-6}, t
    assert "launch_attribution_per_step" not in layerswap_traffic({}, {"tracker": {"launch_api_s": 1.0}}, 2)
    return 7


# --adamw's forms: the keys of swap_models.ADAMW_FORMS (checked by self_test_adamw; swap_models imports torch, so the
# parser does not import it).
ADAMW_CHOICES = ("single", "foreach", "fused")


def self_test_adamw():
    """--adamw: each form builds the AdamW it names, an unknown one is refused with the accepted forms."""
    import torch
    sys.path.insert(0, str(HERE))
    import swap_models as sm
    assert set(ADAMW_CHOICES) == set(sm.ADAMW_FORMS), (ADAMW_CHOICES, sorted(sm.ADAMW_FORMS))
    checks = 1
    for form, kw in sm.ADAMW_FORMS.items():
        param = torch.nn.Parameter(torch.ones(4))
        opt, text = sm.full_adamw([param], sm.RunConfig(case="llama-full", device="cpu", adamw=form), (0.9, 0.99))
        for key, value in kw.items():
            assert opt.defaults[key] is value, (form, key, opt.defaults[key])
            assert f"{key}={value}" in text, (form, text)
        param.grad = torch.full((4,), 0.5)
        opt.step()
        assert torch.all(param < 1), (form, param)  # the step moved the parameter against its gradient
        checks += 1
    try:
        sm.full_adamw([torch.nn.Parameter(torch.ones(1))], sm.RunConfig(case="unet", adamw="sgd"), (0.9, 0.99))
        raise AssertionError("an unknown AdamW form was accepted")
    except ValueError as e:
        assert "'sgd'" in str(e) and "single, foreach, fused" in str(e), e
    return checks + 1


def self_test():
    passed = failed = 0
    for name, fn in (("bound and budget", self_test_bound), ("parent (fake workers)", self_test_parent),
                     ("rounds (fake workers)", self_test_rounds),
                     ("interleave (fake workers; lockstep with real processes)", self_test_interleave),
                     ("processes per side (fake workers)", self_test_processes),
                     ("device memory of an interleaved run (fake workers)", self_test_memory),
                     ("merge", self_test_merge), ("bandwidth", self_test_bandwidth), ("report", self_test_report),
                     ("block swapper", self_test_swapper), ("AdamW forms", self_test_adamw)):
        try:
            n = fn()
            passed += n
            print(f"self-test {name}: {n} checks passed")
        except Exception:
            failed += 1
            print(f"self-test {name}: FAILED")
            traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------
# Worker: one side of one case, in a fresh process
# ---------------------------------------------------------------------------------------------------------

def _flatten(d, prefix=""):
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
        elif isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            out.update({f"{key}.{i}": x for i, x in enumerate(v)})
    return out


def ls_snapshot(ls, device):
    """layerswap.stats(device), with the launch tracker's statistics under "tracker" (launch_api_s ...)."""
    snap = ls.stats(device)
    try:
        import layerswap.tracker as lt
        snap["tracker"] = {k: v for k, v in lt.stats().items() if isinstance(v, (int, float))}
    except Exception:  # no tracker: its figures are left out
        pass
    return snap


# layerswap statistics reported per timed step (differences of two snapshots over the timed steps).
PER_STEP_STATS = ("launch_wait_s", "launch_waits", "launch_holds", "stall_evictions", "abandoned", "lock_wait_s",
                  "num_lock_waits", "evictions", "writeback_skipped", "writeback_checked", "launch_api_s",
                  "launch_api_calls", "host_wait_s", "num_host_waits", "stall_s", "policy_rounds", "policy_s",
                  "remap_s", "stage_s", "remap_in_s", "remap_out_s", "prefetches", "chunks_created", "chunks_released", "call_s", "num_calls",
                  "num_reclaims", "num_engine_reclaims", "segment_new_s", "segment_destroy_s", "chunks_for_segments",
                  "chunks_released_for_size", "chunks_released_for_pages", "small_segments.allocated",
                  "large_segments.allocated", "maintain_s", "room_s",
                  "num_lock_spins", "late_prefetches", "late_bytes", "late_lead_s", "late_copy_wait_s",
                  "late_remap_wait_s", "launch_driver_s", "launch_remap_waits", "launch_remap_wait_s",
                  "digests_carried", "idle_sleeps", "num_composites", "composite_donors",
                  "num_spare_composites", "spare_composite_parts",
                  "num_zombies_reaped", "num_splits", "num_spare_splits", "num_home_segments", "num_slab_reuses",
                  "reserve_followed", "reserve_auto_changes",
                  "cache_misses", "program_vmm_s", "engine_turn_wait_s") + tuple(
                      f"late_wait_s_by_phase.{i}" for i in range(8)) + tuple(f"remap_s_by_phase.{i}" for i in range(8)) + tuple(
                      f"evicted_bytes_by_phase.{i}" for i in range(8)) + tuple(
                      f"prefetched_bytes_by_phase.{i}" for i in range(8))
# The driver port's VMM call kinds (runtime/driver_calls.hpp's vmm_kind): the program's, summed as program_vmm_s.
VMM_KINDS = ("create", "release", "map", "unmap", "set_access", "reserve")


# LAYERSWAP_PREFETCH=tune's figures (layerswap.stats()'s "residency"): the distance in force at the end (0: auto),
# tunings finished, steps timed, tunings abandoned for another step length.
TUNE_LEVELS = ("prefetch_limit", "prefetch_tunings", "prefetch_tune_steps", "prefetch_tune_abandoned")


def layerswap_traffic(before, after, steps):
    """bytes_h2d_per_step and hit_rate from two layerswap.stats() snapshots (after the warm-up, at the end).

    The engine's names are not fixed yet, so this looks for them: the H2D byte counter is the first numeric entry
    whose name holds "h2d" (or "host_to_device") and "bytes" (the residency engine's `residency.bytes_h2d`; a
    Stat dict's cumulative "allocated" field when it is one); the hit rate is "hit_rate" when present, else hits / (hits + misses) from counters so named, over
    the timed steps. Returns {"bytes_h2d_per_step", "hit_rate", "sources"}: None where nothing matched."""
    fa, fb = _flatten(after), _flatten(before)
    res = {"bytes_h2d_per_step": None, "hit_rate": None, "sources": {}}

    def find(pred):
        names = [k for k in fa if pred(k.lower())]
        names.sort(key=lambda k: (not k.endswith(".allocated") and "." in k, k))
        return names[0] if names else None

    key = find(lambda k: ("h2d" in k or "host_to_device" in k) and "bytes" in k
               and not any(k.endswith(s) for s in (".current", ".peak", ".freed")))
    if key and steps > 0:
        res["bytes_h2d_per_step"] = (fa[key] - fb.get(key, 0)) / steps
        res["sources"]["bytes_h2d_per_step"] = key
    key = find(lambda k: ("d2h" in k or "device_to_host" in k) and "bytes" in k
               and not any(k.endswith(s) for s in (".current", ".peak", ".freed")))
    if key and steps > 0:
        res["bytes_d2h_per_step"] = (fa[key] - fb.get(key, 0)) / steps
        res["sources"]["bytes_d2h_per_step"] = key
    for name in PER_STEP_STATS:
        key = find(lambda k, n=name: k == n or k.endswith("." + n))
        if key and steps > 0:
            res[name + "_per_step"] = (fa[key] - fb.get(key, 0)) / steps
    if steps > 0:
        # The program's VMM calls (making and freeing segments) and the migration thread's waits for them (Note
        # [Program first] in runtime/driver_calls.hpp), from the driver port's times by caller.
        vmm = [k for k in fa if k.startswith("driver_call_s.program.") and k.rsplit(".", 1)[1] in VMM_KINDS]
        if vmm:
            res["program_vmm_s_per_step"] = sum(fa[k] - fb.get(k, 0) for k in vmm) / steps
        k = "driver_call_s.engine.turn_wait"
        if k in fa:
            res["engine_turn_wait_s_per_step"] = (fa[k] - fb.get(k, 0)) / steps
        # LAYERSWAP_TRACK=attribute (Note [Launches beside the engine's calls], profiler/cupti_tracker.cpp): the
        # launches' driver part by the engine's driver call they met and by length, per step; bucket bounds as they are.
        attribution = {}
        for k in fa:
            name = k[len("tracker."):]
            if not k.startswith(("tracker.launch_engine_", "tracker.launch_hist_")):
                continue
            attribution[name] = fa[k] if name.endswith("_upper_s") else (fa[k] - fb.get(k, 0)) / steps
        if attribution:
            res["launch_attribution_per_step"] = attribution
    # LAYERSWAP_PREFETCH=tune (Note [Tuned prefetch]): levels at the end, not per step; only when it tuned.
    tune = {}
    for name in TUNE_LEVELS:
        key = find(lambda k, n=name: k == n or k.endswith("." + n))
        if key:
            tune[name] = fa[key]
    if any(tune.get(n) for n in TUNE_LEVELS[1:]):
        res["prefetch_tune"] = tune
    counted, missed = find(lambda k: k.endswith("launches_counted")), find(lambda k: k.endswith("launches_missed"))
    if counted and missed and fa[counted] - fb.get(counted, 0) > 0:  # over the timed steps only
        res["hit_rate_timed"] = 1 - (fa[missed] - fb.get(missed, 0)) / (fa[counted] - fb.get(counted, 0))
    key = find(lambda k: k.endswith("hit_rate"))
    if key:
        res["hit_rate"] = fa[key]
        res["sources"]["hit_rate"] = key + " (cumulative, at the end)"
    else:
        hits = find(lambda k: k.endswith("hits"))
        misses = find(lambda k: k.endswith("misses"))
        if hits and misses:
            h = fa[hits] - fb.get(hits, 0)
            m = fa[misses] - fb.get(misses, 0)
            if h + m > 0:
                res["hit_rate"] = h / (h + m)
                res["sources"]["hit_rate"] = f"{hits} / ({hits} + {misses}) over the timed steps"
    return res


def worker_h2d(spec, out):
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is visible")
    n = 256 * MIB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host.fill_(1)

    def measure(dst, src, reps):
        times = []
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return n / statistics.median(times) / 1e9

    reps = spec.get("reps", 20)
    out["h2d_gbps"] = measure(dev, host, reps)
    out["d2h_gbps"] = measure(host, dev, reps)
    out["device"] = torch.cuda.get_device_name()
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["total_memory"] = torch.cuda.get_device_properties(0).total_memory


def worker_train(spec, out, log):
    side = spec["side"]
    out["pid"] = os.getpid()  # names the process in a profile of the whole run (bench/perf_threads.sh)
    import torch  # with LAYERSWAP=1 / LAYERSWAP_BUDGET in the environment, layerswap loads here

    ls = None
    if side == "layerswap":
        try:
            import layerswap
        except ImportError as err:
            raise RuntimeError(f"layerswap is not installed (pip install . in the repository): {err}") from err
        if layerswap.is_enabled():
            out["enabled_by"] = "environment (torch backend autoload)"
        else:
            log("WARNING: LAYERSWAP_BUDGET is set but `import torch` did not enable layerswap; calling "
                "layerswap.enable()")
            layerswap.enable(budget=int(spec["budget_bytes"]))
            out["enabled_by"] = "layerswap.enable() (the autoload did not enable it)"
        if not layerswap.is_enabled():
            raise RuntimeError("layerswap could not be enabled")
        ls = layerswap
        out["layerswap_config"] = {k: v for k, v in layerswap.config().items()}
        out["layerswap_module"] = os.path.dirname(os.path.abspath(layerswap.__file__))  # which install (--variant)
        try:  # the sources it was built from, when bench/gpu_run.sh installed it
            with open(os.path.join(out["layerswap_module"], "SOURCE_HASH")) as f:
                out["layerswap_source"] = f.read().strip()
        except OSError:
            out["layerswap_source"] = None
    else:
        try:
            import layerswap
            if layerswap.is_enabled():
                raise RuntimeError("layerswap is enabled in a side that must run without it: unset LAYERSWAP*")
        except ImportError:
            pass

    sys.path.insert(0, str(HERE))
    import swap_models as sm

    cfg = sm.RunConfig(**spec["run"])
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is visible (use --device cpu for the CPU smoke test)")
    sm.make_deterministic(cfg.seed)
    if cuda:
        torch.cuda.init()
        out["device"] = torch.cuda.get_device_name(device)
    else:
        out["device"] = "cpu"
    out["torch"] = torch.__version__
    t0 = time.perf_counter()
    built = sm.build_case(cfg)
    out["describe"] = built.describe
    out["params"] = sum(p.numel() for p in built.model.parameters())

    swapper = None
    cap = spec.get("cap_bytes") if spec.get("enforce_cap") else None
    if side in PEERS:
        import peers
        if not built.blocks:
            raise RuntimeError(f"{side} needs a model with repeated blocks (the Llama cases)")
        blocks = built.blocks
        block_bytes = [sum(p.numel() * p.element_size() for p in b.parameters() if not p.requires_grad)
                       for b in blocks]
        plan = spec["peer_plan"]
        # Device memory for the blocks' frozen weights: the budget's capacity for movable bytes (fraction *
        # movable, the same that layerswap and the Belady bound get), less every other movable byte (embedding,
        # head, adapters, their gradients and state), which this peer keeps on the device. On a GPU, the first
        # step then shows what the cap really leaves, and the resident set grows into it (after_step).
        room = plan["capacity_bytes"] - (plan["movable_bytes"] - sum(block_bytes))
        k = peers.plan_resident_blocks(block_bytes, room)
        swapped = list(range(k, len(blocks)))
        out["peer_plan"] = {"weight_room_bytes": room, "block_bytes": max(block_bytes), "blocks": len(blocks),
                            "resident_blocks_planned": k}
        if side == "block_swap":
            swapper = peers.BlockSwapper(blocks, swapped, device).attach(built.model)
        else:
            out["peer_plan"]["hooked_modules"] = peers.accelerate_offload(blocks, swapped, device)
        out["peer_plan"]["offloaded_blocks"] = len(swapped)
    out["setup_s"] = time.perf_counter() - t0

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        try:
            torch.cuda.reset_peak_memory_stats()
        except Exception as err:
            log(f"warning: reset_peak_memory_stats failed: {type(err).__name__}: {err}")
        total = torch.cuda.get_device_properties(device).total_memory
        out["total_memory"] = total
        if cap:
            # It wants an index ("cuda" alone is refused).
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
            out["cap_enforced_bytes"] = cap
    snapshots = {}

    def after_step(step):
        if ls is not None and step == cfg.warmup - 1:
            snapshots["after_warmup"] = ls_snapshot(ls, device)
        if swapper is not None and step == cfg.warmup - 1:
            snapshots["swapper_after_warmup"] = dict(swapper.counters)
        if swapper is not None and step == 0:
            grown = []
            if cuda and cap:
                # Tune: grow the resident set into the headroom the first step left under the cap, keeping one
                # block spare for the allocator's fragmentation.
                size = max(swapper.block_bytes(i) for i in range(len(swapper.blocks)))
                headroom = cap - torch.cuda.max_memory_reserved(device)
                extra = int(headroom // size) - 1
                grown = sorted(swapper.swapped)[:max(0, extra)]
                if grown:
                    swapper.keep_resident(grown)
                    torch.cuda.reset_peak_memory_stats()
            out["peer_plan"]["resident_blocks_added_after_step_1"] = len(grown)

    record = {}
    out["train"] = record
    gate = None
    if spec.get("lockstep"):  # --interleave: this side takes turns with the others (bench/lockstep.py)
        import lockstep
        gate = lockstep.Gate.from_spec(spec["lockstep"])
        block = int(spec["lockstep"]["block"])
        record["lockstep"] = {"block": block, "first_after_pause": [0]}
        chained_gate = after_step

        def after_step(step):
            chained_gate(step)
            if lockstep.Gate.pauses_after(step, cfg.warmup, block, cfg.steps):
                gate.pause("ready")
                record["lockstep"]["first_after_pause"].append(step + 1)
    profiler = None
    if cuda and spec.get("profile_steps") and side != "layerswap":  # layerswap holds CUPTI: no profiler there
        profiler = GpuProfile(cfg.warmup, spec["profile_steps"])
        chained = after_step

        def after_step(step):
            chained(step)
            profiler.step()
    meter = sm.TransientMeter(built.model, built.optimizer, device) if cuda and side == "resident" else None
    try:
        if gate is not None:
            gate.pause("built")
        sm.train(built, cfg, after_step=after_step, record=record, meter=meter,
                 log=lambda s: log(s) if spec.get("verbose") else None)
        if gate is not None:
            gate.end_turn()
            record["lockstep"]["spans"] = gate.spans
            lockstep_medians(record, cfg.warmup)
    finally:
        if cuda:
            for key, fn in (("peak_allocated", torch.cuda.max_memory_allocated),
                            ("peak_reserved", torch.cuda.max_memory_reserved)):
                try:
                    out[key] = fn(device)
                except Exception as err:
                    out[key] = None
                    log(f"warning: torch.cuda.{fn.__name__} failed: {type(err).__name__}: {err}")
            if side == "resident" and gate is None:  # alone on the device: what the process holds besides the cache
                try:
                    free, total_now = torch.cuda.mem_get_info(device)
                    out["process_overhead_bytes"] = max(0, total_now - free - torch.cuda.memory_reserved(device))
                except Exception as err:
                    log(f"warning: torch.cuda.mem_get_info failed: {type(err).__name__}: {err}")
        if profiler is not None:
            out["gpu_profile"] = profiler.finish()
            log(f"gpu profile: {out['gpu_profile']}")
        if meter is not None:  # it reset the peak counter at each cut during the warm-up steps
            out["peak_allocated"] = max(out.get("peak_allocated") or 0, meter.peak_allocated)
            out["transient_bytes"] = meter.peak_transient
        if ls is not None:
            try:
                snapshots["end"] = ls_snapshot(ls, device)
            except Exception as err:
                log(f"warning: layerswap.stats() failed: {type(err).__name__}: {err}")
            out["layerswap_stats"] = snapshots
        if swapper is not None:
            out["peer_plan"]["resident_blocks"] = len(swapper.blocks) - len(swapper.swapped)
            out["peer_plan"]["counters"] = dict(swapper.counters)
            timed = len(record.get("step_times_s", [])) - cfg.warmup
            before = snapshots.get("swapper_after_warmup")
            if before and timed > 0:
                out["peer_plan"]["bytes_h2d_per_step"] = (swapper.counters["bytes_h2d"] - before["bytes_h2d"]) / timed
    if side in ("resident", "layerswap"):  # the peers have moved or replaced weights: their count would mislead
        out["groups"] = sm.group_accounting(built)
    tr = record
    if tr.get("median_step_s") is not None:
        peak = out.get("peak_reserved")
        log(f"{len(tr['losses'])} steps, median {tr['median_step_s']:.4f} s after {tr['warmup']} warm-up; last loss "
            f"{tr['losses'][-1]:.6f}" + (f"; peak reserved {peak / 1e9:.2f} GB" if peak else "")
            + (f"; launching thread: enqueued in {tr['median_issue_s']:.4f} s, CPU {tr['median_cpu_s']:.4f} s"
               if tr.get("median_issue_s") is not None else ""))
    if ls is not None:
        timed = max(0, len(record.get("step_times_s", [])) - cfg.warmup)
        out["traffic"] = layerswap_traffic(snapshots.get("after_warmup"), snapshots.get("end"), timed)


def after_own_steps(values, warmup, first):
    """The entries of a per-step list for the timed steps (from `warmup`) that followed a step of their own, not a
    pause (`first`: the steps that came first after one)."""
    return [v for i, v in enumerate(values or []) if i >= warmup and i not in first]


def lockstep_medians(record, warmup):
    """A side that took turns (--interleave): its step is the median of the timed steps that followed another
    step of its own, not a pause. While a side waits, its device and its copy engines are idle, so the first step
    after a pause starts with the prefetches that layerswap made during the wait, and with the caches the other
    sides used; the steps after it are training as usual. The median of every timed step stays as
    median_step_s_all, and each block's steps under "blocks" (for the paired ratios)."""
    times = record.get("step_times_s") or []
    first = set(record["lockstep"]["first_after_pause"])
    cont = after_own_steps(times, warmup, first)
    record["median_step_s_all"] = record.get("median_step_s")
    if cont:
        record["median_step_s"] = statistics.median(cont)
    tails = after_own_steps(record.get("tail_times_s"), warmup, first)
    if tails:
        record["median_tail_s"] = statistics.median(tails)
    phases = after_own_steps(record.get("phase_times_s"), warmup, first)
    if phases:
        record["median_phase_s"] = median_phases(phases)
    starts = sorted(i for i in first if i >= warmup)
    record["lockstep"]["blocks"] = [times[a:b] for a, b in zip(starts, starts[1:] + [len(times)])]
    record["lockstep"]["continuous_steps"] = len(cont)


def phase_text(phases):
    """"forward 79.3 ms (CPU: main 75.9, autograd 0.0), backward ..." from pooled_phases() (seconds in)."""
    def ms(x):
        return "?" if x is None else f"{x * 1e3:.1f}"

    return ", ".join(f"{name} {ms(p[0])} ms (CPU: main {ms(p[1])}, autograd {ms(p[2] if len(p) > 2 else None)})"
                     for name, p in phases.items())


def pooled_phases(records):
    """The median [wall, main-thread CPU, autograd-thread CPU] seconds of each phase of a step (swap_models.train's
    phase_times_s) over the steps of every process in `records` that followed a step of their own (lockstep_medians),
    or None."""
    steps = []
    for r in records:
        tr = r.get("train") or {}
        first = set((tr.get("lockstep") or {}).get("first_after_pause") or [])
        steps += after_own_steps(tr.get("phase_times_s"), tr.get("warmup") or 0, first)
    return median_phases(steps) if steps else None


class GpuProfile:
    """--profile-steps N: torch.profiler over N timed steps of a side without layerswap (which holds CUPTI). Says
    where a step's wall time goes on the device: kernel time, copy time, and the time the device was busy at all
    (the union of its kernels and copies), per step. Diagnostic only: profiled steps run slower on the CPU."""

    def __init__(self, warmup, steps):
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule
        self.steps = steps
        self.prof = profile(activities=[ProfilerActivity.CUDA],
                            schedule=schedule(wait=max(0, warmup - 1), warmup=1, active=steps, repeat=1))
        self.prof.__enter__()
        self.done = False

    def step(self):
        if not self.done:
            self.prof.step()

    def finish(self):
        if self.done:
            return None
        self.done = True
        self.prof.__exit__(None, None, None)
        from torch.autograd import DeviceType
        spans, kernel_us, copy_us, kernels = [], 0.0, 0.0, 0
        for e in self.prof.events():
            if e.device_type != DeviceType.CUDA:
                continue
            start, end = e.time_range.start, e.time_range.end
            spans.append((start, end))
            if "memcpy" in e.name.lower() or "memset" in e.name.lower():
                copy_us += end - start
            else:
                kernel_us += end - start
                kernels += 1
        busy, last = 0.0, None
        for start, end in sorted(spans):
            if last is None or start > last:
                busy += end - start
                last = end
            elif end > last:
                busy += end - last
                last = end
        n = self.steps
        return {"steps": n, "kernel_s_per_step": kernel_us / n / 1e6, "copy_s_per_step": copy_us / n / 1e6,
                "busy_s_per_step": busy / n / 1e6, "kernels_per_step": kernels / n}


def run_worker(spec_path):
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes, every run
    spec = json.loads(pathlib.Path(spec_path).read_text())
    out = {"side": spec["side"], "case": (spec.get("run") or {}).get("case"), "error": None}
    tag = spec.get("tag", spec["side"])

    def log(s):
        print(f"[{tag}] {s}", flush=True)

    try:
        if spec["side"] == "h2d":
            worker_h2d(spec, out)
        else:
            worker_train(spec, out, log)
    except BaseException as err:  # noqa: B036 -- the parent must learn of every way this ends
        text = f"{type(err).__name__}: {err}"
        out["error"] = text[:4000]
        out["oom"] = "out of memory" in text.lower() or "OutOfMemory" in type(err).__name__
        traceback.print_exc()
    finally:
        pathlib.Path(spec["out"]).write_text(json.dumps(out, default=str))
    return 0 if out["error"] is None else 1


# ---------------------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------------------

def worker_env(layerswap_budget=None, extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP")}
    for name in ("PYTORCH_NO_CUDA_MEMORY_CACHING", "PYTORCH_CUDA_ALLOC_CONF", "LD_PRELOAD"):
        env.pop(name, None)
    env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_WORKSPACE
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if layerswap_budget is not None:
        env["LAYERSWAP"] = "1"
        env["LAYERSWAP_BUDGET"] = str(int(layerswap_budget))
        env["LAYERSWAP_STATS"] = "1"
        env.update(extra or {})
    return env


class Runner:
    """Launches workers, one at a time, each with a time limit; keeps the tail of each one's output."""

    def __init__(self, args, tmpdir):
        self.args = args
        self.tmpdir = pathlib.Path(tmpdir)
        self.count = 0
        self.start = time.perf_counter()

    def time_left(self):
        if not self.args.deadline:
            return math.inf
        return self.args.deadline - (time.perf_counter() - self.start)

    def run(self, side, run_cfg=None, env=None, tag=None, **extra):
        self.count += 1
        tag = tag or side
        limit = min(self.args.worker_timeout, self.time_left())
        if self.time_left() < 20:
            print(f"== {tag}: skipped, the --deadline of {self.args.deadline} s is (nearly) used up", flush=True)
            return {"side": side, "error": f"skipped: --deadline {self.args.deadline} s reached before this run",
                    "wall_s": 0.0}
        out_path = self.tmpdir / f"{self.count:02d}-{side}.json"
        spec = {"side": side, "run": run_cfg, "out": str(out_path), "tag": tag, "verbose": self.args.verbose,
                "profile_steps": getattr(self.args, "profile_steps", 0), **extra}
        spec_path = self.tmpdir / f"{self.count:02d}-{side}.spec.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(spec_path)]
        print(f"== [{time.perf_counter() - self.start:6.1f} s] {tag}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env or worker_env(), cwd=str(REPO), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        tail = collections.deque(maxlen=30)

        def pump():
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                print(f"   {line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group (start_new_session)
            rc = proc.wait()
        reader.join(timeout=5)
        wall = time.perf_counter() - t0
        result = read_result(out_path) or {"side": side, "error": None}
        if timed_out:
            result["error"] = (f"timed out after {limit:.0f} s (--worker-timeout {self.args.worker_timeout}, "
                               f"--deadline {self.args.deadline})")
        elif rc != 0 and not result.get("error"):
            result["error"] = f"worker exited with status {rc}" + (f" (signal {-rc})" if rc < 0 else "")
        if result.get("error"):
            result["output_tail"] = list(tail)[-15:]
        result["wall_s"] = wall
        print(f"   -> {tag}: {'ok' if not result.get('error') else 'FAILED: ' + result['error'][:300]} "
              f"({wall:.1f} s)", flush=True)
        return result


    def interleave(self, members, cycles, block):
        """--interleave: every member (a dict: key, side, run_cfg, tag, env, extra, and for a capped peer
        "uncapped", the member to start instead when it runs out of memory) runs as a live process, and they take
        turns, `block` steps each, in `cycles` rounds of rotating order (bench/lockstep.py). Returns {key: result}
        with results as run() gives them, and the order of turns under the key "order"."""
        import lockstep
        conductor = lockstep.Conductor(log=lambda line: print(line, flush=True))
        started = {}
        results = {}
        limit = max(30.0, min(self.args.worker_timeout, self.time_left()))

        def start(m):
            self.count += 1
            name = f"{self.count:02d}-{m['side']}"
            out_path = self.tmpdir / f"{name}.json"
            spec_path = self.tmpdir / f"{name}.spec.json"
            spec = {"side": m["side"], "run": m["run_cfg"], "out": str(out_path), "tag": m["tag"],
                    "verbose": self.args.verbose, **(m.get("extra") or {})}

            def cmd_for(fds):
                spec["lockstep"] = {**fds, "block": block}
                spec_path.write_text(json.dumps(spec))
                return [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(spec_path)]

            print(f"== [{time.perf_counter() - self.start:6.1f} s] {m['tag']} (interleaved)", flush=True)
            member = conductor.start(m["tag"], cmd_for, env=m.get("env") or worker_env(), cwd=str(REPO))
            started[member] = (m, out_path, time.perf_counter())
            return member

        def collect(member):
            m, out_path, t0 = started[member]
            result = read_result(out_path) or {"side": m["side"], "error": None}
            rc = member.proc.returncode
            if member.error and not result.get("error"):
                result["error"] = f"lockstep: {member.error}"
            elif rc not in (0, None) and not result.get("error"):
                result["error"] = f"worker exited with status {rc}" + (f" (signal {-rc})" if rc < 0 else "")
            if result.get("error"):
                result["output_tail"] = list(member.tail)[-15:]
            result["wall_s"] = time.perf_counter() - t0
            result["turns"] = member.turns
            return result

        def on_failure(member):
            m = started[member][0]
            results[m["key"]] = collect(member)
            if results[m["key"]].get("oom") and m.get("uncapped"):
                first = results[m["key"]]
                replacement = dict(m["uncapped"], first_error=first.get("error"))
                return start(replacement)
            return None

        try:
            ready = conductor.settle([start(m) for m in members], limit, on_failure)
            order = conductor.cycle(ready, cycles, limit)
        finally:
            conductor.close()
        for member, (m, _, _) in started.items():
            if member.done and (m["key"] not in results or m.get("first_error") is not None):
                r = collect(member)
                if m.get("first_error") is not None:
                    r["first_error"] = m["first_error"]
                    r["capped"] = False
                results[m["key"]] = r
        results["order"] = order
        for key, r in results.items():
            if key != "order":
                tag = next((m["tag"] for m, _, _ in started.values() if m["key"] == key), str(key))
                print(f"   -> {tag}: {'ok' if not r.get('error') else 'FAILED: ' + r['error'][:300]} "
                      f"({r.get('turns', 0)} turns)", flush=True)
        return results


def read_result(path):
    """A worker's result file, or None when it wrote none (or half of one)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def median_step(res):
    tr = (res or {}).get("train") or {}
    return tr.get("median_step_s") if not (res or {}).get("error") else None


def compare_losses(ref, other):
    """(bitwise_equal, first_differing_step): over the steps both ran; None when either has no losses, False
    when the other run stopped early."""
    a = ((ref or {}).get("train") or {}).get("losses_hex") or []
    b = ((other or {}).get("train") or {}).get("losses_hex") or []
    if not a or not b:
        return None, None
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return False, k + 1
    if len(b) < len(a):
        return False, len(b) + 1
    return True, None


def parse_cases(text, quick):
    """'llama-lora:0.25:0.1,unet' -> [(case, [fractions])]."""
    out = []
    for item in (text or ",".join(CASES)).split(","):
        item = item.strip()
        if not item:
            continue
        name, *fr = item.split(":")
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}; the cases are {', '.join(CASES)}")
        fractions = [float(f) for f in fr] or list(FRACTIONS)
        for f in fractions:
            if not 0 < f <= 1:
                raise SystemExit(f"budget fraction {f} is not in (0, 1]")
        out.append((name, fractions))
    return out


class NoGPU(Exception):
    pass


NO_GPU_MESSAGE = ("no CUDA GPU is visible: bench/swap.py measures layerswap on a GPU; `--quick --device cpu` smoke-"
                  "tests the harness on a CPU and `--self-test` runs its CPU tests")


def run_all(args, save=lambda res: None, runner_class=None):
    """Runs every side of every case; calls save(res) after each case so that a run cut short leaves its
    results so far. `runner_class` (default Runner) launches the workers; the self-test passes a fake one."""
    cuda = args.device.startswith("cuda")
    sides = set(args.sides.split(","))
    unknown = sides - {"layerswap", *PEERS}
    if unknown:
        raise SystemExit(f"unknown side(s) {sorted(unknown)}: choose from layerswap, {', '.join(PEERS)}")
    plan = parse_cases(args.cases, args.quick)
    peer_cases = set(args.peer_cases.split(",")) if args.peer_cases else set()
    margin = int(args.margin_mib * MIB)
    pin = args.pin_threads or bool(args.pin_cores)  # --pin-cores implies --pin-threads
    res = {"benchmark": "swap", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": args.device, "quick": bool(args.quick), "h2d_gbps": None, "d2h_gbps": None,
           "settings": {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seq": args.seq,
                        "seed": args.seed, "margin_bytes": margin, "margin_share": args.margin_share,
                        "fractions": {c: f for c, f in plan},
                        "peer_cases": sorted(peer_cases), "peer_fraction": args.peer_fraction,
                        "worker_timeout_s": args.worker_timeout, "deadline_s": args.deadline,
                        "pin_threads": pin, "pin_cores": args.pin_cores or None,
                        "cublas_workspace_config": (f"{CUBLAS_DETERMINISTIC_WORKSPACE} throughout"
                                                    if args.keep_cublas_config else
                                                    f"{CUBLAS_DETERMINISTIC_WORKSPACE} for the first step, then "
                                                    "unset on sm90 (the same workspace; each worker's train record "
                                                    "says what it did)"),
                        "interleave_cycles": args.interleave or None,
                        "interleave_block": args.block if args.interleave else None,
                        "variants": {name: env for name, env in args.variant} or None,
                        "budget_rule": "budget = fraction * movable + transient + margin, rounded up to 2 MiB; "
                                       "margin = max(margin_bytes, margin_share * transient); "
                                       "movable = parameter + gradient + optimizer-state bytes; transient = the "
                                       "resident run's peak of allocated minus the movable bytes allocated at that "
                                       "moment (see swap_budget in bench/swap.py)",
                        "bound_rule": "bound_s = max(resident_step_s, S / B_h2d); S = steady-state H2D bytes of "
                                      "a Belady schedule of the step's accesses in fraction * movable bytes "
                                      "(see belady_traffic); B_h2d = the higher of the H2D measurements at the "
                                      "run's start and end (h2d_gbps_runs; see settle_bandwidth)",
                        "peak_vram": "peers: torch.cuda.max_memory_reserved over the training steps (the cap is "
                                     "enforced on reserved memory); setup, which builds the model on the device "
                                     "for identical initial weights, is not counted"},
           "models": {}, "cases": [], "notes": []}
    with tempfile.TemporaryDirectory(prefix="layerswap-swap-") as tmpdir:
        runner = (runner_class or Runner)(args, tmpdir)
        if cuda:
            h2d = runner.run("h2d", reps=10 if args.quick else 20)
            if "no CUDA GPU is visible" in (h2d.get("error") or ""):
                raise NoGPU()
            if h2d.get("error"):
                res["notes"].append(f"H2D measurement failed: {h2d['error']}")
            else:
                res.update({k: h2d[k] for k in ("device", "h2d_gbps", "d2h_gbps", "torch", "cuda")})
        else:
            res["notes"].append("CPU run: no H2D bandwidth, no bound_s, no layerswap side; the peers run as logic "
                                "checks (no streams, no memory figures)")
        for case, fractions in plan:
            run_cfg = {"case": case, "device": args.device, "quick": args.quick, "steps": args.steps,
                       "warmup": args.warmup, "batch": args.batch, "seq": args.seq, "seed": args.seed,
                       "unet_batch": args.unet_batch, "unet_resolution": args.unet_resolution,
                       "llama": args.llama_size, "pin_threads": pin, "pin_cores": args.pin_cores,
                       "keep_cublas_config": args.keep_cublas_config, "adamw": args.adamw}
            resident = runner.run("resident", run_cfg, tag=f"{case} resident")
            res.setdefault("torch", resident.get("torch"))
            if res["device"] == args.device and resident.get("device"):
                res["device"] = resident["device"]
            model = {"resident_error": resident.get("error"), "describe": resident.get("describe"),
                     "params": resident.get("params"), "resident_step_s": median_step(resident),
                     "resident_peak_allocated": resident.get("peak_allocated"),
                     "resident_peak_reserved": resident.get("peak_reserved"),
                     "resident_losses_hex": (resident.get("train") or {}).get("losses_hex"),
                     "resident_step_times_s": (resident.get("train") or {}).get("step_times_s"),
                     "resident_gpu_profile": resident.get("gpu_profile"),
                     "groups": resident.get("groups")}
            res["models"][case] = model
            groups = resident.get("groups") or []
            movable = sum(g["frozen_bytes"] + g["trainable_bytes"] + g["grad_bytes"] + g["state_bytes"]
                          for g in groups)
            param_bytes = sum(g["frozen_bytes"] + g["trainable_bytes"] for g in groups)
            model.update({"param_bytes": param_bytes, "movable_bytes": movable})
            peak = resident.get("peak_allocated")
            if resident.get("error") or not groups:
                for f in fractions:
                    res["cases"].append(empty_case(case, f, f"resident run failed: {resident.get('error')}"))
                continue
            if peak is None:  # CPU: no allocator statistics; budgets are still computed for the record
                model["notes"] = "no device memory statistics (CPU): transient taken as 0"
                transient = 0
            else:
                transient = resident.get("transient_bytes", max(0, peak - movable))
                model["transient_naive_bytes"] = max(0, peak - movable)
            model["transient_bytes"] = transient
            rounds_case = None  # the peer case, which --rounds repeats
            interleaved = []    # --interleave: the cases whose sides take turns once every fraction is set up
            for f in fractions:
                budget = swap_budget(f, movable, transient, margin, margin_share=args.margin_share)
                bel = belady_traffic(groups, budget["capacity_bytes"])
                c = empty_case(case, f, None)
                c.update({"budget_bytes": budget["budget_bytes"], "budget": budget,
                          "resident_step_s": model["resident_step_s"],
                          "belady_h2d_bytes_per_step": bel["h2d_bytes"],
                          "belady_d2h_bytes_per_step": bel["d2h_bytes"]})
                if res["h2d_gbps"] and model["resident_step_s"] is not None:
                    c["bound_s"] = max(model["resident_step_s"], bel["h2d_bytes"] / (res["h2d_gbps"] * 1e9))
                if args.interleave:
                    interleaved.append((c, f, budget))
                    res["cases"].append(c)
                    continue
                if "layerswap" in sides:
                    if not cuda:
                        c["error"] = "skipped: the layerswap side needs a CUDA GPU"
                    else:
                        ls = runner.run("layerswap", run_cfg, env=worker_env(budget["budget_bytes"], args.ls_env),
                                        tag=f"{case} layerswap {f:g}", budget_bytes=budget["budget_bytes"])
                        fill_layerswap(c, ls, resident)
                if case in peer_cases and math.isclose(f, args.peer_fraction):
                    peer_plan = {"capacity_bytes": budget["capacity_bytes"], "movable_bytes": movable}
                    rounds_case = (c, budget, peer_plan, f)
                    for peer in PEERS:
                        if peer in sides:
                            c["peers"][peer] = run_peer(runner, peer, run_cfg, budget, peer_plan, resident, cuda,
                                                        case, f)
                            p = c["peers"][peer]
                            if p.get("step_s") and c.get("step_s"):
                                p["layerswap_speedup"] = p["step_s"] / c["step_s"]  # >1: layerswap is faster
                res["cases"].append(c)
                save(res)
            if interleaved:
                interleave_case(runner, args, res, case, model, run_cfg, resident, interleaved, sides, cuda,
                                peer_cases)
                save(res)
                continue
            if cuda and args.resident_again:
                again = runner.run("resident", run_cfg, tag=f"{case} resident again")
                rerun_resident(res, case, model, median_step(again), again.get("error"))
                save(res)
            if cuda and args.rounds > 1 and rounds_case is not None:
                more_rounds(runner, args, res, case, model, run_cfg, resident, rounds_case, sides)
                save(res)
        if cuda and res["h2d_gbps"]:
            settle_bandwidth(res, runner.run("h2d", reps=10 if args.quick else 20))
            save(res)
    res["notes"] += [n for n in steal_notes(res) if n not in res["notes"]]
    return res


BANDWIDTH_NOTE_SHARE = 0.10  # start and end measurements further apart than this share get a note (settle_bandwidth)


def settle_bandwidth(res, end):
    """The H2D bandwidth of the bound is the higher of two measurements, at the run's start and at its end (`end`,
    the h2d worker's result). One measurement can come out low: session 48's run of the UNet and full fine-tuning
    measured 44.8 GB/s at its start, and the same machine 52.7 GB/s minutes later. A low one loosens every bound
    that S / B_h2d sets (full fine-tuning's at 25% and 10%). Both are kept (h2d_gbps_runs, d2h_gbps_runs), every
    case's bound follows the higher, and a note says when they differ by more than BANDWIDTH_NOTE_SHARE."""
    if end.get("error") or not end.get("h2d_gbps"):
        why = (end.get("error") or "no figure").splitlines()[0][:120]
        res["notes"].append(f"the H2D measurement at the run's end failed ({why}): the bounds use the start's")
        return
    start = res["h2d_gbps"]
    res["h2d_gbps_runs"] = [start, end["h2d_gbps"]]
    res["d2h_gbps_runs"] = [res["d2h_gbps"], end.get("d2h_gbps")]
    res["h2d_gbps"] = max(res["h2d_gbps_runs"])
    res["d2h_gbps"] = max(x for x in res["d2h_gbps_runs"] if x is not None)
    if res["h2d_gbps"] - min(res["h2d_gbps_runs"]) > BANDWIDTH_NOTE_SHARE * res["h2d_gbps"]:
        res["notes"].append(f"H2D measured {start:.1f} GB/s at the run's start and {end['h2d_gbps']:.1f} GB/s at its "
                            f"end: the bounds use {res['h2d_gbps']:.1f}")
    for c in res["cases"]:
        rebound(c, res["h2d_gbps"])


def rebound(c, h2d_gbps):
    """Case `c`'s bound with H2D bandwidth `h2d_gbps`: bound_s and step_over_bound, its variants' too."""
    resident, s_bytes = c.get("resident_step_s"), c.get("belady_h2d_bytes_per_step")
    if c.get("bound_s") is None or resident is None or s_bytes is None:
        return
    c["bound_s"] = max(resident, s_bytes / (h2d_gbps * 1e9))
    c["step_over_bound"] = c["step_s"] / c["bound_s"] if c.get("step_s") else None
    for v in (c.get("variants") or {}).values():
        v["bound_s"] = c["bound_s"]
        v["step_over_bound"] = v["step_s"] / v["bound_s"] if v.get("step_s") else None


def same_build_note(c, name, v):
    """A note when variant `name` of case `c` sets PYTHONPATH (another install of layerswap) but loaded layerswap from
    where the default side did: its comparison is then of a build with itself (session 43: the second install had
    failed, and both sides ran the new build). None when it loaded another one, or either path is unknown."""
    path, default = v.get("layerswap_module"), c.get("layerswap_module")
    if "PYTHONPATH" not in (v.get("env") or {}) or not path or path != default:
        return None
    return (f"{c['model']} {c['budget_fraction']:g}: variant {name} sets PYTHONPATH={v['env']['PYTHONPATH']} but "
            f"loaded layerswap from {path}, as the default side did: it compares that build with itself")


DRIFT_NOTE_SHARE = 0.15  # an interleaved resident step further than this from the one alone gets a note (drift_note)


def drift_note(case, alone, interleaved):
    """A note when the interleaved resident step of `case` differs from its run alone by more than DRIFT_NOTE_SHARE:
    the host's speed changed within the run (session 48's record: 0.115 s alone, 0.149 s interleaved), so its steps
    and bounds are not comparable with other runs'; the paired ratios, cycle by cycle, still are. None otherwise."""
    if not alone or not interleaved or abs(interleaved / alone - 1) <= DRIFT_NOTE_SHARE:
        return None
    return (f"{case}: the resident step took {alone:.4f} s alone and {interleaved:.4f} s interleaved "
            f"({interleaved / alone - 1:+.0%}): the host's speed changed within the run; compare its sides by the "
            f"paired figures, not its steps with other runs'")


STEAL_NOTE_SHARE = 0.05  # CPU steal above this share of the layerswap side's step gets a note (steal_notes)


def steal_notes(res):
    """Notes for the cases whose layerswap side lost more than STEAL_NOTE_SHARE of its step to the host (CPU steal,
    /proc/stat, summed over every CPU). A CPU-bound step then slows with no change of its own, so its ratios are not
    comparable with other runs' (session 29's first record: 52 ms a step, 1.30x the bound against 1.15x in the
    next call on another machine)."""
    notes = []
    for c in res.get("cases", []):
        steal, step = c.get("steal_s_per_step"), c.get("step_s")
        if steal is None or not step or steal <= STEAL_NOTE_SHARE * step:
            continue
        resident = c.get("resident_steal_s_per_step")
        resident = f"{resident * 1e3:.0f} ms" if resident is not None else "not measured"
        notes.append(f"{c['model']} {c['budget_fraction']:g}: the host took {steal * 1e3:.0f} ms of CPU time a step "
                     f"(steal) during the layerswap side, {steal / step:.0%} of its step (the resident side: "
                     f"{resident}); its figures are suspect, rerun on a quieter machine")
    return notes


def interleave_cycles(cycles, steps, warmup, block):
    """The cycles an interleaved side runs: --interleave's, or more, so that it makes at least --steps steps and
    the losses compare over as many as the resident run alone made (bench/perf_sides.py counts timed steps by it)."""
    return max(cycles, -(-(steps - warmup) // block))


def interleave_case(runner, args, res, case, model, run_cfg, resident, cases, sides, cuda, peer_cases):
    """--interleave N: the model's sides (the resident run again, layerswap at each fraction, the peers at the peer
    fraction) run as live processes that take turns, --block steps each, in N cycles of rotating order
    (bench/lockstep.py). The first resident run, alone before them, set the budgets and is the losses' reference;
    every step figure of the model comes from the interleaved processes: each side's step is the median of its
    timed steps that followed a step of its own (lockstep_medians), and the resident step is the interleaved
    resident's. Each case also gets paired ratios: per cycle, the median of the side's block against the median of
    the resident's block of the same cycle, and their median (`interleave`)."""
    cycles = interleave_cycles(args.interleave, args.steps, args.warmup, args.block)
    cfg = dict(run_cfg, steps=args.warmup + cycles * args.block)
    members = [{"key": "resident", "side": "resident", "run_cfg": cfg, "tag": f"{case} resident"}]
    for c, f, budget in cases:
        if "layerswap" in sides:
            if cuda:
                members.append({"key": ("layerswap", f), "side": "layerswap", "run_cfg": cfg,
                                "tag": f"{case} layerswap {f:g}",
                                "env": worker_env(budget["budget_bytes"], args.ls_env),
                                "extra": {"budget_bytes": budget["budget_bytes"]}})
                for name, env in args.variant:  # --variant: the same side with more environment, taking turns too
                    members.append(dict(members[-1], key=("variant", name, f), tag=f"{case} layerswap {f:g} [{name}]",
                                        env=dict(worker_env(budget["budget_bytes"], args.ls_env), **env)))
            else:
                c["error"] = "skipped: the layerswap side needs a CUDA GPU"
        if case in peer_cases and math.isclose(f, args.peer_fraction):
            peer_plan = {"capacity_bytes": budget["capacity_bytes"], "movable_bytes": model["movable_bytes"]}
            for peer in PEERS:
                if peer not in sides:
                    continue
                common = {"cap_bytes": budget["budget_bytes"], "peer_plan": peer_plan}
                uncapped = {"key": (peer, f), "side": peer, "run_cfg": cfg, "tag": f"{case} {peer} {f:g} (no cap)",
                            "extra": dict(common, enforce_cap=False)}
                members.append({"key": (peer, f), "side": peer, "run_cfg": cfg, "tag": f"{case} {peer} {f:g}",
                                "extra": dict(common, enforce_cap=cuda), "uncapped": uncapped if cuda else None})
    k = args.processes
    if cuda:
        fit = interleave_memory(members, k, resident)
        model["interleave_memory"] = fit
        if fit["need_bytes"] is not None and fit["need_bytes"] > fit["device_bytes"]:
            # Found on an 80 GB H100 (session 32): 3 processes of 6 LoRA sides filled the device and a peer's run
            # without the cap ran out of memory mid-run, losing that side's figures. Say so before running anything.
            error = interleave_memory_error(fit, k)
            for c, _, _ in cases:
                c["error"] = error
            print(f"   {error}", flush=True)
            return
    if k > 1:  # process 0 keeps the side's key; the others are (key, i)
        members = [m if i == 0 else dict(m, key=(m["key"], i), tag=f"{m['tag']} #{i}",
                                         uncapped=m.get("uncapped") and dict(m["uncapped"], key=(m["key"], i),
                                                                             tag=f"{m['uncapped']['tag']} #{i}"))
                   for m in members for i in range(k)]
    got = runner.interleave(members, cycles, args.block)

    def processes(key):
        return [got.get(key if i == 0 else (key, i)) or {"error": "the process did not start"} for i in range(k)]

    def blocks(key):  # per cycle: the process's block median; with K > 1, the median over the side's processes
        return pooled_blocks([block_medians(r) for r in processes(key)])

    def pool(summary, key):  # K > 1: the pooled step and every process's own figures (the rest is process 0's)
        if k == 1:
            return
        rs = processes(key)
        checks = [compare_losses(resident, r) for r in rs]
        summary["processes"] = [{"step_s": median_step(r), "error": r.get("error"), "losses_bitwise_equal": eq,
                                 "first_differing_step": first, "pid": r.get("pid")}
                                for r, (eq, first) in zip(rs, checks)]
        summary["first_differing_step"] = next((first for eq, first in checks if eq is False), None)
        pooled = [b for b in blocks(key) if b is not None]
        summary["step_s"] = statistics.median(pooled) if pooled and not any(r.get("error") for r in rs) else None
        summary["step_s_rule"] = f"pooled over {k} processes: the median over cycles of the processes' median block"
        eqs = [p["losses_bitwise_equal"] for p in summary["processes"]]
        summary["losses_bitwise_equal"] = None if None in eqs else all(eqs)
        summary["error"] = summary.get("error") or next((r["error"] for r in rs if r.get("error")), None)
        if "step_over_bound" in summary:
            bound = summary.get("bound_s")
            summary["step_over_bound"] = summary["step_s"] / bound if summary["step_s"] and bound else None

    again = got.get("resident") or {"error": "the interleaved resident run did not start"}
    model["interleave"] = {"cycles": cycles, "block": args.block, "processes_per_side": k, "order": got.get("order"),
                           "resident_step_s_alone": model["resident_step_s"],
                           "rule": "each side's step: the median of its timed steps that followed a step of its "
                                   "own (not a pause); ratios_per_cycle: the side's block median over the resident's "
                                   "block median of the same cycle"}
    if again.get("error"):
        model["interleave"]["resident_error"] = again["error"]
    eq, first = compare_losses(resident, again)
    model["interleave"]["resident_losses_equal_alone"] = eq
    import lockstep
    spans = {str(k): (((r.get("train") or {}).get("lockstep") or {}).get("spans") or [])
             for k, r in got.items() if k != "order"}
    model["interleave"]["overlapping_turns"] = lockstep.overlaps(spans)  # 0: one side at a time, as meant
    resident_blocks = blocks("resident")
    resident_step = median_step(again)
    if k > 1:
        resident_pool = {}
        pool(resident_pool, "resident")
        model["interleave"]["resident_processes"] = resident_pool["processes"]
        resident_step = resident_pool["step_s"]
    model["interleave"]["resident_block_position_s"] = block_positions(processes("resident"))
    for c, f, _ in cases:
        ls = got.get(("layerswap", f))
        if ls is not None:
            fill_layerswap(c, ls, resident, timing=again)
            pool(c, ("layerswap", f))
            c["phase_s"] = pooled_phases(processes(("layerswap", f)))
            c["resident_phase_s"] = pooled_phases(processes("resident"))
            c["interleave"] = paired_ratios(blocks(("layerswap", f)), resident_blocks)
            c["interleave"]["block_position_s"] = block_positions(processes(("layerswap", f)))
        for name, env in args.variant:
            key = ("variant", name, f)
            if got.get(key) is None:
                continue
            v = {"env": env, "bound_s": None}  # set with the case's, below
            fill_layerswap(v, got[key], resident, timing=again)
            v.pop("layerswap_stats", None)  # the whole stats dict: the default side keeps it
            pool(v, key)
            v["phase_s"] = pooled_phases(processes(key))
            v["interleave"] = paired_ratios(blocks(key), resident_blocks)
            v["interleave"]["block_position_s"] = block_positions(processes(key))
            # Per cycle, the variant's block against the default layerswap side's: > 1, the variant is slower.
            v["against_layerswap"] = paired_ratios(blocks(key), blocks(("layerswap", f)))
            c.setdefault("variants", {})[name] = v
            note = same_build_note(c, name, v)
            if note and note not in res["notes"]:
                res["notes"].append(note)
        for peer in PEERS:
            r = got.get((peer, f))
            if r is None:
                continue
            capped = r.get("capped", cuda)
            p = peer_summary(r, c["budget_bytes"], capped, resident, cuda, r.get("first_error"))
            pool(p, (peer, f))
            p["phase_s"] = pooled_phases(processes((peer, f)))
            p["interleave"] = paired_ratios(blocks((peer, f)), resident_blocks)
            p["interleave"]["block_position_s"] = block_positions(processes((peer, f)))
            if ls is not None:
                p["interleave"]["layerswap_speedup"] = paired_ratios(blocks((peer, f)), blocks(("layerswap", f)))
            c["peers"][peer] = p
    model["resident_step_s_runs"] = [resident_step]
    if resident_step is not None:
        set_resident(res, case, model, resident_step)
    note = drift_note(case, model["interleave"]["resident_step_s_alone"], resident_step)
    if note:
        res["notes"].append(note)
    for c, _, _ in cases:
        for p in c["peers"].values():
            if p.get("step_s") and c.get("step_s"):
                p["layerswap_speedup"] = p["step_s"] / c["step_s"]  # >1: layerswap is faster
        for v in (c.get("variants") or {}).values():  # the bound of the interleaved resident, as the case's
            v["bound_s"] = c.get("bound_s")
            v["step_over_bound"] = v["step_s"] / v["bound_s"] if v.get("step_s") and v["bound_s"] else None


INTERLEAVE_MEMORY_SLACK = 0.97  # the share of the device's memory the interleaved processes may plan to hold


def interleave_memory(members, k, resident):
    """The device memory an interleaved run of `members` (each run in `k` processes) will hold at most, all processes
    being alive at once: the resident side its run's peak reserved memory; a layerswap side its budget; a peer its
    cap or, since a peer that runs out of memory under the cap runs again without it, the resident peak if larger;
    and every process the memory a process holds besides its allocator's cache (CUDA context, libraries), measured by
    the resident run alone (`process_overhead_bytes`). need_bytes is None when the resident run measured too little."""
    peak = resident.get("peak_reserved")
    overhead = resident.get("process_overhead_bytes")
    device = resident.get("total_memory")
    if peak is None or overhead is None or not device:
        return {"need_bytes": None, "device_bytes": device, "sides": {}}
    sides = {}
    for m in members:
        extra = m.get("extra") or {}
        if m["side"] == "resident":
            held = peak
        elif m["side"] == "layerswap":
            held = extra.get("budget_bytes") or peak
        else:
            held = max(extra.get("cap_bytes") or 0, peak)
        sides[m["tag"]] = (held + overhead) * k
    return {"need_bytes": sum(sides.values()), "device_bytes": int(device * INTERLEAVE_MEMORY_SLACK),
            "process_overhead_bytes": overhead, "processes_per_side": k, "sides": sides}


def interleave_memory_error(fit, k):
    """The error of an interleaved run that would not fit the device: what it needs, and the --processes that fit."""
    per_process = fit["need_bytes"] / k
    fits = int(fit["device_bytes"] // per_process)
    fix = (f"run it with --processes {fits}" if fits >= 1 else "run fewer sides or cases at a time (--sides, --cases)")
    return (f"not run: {k} processes of each of {len(fit['sides'])} sides would hold up to {gb(fit['need_bytes'])} of "
            f"device memory together (each process {gb(fit['process_overhead_bytes'])} besides its allocator; the "
            f"peers counted at their uncapped size), over the {gb(fit['device_bytes'])} planned for "
            f"({INTERLEAVE_MEMORY_SLACK:.0%} of the device); {fix}")


def lockstep_blocks(r):
    """The step times of each block of an interleaved process's run `r` (lockstep_medians); [] for none."""
    return (((r or {}).get("train") or {}).get("lockstep") or {}).get("blocks") or []


def block_medians(r):
    """Per block of an interleaved run: the median of its steps after the first (the first follows a pause)."""
    return [statistics.median(b[1:]) if len(b) > 1 else None for b in lockstep_blocks(r)]


def block_positions(records):
    """Per place in an interleaved block (0: the step after a pause, which the figures leave out), the median of
    that step's time over every block of every process in `records`: whether a side takes more than one step to
    settle after a pause, which the block medians would then carry (None where no block reached that place)."""
    by_place = []
    for r in records:
        for b in lockstep_blocks(r):
            for j, t in enumerate(b):
                if j == len(by_place):
                    by_place.append([])
                by_place[j].append(t)
    return [statistics.median(ts) if ts else None for ts in by_place]


def pooled_blocks(per_process):
    """Per cycle, the median over processes of their block medians (None where every process lacks the block)."""
    out = []
    for i in range(max((len(b) for b in per_process), default=0)):
        xs = [b[i] for b in per_process if i < len(b) and b[i] is not None]
        out.append(statistics.median(xs) if xs else None)
    return out


def paired_ratios(side, ref):
    """Per cycle, side / ref of the blocks' medians; their median and quartiles."""
    ratios = [a / b for a, b in zip(side, ref) if a and b]
    out = {"ratios_per_cycle": ratios, "median_ratio": statistics.median(ratios) if ratios else None}
    if len(ratios) >= 4:
        q = statistics.quantiles(ratios, n=4)
        out["quartiles"] = [q[0], q[2]]
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def more_rounds(runner, args, res, case, model, run_cfg, resident, rounds_case, sides):
    """--rounds N: the peer case's sides (resident, layerswap, the peers) run N - 1 more times each, in rounds whose
    order rotates, so that the GPU machine's drift (its speed changes by 10-25% over a minute, even inside one
    process: bench/interference_probe.py) falls on every side alike. Each side's step becomes the mean of its runs'
    medians; the runs stay in step_s_runs (resident_step_s_runs for the resident side, whose mean every case of the
    model then uses for its bound). A run whose losses differ from the first resident run's makes its side's
    losses_bitwise_equal false."""
    c, budget, peer_plan, fraction = rounds_case
    runs = {"resident": list(model.get("resident_step_s_runs") or [model["resident_step_s"]]),
            "layerswap": [c.get("step_s")]}
    names = ["resident"] + (["layerswap"] if "layerswap" in sides else [])
    for peer in PEERS:
        if peer in c["peers"]:
            runs[peer] = [c["peers"][peer].get("step_s")]
            names.append(peer)
    for k in range(1, args.rounds):
        shift = k % len(names)
        for name in names[shift:] + names[:shift]:
            tag = f"{case} {name} {fraction:g} round {k + 1}"
            if name == "resident":
                r = runner.run("resident", run_cfg, tag=tag)
                runs["resident"].append(median_step(r))
                if compare_losses(resident, r)[0] is False:
                    model.setdefault("notes_rounds", []).append(f"resident round {k + 1}: losses differ from round 1")
            elif name == "layerswap":
                r = runner.run("layerswap", run_cfg, env=worker_env(budget["budget_bytes"], args.ls_env), tag=tag,
                               budget_bytes=budget["budget_bytes"])
                runs["layerswap"].append(median_step(r))
                if compare_losses(resident, r)[0] is not True:
                    c["losses_bitwise_equal"] = False
                    c.setdefault("errors_rounds", []).append(r.get("error") or f"round {k + 1}: losses differ")
            else:
                p = run_peer(runner, name, run_cfg, budget, peer_plan, resident, True, case, fraction,
                             capped=c["peers"][name].get("cap_enforced", True))
                runs[name].append(p.get("step_s"))
                if p.get("losses_bitwise_equal") is not True:
                    c["peers"][name]["losses_bitwise_equal"] = False
    model["resident_step_s_runs"] = runs["resident"]
    model["rounds"] = args.rounds
    set_resident(res, case, model, _mean(runs["resident"]))
    if "layerswap" in runs and c.get("step_s") is not None:
        c["step_s_runs"] = runs["layerswap"]
        c["step_s"] = _mean(runs["layerswap"])
        if c.get("bound_s"):
            c["step_over_bound"] = c["step_s"] / c["bound_s"]
    for peer, p in c["peers"].items():
        p["step_s_runs"] = runs.get(peer)
        p["step_s"] = _mean(runs.get(peer) or [])
        if p.get("step_s") and c.get("step_s"):
            p["layerswap_speedup"] = p["step_s"] / c["step_s"]


def rerun_resident(res, case, model, second_s, error):
    """--resident-again: the resident run repeated after the model's other sides (the GPU's speed drifts between
    runs: 0.16-0.19 s for one LoRA step within one call). The model's resident_step_s becomes the mean of both runs,
    each case's bound_s and step_over_bound follow, and the two runs stay in resident_step_s_runs. The losses are
    still compared with the first run's."""
    first_s = model["resident_step_s"]
    model["resident_step_s_runs"] = [first_s, second_s]
    if error or second_s is None or first_s is None:
        model["resident_again_error"] = error or "no step time"
        return
    set_resident(res, case, model, (first_s + second_s) / 2)


def set_resident(res, case, model, step_s):
    """The model's resident step becomes `step_s` (a mean of runs): every case of the model takes it, with its
    bound_s and step_over_bound."""
    model["resident_step_s"] = step_s
    for c in res["cases"]:
        if c["model"] != case:
            continue
        c["resident_step_s"] = model["resident_step_s"]
        c["resident_step_s_runs"] = model["resident_step_s_runs"]
        if res["h2d_gbps"]:
            rebound(c, res["h2d_gbps"])


def empty_case(case, fraction, error):
    return {"model": case, "mode": MODES[case], "budget_fraction": fraction, "budget_bytes": None,
            "step_s": None, "resident_step_s": None, "bound_s": None, "step_over_bound": None,
            "bytes_h2d_per_step": None, "belady_h2d_bytes_per_step": None, "belady_d2h_bytes_per_step": None,
            "hit_rate": None, "losses_bitwise_equal": None, "first_differing_step": None,
            "peak_vram_bytes": None, "error": error, "peers": {}}


def fill_layerswap(c, ls, resident, timing=None):
    """The layerswap side's figures in case `c`. The resident_* figures (phases, threads, steal) come from `timing`,
    the resident run that ran beside it (interleaved), else from `resident`; the losses are compared with `resident`."""
    train = ls.get("train") or {}
    train_resident = (timing or resident).get("train") or {}
    c["step_s"] = median_step(ls)
    c["layerswap_module"] = ls.get("layerswap_module")
    c["layerswap_source"] = ls.get("layerswap_source")  # bench/gpu_run.sh's hash of the sources it was built from
    # Where the step's time goes: the launching thread against the device; the tail: work on other streams.
    for key in ("median_issue_s", "median_cpu_s", "median_tail_s", "median_phase_s"):
        c[key.replace("median_", "")] = train.get(key)
        c["resident_" + key.replace("median_", "")] = train_resident.get(key)
    # Every thread's CPU per timed step (the autograd thread launches the backward; layerswap's own threads).
    c["threads_per_step"] = train.get("threads_per_step")
    c["resident_threads_per_step"] = train_resident.get("threads_per_step")
    c["steal_s_per_step"] = train.get("steal_s_per_step")
    c["steal_s_per_step_by_thread"] = train.get("steal_s_per_step_by_thread")
    c["resident_steal_s_per_step_by_thread"] = train_resident.get("steal_s_per_step_by_thread")
    c["pinned_threads"] = train.get("pinned_threads")  # {thread: core} under --pin-threads
    c["resident_steal_s_per_step"] = train_resident.get("steal_s_per_step")
    c["error"] = ls.get("error")
    if ls.get("output_tail"):
        c["output_tail"] = ls["output_tail"]
    traffic = ls.get("traffic") or {}
    c["bytes_h2d_per_step"] = traffic.get("bytes_h2d_per_step")
    c["bytes_d2h_per_step"] = traffic.get("bytes_d2h_per_step")
    c["hit_rate"] = traffic.get("hit_rate")
    for name in PER_STEP_STATS:
        if traffic.get(name + "_per_step") is not None:
            c[name + "_per_step"] = traffic[name + "_per_step"]
    c["hit_rate_timed"] = traffic.get("hit_rate_timed")  # the timed steps only (hit_rate: the whole run)
    if traffic.get("launch_attribution_per_step"):  # LAYERSWAP_TRACK=attribute
        c["launch_attribution_per_step"] = traffic["launch_attribution_per_step"]
    c["stats_sources"] = traffic.get("sources")
    c["layerswap_stats"] = ls.get("layerswap_stats")
    c["layerswap_enabled_by"] = ls.get("enabled_by")
    c["peak_vram_bytes"] = ls.get("peak_reserved")
    c["peak_allocated_bytes"] = ls.get("peak_allocated")
    c["losses_bitwise_equal"], c["first_differing_step"] = compare_losses(resident, ls)
    c["steps_run"] = len(train.get("losses_hex") or [])
    if c["step_s"] and c["bound_s"]:
        c["step_over_bound"] = c["step_s"] / c["bound_s"]


def run_peer(runner, peer, run_cfg, budget, peer_plan, resident, cuda, case, fraction, capped=True):
    """One run of a peer at the case's cap; one that runs out of memory under it runs again without it (recorded
    so). capped=False skips the capped attempt (a later round of a peer known to need more)."""
    cap = budget["budget_bytes"]
    common = dict(cap_bytes=cap, peer_plan=peer_plan)
    capped = cuda and capped
    suffix = "" if capped or not cuda else " (no cap)"
    r = runner.run(peer, run_cfg, tag=f"{case} {peer} {fraction:g}{suffix}", enforce_cap=capped, **common)
    first_error = None
    if cuda and r.get("oom"):
        first_error = r.get("error")
        r = runner.run(peer, run_cfg, tag=f"{case} {peer} {fraction:g} (no cap)", enforce_cap=False, **common)
        capped = False
    return peer_summary(r, cap, capped, resident, cuda, first_error)


def peer_summary(r, cap, capped, resident, cuda, first_error=None):
    """A peer's worker result as the case records it (run_peer, interleave_case)."""
    eq, first_diff = compare_losses(resident, r)
    peak = r.get("peak_reserved")
    out = {"step_s": median_step(r), "peak_vram_bytes": peak, "peak_allocated_bytes": r.get("peak_allocated"),
           "bytes_h2d_per_step": (r.get("peer_plan") or {}).get("bytes_h2d_per_step"),
           "cap_bytes": cap, "cap_enforced": capped,
           "within_cap": (peak <= cap) if (peak is not None and not r.get("error")) else None,
           "losses_bitwise_equal": eq, "first_differing_step": first_diff, "plan": r.get("peer_plan"),
           "error": r.get("error"), "step_times_s": (r.get("train") or {}).get("step_times_s"),
           "tail_s": (r.get("train") or {}).get("median_tail_s"),
           "phase_s": (r.get("train") or {}).get("median_phase_s")}
    if r.get("gpu_profile"):
        out["gpu_profile"] = r["gpu_profile"]
    if first_error:
        out["error_under_cap"] = first_error
    if not cuda:
        out["note"] = "CPU logic check: no streams, no memory figures; step_s is not a measurement"
    if r.get("output_tail"):
        out["output_tail"] = r["output_tail"]
    return out


# ---------------------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------------------

def gb(n, suffix=""):
    """Bytes in decimal units: 2.27G; smaller sizes (the --quick models) in M or K so they do not read 0.00G."""
    if n is None:
        return "-"
    if abs(n) >= 1e8 or n == 0:
        return f"{n / 1e9:.2f}G{suffix}"
    if abs(n) >= 1e5:
        return f"{n / 1e6:.1f}M{suffix}"
    return f"{n / 1e3:.1f}K{suffix}"


def sec(x):
    return "-" if x is None else f"{x:.4f}"


def launch_text(side):
    """The launching threads' figures of a layerswap side, per timed step: their waits for prefetches and, when the
    tracker timed them (not with LAYERSWAP_TRACK=0 or subscribe-only), their time inside the driver's launch calls
    (docs/swapping.md, "Reading the figures")."""
    waits = side.get("launch_wait_s_per_step")
    driver = side.get("launch_driver_s_per_step")
    text = f", launch waits {waits * 1e3:.1f} ms/step" if waits is not None else ""
    return text + (f", launches in the driver {driver * 1e3:.1f} ms/step" if driver else "")


def attribution_lines(side, slow_s=16e-6):
    """LAYERSWAP_TRACK=attribute: two report lines for a layerswap side (none without the figures). The launches a
    step by the engine's driver call they met (none: the engine was in no driver call), with their mean and total
    driver time, the largest totals first; and the launches whose driver part took at least `slow_s` (whole buckets
    of the histogram, from the first whose lower bound reaches it)."""
    a = side.get("launch_attribution_per_step")
    if not a:
        return []
    met = []
    for key, n in a.items():
        if key.startswith("launch_engine_") and key.endswith("_calls") and n > 0:
            kind = key[len("launch_engine_"):-len("_calls")]
            met.append((a.get(f"launch_engine_{kind}_s", 0.0), kind, n))
    met.sort(reverse=True)
    parts = [f"{kind} {n:.0f} x {s / n * 1e6:.1f} us = {s * 1e3:.1f} ms" for s, kind, n in met]
    slow_n = slow_t = 0.0
    lower = 0.0
    for b in range(64):
        if f"launch_hist_{b}_calls" not in a:
            break
        if lower >= slow_s:
            slow_n += a[f"launch_hist_{b}_calls"]
            slow_t += a.get(f"launch_hist_{b}_s", 0.0)
        lower = a.get(f"launch_hist_{b}_upper_s") or float("inf")
    return [f"launches a step by the engine's driver call they met: {'; '.join(parts)}",
            f"launches of {slow_s * 1e6:.0f} us or more in the driver: {slow_n:.1f} a step, {slow_t * 1e3:.2f} ms"]


def bitwise_text(side):
    """The table's word for a side's losses against the resident run: yes, NO@<first differing step>, or -."""
    return {True: "yes", False: f"NO@{side.get('first_differing_step')}", None: "-"}[side.get("losses_bitwise_equal")]


def error_text(side):
    """The first line of a peer's or variant's error, for the end of its line; empty without one."""
    return f"  error: {(side.get('error') or '').splitlines()[0][:70]}" if side.get("error") else ""


def print_table(res):
    print()
    q = "  [QUICK: tiny models, a smoke test, not a measurement]" if res["quick"] else ""
    print(f"layerswap swap benchmark: {res['device']}, torch {res.get('torch', '?')}, {res['date']}{q}")
    h2d = res.get("h2d_gbps")
    runs = res.get("h2d_gbps_runs")
    both = f"; the higher of {runs[0]:.1f} at the start and {runs[1]:.1f} at the end" if runs else ""
    print(f"H2D {h2d:.1f} GB/s, D2H {res.get('d2h_gbps') or 0:.1f} GB/s (pinned 256 MiB copies, median{both})" if h2d
          else "H2D: not measured")
    for case, m in res["models"].items():
        if m.get("resident_error"):
            print(f"  {case}: resident run failed: {m['resident_error']}")
            continue
        naive = f" (peak - movable: {gb(m['transient_naive_bytes'], 'B')})" if "transient_naive_bytes" in m else ""
        print(f"  {case}: {m.get('params') or 0:,} parameters; parameters {gb(m.get('param_bytes'), 'B')}, movable "
              f"{gb(m.get('movable_bytes'), 'B')}, transient {gb(m.get('transient_bytes'), 'B')}{naive}; resident step "
              f"{sec(m.get('resident_step_s'))} s, peak allocated {gb(m.get('resident_peak_allocated'), 'B')}")
        runs = m.get("resident_step_s_runs")
        il = m.get("interleave")
        if il:
            k = il.get("processes_per_side", 1)
            pooled = f" ({k} processes per side, pooled: per cycle the median of their blocks)" if k > 1 else ""
            print(f"    interleaved: {il['cycles']} cycles of {il['block']} steps per side{pooled}; the resident run "
                  f"alone took {sec(il.get('resident_step_s_alone'))} s, interleaved {sec(m.get('resident_step_s'))} s "
                  f"(its losses {'equal' if il.get('resident_losses_equal_alone') else 'DIFFER'}); turns that "
                  f"overlapped another side's: {il.get('overlapping_turns')}")
            for c in res["cases"]:
                sides = [("layerswap", c)] + list(c.get("peers", {}).items()) if c["model"] == case else []
                for side, x in sides:
                    if x.get("processes"):
                        print(f"      {side} {c['budget_fraction']:g}: processes "
                              f"{', '.join(sec(p['step_s']) for p in x['processes'])} s")
        elif runs and None not in runs and len(runs) > 2:
            print(f"    resident runs: {', '.join(sec(x) for x in runs)} s over {m.get('rounds')} rounds; the mean is "
                  f"the resident step")
        elif runs and None not in runs:
            print(f"    resident run before and after the other sides: {sec(runs[0])} s, {sec(runs[1])} s "
                  f"(spread {abs(runs[0] - runs[1]) / min(runs) * 100:.0f}%); the mean is the resident step")
    print()
    head = (f"{'case':<11} {'frac':>5} {'budget':>9} {'step s':>8} {'resident':>8} {'bound s':>8} {'step/bnd':>8} "
            f"{'H2D/step':>9} {'S/step':>8} {'hit':>6} {'bitwise':>7}  error")
    print(head)
    print("-" * len(head))
    for c in res["cases"]:
        ratio = f"{c['step_over_bound']:.2f}x" if c.get("step_over_bound") else "-"
        hit = f"{c['hit_rate']:.3f}" if c.get("hit_rate") is not None else "-"
        eq = bitwise_text(c)
        err = (c.get("error") or "").splitlines()[0][:60] if c.get("error") else ""
        print(f"{c['model']:<11} {c['budget_fraction']:>5.2f} {gb(c.get('budget_bytes')):>9} "
              f"{sec(c.get('step_s')):>8} {sec(c.get('resident_step_s')):>8} {sec(c.get('bound_s')):>8} {ratio:>8} "
              f"{gb(c.get('bytes_h2d_per_step')):>9} {gb(c.get('belady_h2d_bytes_per_step')):>8} {hit:>6} {eq:>7}"
              f"  {err}")
        il = c.get("interleave") or {}
        if il.get("median_ratio"):
            q = il.get("quartiles")
            print(f"    paired per cycle: step / resident median {il['median_ratio']:.3f}"
                  + (f" (quartiles {q[0]:.3f}-{q[1]:.3f})" if q else "") + f" over {len(il['ratios_per_cycle'])} cycles"
                  + launch_text(c))
        for line in attribution_lines(c):
            print(f"    {line}")
        for who, ph in (("resident", c.get("resident_phase_s")), ("layerswap", c.get("phase_s"))):
            if ph:
                print(f"    phases, {who}: {phase_text(ph)}")
        for name, v in (c.get("variants") or {}).items():
            eq = bitwise_text(v)
            env = ",".join(f"{k}={x}" for k, x in v["env"].items())
            vs = v.get("against_layerswap") or {}
            q = vs.get("quartiles")
            vs = (f", per cycle {vs['median_ratio']:.3f}x the default" + (f" (quartiles {q[0]:.3f}-{q[1]:.3f})" if q else "")
                  if vs.get("median_ratio") else "")
            err = error_text(v)
            print(f"    variant {name} ({env}): step {sec(v.get('step_s'))} s{vs}, bitwise {eq}{launch_text(v)}{err}")
            for line in attribution_lines(v):
                print(f"      {line}")
            if v.get("phase_s"):
                print(f"      phases: {phase_text(v['phase_s'])}")
        for name, p in c.get("peers", {}).items():
            eq = bitwise_text(p)
            speed = f", layerswap {p['layerswap_speedup']:.2f}x faster" if p.get("layerswap_speedup") else ""
            plan = p.get("plan") or {}
            res_blocks = plan.get("resident_blocks", plan.get("resident_blocks_planned"))
            within = {True: "within cap", False: "OVER cap", None: "cap n/a"}[p.get("within_cap")]
            err = error_text(p)
            under = "  (OOM under the cap; rerun without it)" if p.get("error_under_cap") else ""
            moved = f", H2D {gb(p['bytes_h2d_per_step'])}B/step" if p.get("bytes_h2d_per_step") is not None else ""
            pair = ((p.get("interleave") or {}).get("layerswap_speedup") or {}).get("median_ratio")
            pair = f" (paired per cycle {pair:.2f}x)" if pair else ""
            print(f"    peer {name:<24} step {sec(p.get('step_s'))} s, peak VRAM {gb(p.get('peak_vram_bytes'), 'B')} "
                  f"({within} {gb(p.get('cap_bytes'), 'B')}), resident blocks {res_blocks}{moved}, bitwise {eq}{speed}"
                  f"{pair}{under}{err}")
            if p.get("phase_s"):
                print(f"      phases: {phase_text(p['phase_s'])}")
    for note in res.get("notes", []):
        print(f"note: {note}")


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

def variant_pairs(text):
    """A --variant's VAR=VALUE list, split at commas; a piece with no '=' belongs to the value before it, so that a
    value may hold commas (LAYERSWAP_PIN=first:1,last:1). An empty piece, or a first one with no '=', is left
    without '=' for the caller to refuse."""
    pairs = []
    for piece in text.split(","):
        if piece and "=" not in piece and pairs:
            var, eq, value = pairs[-1]
            pairs[-1] = (var, eq, value + "," + piece)
        else:
            pairs.append(piece.partition("="))
    return pairs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="layerswap's swapping benchmark (issue 4): layerswap at budgets of "
                                            "50/25/10% against the resident run, the PCIe bound and two peers")
    p.add_argument("--cases", default=None,
                   help="comma-separated model[:fraction...], e.g. 'llama-lora:0.25,unet' (default: all three "
                        "models at 0.5, 0.25 and 0.1)")
    p.add_argument("--sides", default="layerswap," + ",".join(PEERS),
                   help="sides besides resident (default: layerswap,block_swap,accelerate_cpu_offload)")
    p.add_argument("--peer-cases", default="llama-lora", help="cases that run the peers (default llama-lora)")
    p.add_argument("--peer-fraction", type=float, default=0.25, help="the budget fraction of the peers (default 0.25)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test of the harness logic)")
    p.add_argument("--quick", action="store_true", help="tiny models and few steps: a smoke test")
    p.add_argument("--steps", type=int, default=None, help="training steps per run, warm-up included (default 30; "
                                                           "6 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default 5; 2 with --quick)")
    p.add_argument("--batch", type=int, default=None, help="Llama batch (default 1; 2 with --quick)")
    p.add_argument("--seq", type=int, default=None, help="Llama sequence length (default 1024; 32 with --quick)")
    p.add_argument("--llama-size", default="1b", choices=("1b", "3b"),
                   help="the Llama cases' model: 1b (~1.1 B, 22 layers, hidden 2048; default) or 3b (~2.8 B, 26 "
                        "layers, hidden 3072: DESIGN.md's peer model)")
    p.add_argument("--unet-batch", type=int, default=0, help="UNet batch (default: the model size's, 8)")
    p.add_argument("--unet-resolution", type=int, default=0, help="UNet resolution (default: the size's, 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adamw", choices=ADAMW_CHOICES, default="single",
                   help="the AdamW of llama-full and unet: single (foreach=False, the default), foreach or fused")
    p.add_argument("--pin-threads", action="store_true",
                   help="before the timed steps, give the Python thread, PyTorch's autograd thread and layerswap's "
                        "threads a core each and the other threads the rest, in every side (less noise between "
                        "runs)")
    p.add_argument("--pin-cores", default="", metavar="P,A,M,L",
                   help="with --pin-threads: the cores of the Python thread, the autograd thread, layerswap-move and "
                        "layerswap-learn (default: every other core from the third: 2,4,6,8)")
    p.add_argument("--keep-cublas-config", action="store_true",
                   help="keep CUBLAS_WORKSPACE_CONFIG set after the first step. By default every side unsets it "
                        "there on sm90, where that leaves cuBLAS the same workspace: PyTorch 2.11 compiles a regex "
                        "from it at every GEMM while it is set (bench/swap_models.py, Note [CUBLAS_WORKSPACE_CONFIG "
                        "after the first step])")
    p.add_argument("--margin-mib", type=float, default=None,
                   help="budget margin over fraction*movable + transient, MiB (default 256; 16 with --quick)")
    p.add_argument("--margin-share", type=float, default=0.0, metavar="S",
                   help="the margin is at least S times the transient bytes (default 0: --margin-mib alone). With "
                        "batches larger than the default, 0.1 leaves PyTorch's allocator room for its fragmentation "
                        "(5-8%% over its peak allocation on the Llama cases), so that the peers can run under the cap")
    p.add_argument("--ls-env", action="append", default=[], metavar="LAYERSWAP_X=V",
                   help="extra environment for the layerswap side (repeatable), e.g. LAYERSWAP_PREFETCH=2")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=V[,VAR=V...]",
                   help="with --interleave: another layerswap side at each fraction, with these variables added to its "
                        "environment (any variable: a LAYERSWAP_ setting, or PYTHONPATH for another build), taking "
                        "turns with the others; reported per case under 'variants', against the resident and the "
                        "default layerswap side cycle by cycle (repeatable: one side each); a piece with no '=' goes "
                        "on the value before it (LAYERSWAP_PIN=first:1,last:1)")
    p.add_argument("--worker-timeout", type=int, default=None, help="seconds allowed to one worker (default 180; "
                                                                     "120 with --quick)")
    p.add_argument("--resident-again", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, run each model's resident side again after its other sides and take the mean of "
                        "both runs as the resident step (default on; the GPU's speed drifts between runs)")
    p.add_argument("--rounds", type=int, default=1,
                   help="on a GPU, run the peer case's sides (resident, layerswap, peers) this many times each, in "
                        "rounds of rotating order, and take each side's mean (default 1)")
    p.add_argument("--interleave", type=int, default=0, metavar="CYCLES",
                   help="after each model's resident run, run all its other sides and the resident again as live "
                        "processes that take turns, --block steps each, in CYCLES rounds of rotating order "
                        "(bench/lockstep.py): the sides' timed steps interleave a few seconds apart, so the machine's "
                        "drift falls on all alike; every step figure then comes from these processes. CYCLES is "
                        "raised to make at least --steps steps (default 0: off, one process after another)")
    p.add_argument("--processes", type=int, default=1, metavar="K",
                   help="with --interleave: K processes of every side, all taking turns; a side's step and its paired "
                        "ratios are then pooled over its processes (per cycle, the median of their block medians), and "
                        "each process's step and losses check are kept (default 1). One process of a side can sit "
                        "5-13%% from another on the H200 (bench/process_spread.py). All the processes hold device "
                        "memory at once: a run that would not fit the device is refused after the resident run "
                        "alone, with the K that fits (the LoRA record's 6 sides: 3 on an H200, 2 on an 80 GB H100)")
    p.add_argument("--block", type=int, default=3,
                   help="with --interleave: steps per turn (default 3; the first of each is left out, it follows a "
                        "pause)")
    p.add_argument("--deadline", type=int, default=None,
                   help="seconds for the whole run: a worker gets at most the time left, and one that would start "
                        "with less than 20 s left is skipped and recorded so (default 540 on a GPU, 0 = none on a "
                        "CPU)")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/swap.json; swap_quick.json with "
                                               "--quick; swap_cpu.json on a CPU)")
    p.add_argument("--verbose", action="store_true", help="print every training step of every worker")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="diagnostic: profile N timed steps of the sides without layerswap with torch.profiler and "
                        "report their device busy time (slows those steps; not for the recorded results)")
    p.add_argument("--self-test", action="store_true", help="run the CPU self-tests and exit")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="merge result files of runs of different models on one device into --out, and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    defaults = {"steps": (30, 6), "warmup": (5, 2), "batch": (1, 2), "seq": (1024, 32), "margin_mib": (256, 16),
                "worker_timeout": (180, 120)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if not 0 <= args.margin_share < 1:
        p.error(f"--margin-share takes a share of the transient bytes in [0, 1), got {args.margin_share}")
    if args.steps < 2 or args.warmup < 1 or args.warmup >= args.steps:
        p.error("need --steps >= 2 and 1 <= --warmup < --steps")
    if args.interleave < 0 or (args.interleave and args.block < 2):
        p.error(f"--interleave takes a number of cycles >= 1 (0: off), got {args.interleave}, and --block a number of "
                f"steps >= 2, got {args.block}")
    if args.interleave and args.rounds > 1:
        p.error("--interleave and --rounds are two ways to repeat the sides: give one")
    if args.processes < 1 or (args.processes > 1 and not args.interleave):
        p.error(f"--processes takes a number of processes per side >= 1, got {args.processes}, and more than one "
                f"needs --interleave")
    env = {}
    for item in args.ls_env:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("LAYERSWAP_"):
            p.error(f"--ls-env takes LAYERSWAP_NAME=VALUE, not {item!r}")
        env[name] = value
    args.ls_env = env
    variants = []
    for item in args.variant:
        name, sep, rest = item.partition(":")
        pairs = variant_pairs(rest) if sep and rest else []
        if (not name or not all(ch.isalnum() or ch in "_.-" for ch in name) or not pairs
                or any(not eq or not var or not (var[0].isalpha() or var[0] == "_")
                       or not all(ch.isalnum() or ch == "_" for ch in var) for var, eq, _ in pairs)):
            p.error(f"--variant takes NAME:VAR=VALUE[,VAR=VALUE...] (NAME of letters, digits, '_', '.', '-'; a piece "
                    f"with no '=' goes on the value before it, as in LAYERSWAP_PIN=first:1,last:1), not {item!r}")
        if name in (n for n, _ in variants):
            p.error(f"--variant {name!r} is given twice")
        variants.append((name, {var: value for var, _, value in pairs}))
    if variants and not args.interleave:
        p.error("--variant needs --interleave: a variant is compared with the default side cycle by cycle")
    if variants and "layerswap" not in args.sides.split(","):
        p.error("--variant varies the layerswap side: --sides must include layerswap")
    args.variant = variants
    if args.deadline is None:
        args.deadline = 540 if args.device.startswith("cuda") else 0
    if args.out is None:
        name = "swap_cpu.json" if not args.device.startswith("cuda") else ("swap_quick.json" if q else "swap.json")
        args.out = str(HERE / "results" / name)
    return args


def merge_results(results, names):
    """One result from runs of different models on the same device (a full run can outlast one 10-minute call):
    the first run's fields, every run's cases and models, and each run's date, H2D/D2H bandwidth and cases under
    "runs". Each case keeps the bound its own run computed (with that run's H2D bandwidth)."""
    import copy
    merged = copy.deepcopy(results[0])
    merged["runs"] = []
    for name, r in zip(names, results):
        if r.get("device") != merged.get("device"):
            raise ValueError(f"{name}: device {r.get('device')!r}, not {merged.get('device')!r}: runs on different "
                             f"devices do not merge")
        merged["runs"].append({"file": str(name), "date": r.get("date"), "h2d_gbps": r.get("h2d_gbps"),
                               "h2d_gbps_runs": r.get("h2d_gbps_runs"),
                               "d2h_gbps": r.get("d2h_gbps"), "wall_s": r.get("wall_s"),
                               "cases": [f"{c['model']} {c['budget_fraction']:g}" for c in r.get("cases", [])]})
        if r is results[0]:
            continue
        both = set(r.get("models", {})) & set(merged.get("models", {}))
        if both:
            raise ValueError(f"{name}: model(s) {', '.join(sorted(both))} already in an earlier run")
        merged["models"].update(r.get("models", {}))
        merged["cases"].extend(r.get("cases", []))
        merged["notes"] = merged.get("notes", []) + [n for n in r.get("notes", []) if n not in merged.get("notes", [])]
    merged["wall_s"] = sum(r.get("wall_s") or 0 for r in results)
    return merged


def self_test_bandwidth():
    """settle_bandwidth: the bound follows the higher of the run's two H2D measurements."""
    def run(start, end, step=3.0):
        c = {"resident_step_s": 1.0, "belady_h2d_bytes_per_step": 4e9, "step_s": step, "bound_s": 4e9 / (start * 1e9),
             "step_over_bound": None, "variants": {"old": {"step_s": 6.0, "bound_s": None}}}
        res = {"h2d_gbps": start, "d2h_gbps": 5.0, "notes": [], "cases": [c, {"bound_s": None}]}
        settle_bandwidth(res, end)
        return res, c

    res, c = run(1.0, {"h2d_gbps": 2.0, "d2h_gbps": 4.0})
    assert res["h2d_gbps"] == 2.0 and res["h2d_gbps_runs"] == [1.0, 2.0] and res["d2h_gbps"] == 5.0, res
    assert c["bound_s"] == 2.0 and c["step_over_bound"] == 1.5, c
    assert c["variants"]["old"]["bound_s"] == 2.0 and c["variants"]["old"]["step_over_bound"] == 3.0, c
    assert len(res["notes"]) == 1 and "1.0 GB/s at the run's start" in res["notes"][0], res["notes"]
    res, c = run(2.0, {"h2d_gbps": 1.9, "d2h_gbps": 4.0})  # within a tenth, and lower: the start's stays
    assert res["h2d_gbps"] == 2.0 and c["bound_s"] == 2.0 and not res["notes"], res
    res, c = run(8.0, {"h2d_gbps": 9.0, "d2h_gbps": 4.0})  # the resident step sets the bound either way
    assert c["bound_s"] == 1.0 and c["step_over_bound"] == 3.0, c
    res, c = run(1.0, {"error": "RuntimeError: boom\ntrace"})
    assert res["h2d_gbps"] == 1.0 and c["bound_s"] == 4.0 and "h2d_gbps_runs" not in res, res
    assert res["notes"] == ["the H2D measurement at the run's end failed (RuntimeError: boom): the bounds use the "
                            "start's"], res["notes"]
    return 13


def self_test_merge():
    a = {"device": "G", "date": "1", "h2d_gbps": 50.0, "models": {"m1": {}}, "notes": ["x"],
         "cases": [{"model": "m1", "budget_fraction": 0.5}], "wall_s": 10}
    b = {"device": "G", "date": "2", "h2d_gbps": 52.0, "models": {"m2": {}}, "notes": ["x", "y"],
         "cases": [{"model": "m2", "budget_fraction": 0.1}], "wall_s": 5}
    m = merge_results([a, b], ["a.json", "b.json"])
    assert [c["model"] for c in m["cases"]] == ["m1", "m2"] and set(m["models"]) == {"m1", "m2"}
    assert m["h2d_gbps"] == 50.0 and [r["h2d_gbps"] for r in m["runs"]] == [50.0, 52.0] and m["wall_s"] == 15
    assert m["runs"][1]["cases"] == ["m2 0.1"] and m["notes"] == ["x", "y"] and "runs" not in a
    for bad in ({**b, "device": "H"}, {**b, "models": {"m1": {}}}):
        try:
            merge_results([a, bad], ["a", "bad"])
        except ValueError:
            continue
        raise AssertionError("merged runs that must not merge")
    return 6


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker)
    if args.self_test:
        return self_test()
    if args.merge:
        try:
            res = merge_results([json.loads(pathlib.Path(f).read_text()) for f in args.merge], args.merge)
        except (OSError, ValueError) as e:
            print(f"swap.py --merge: {e}", file=sys.stderr)
            return 2
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
        print_table(res)
        print(f"\nwrote {args.out} (merged from {', '.join(args.merge)})")
        return 0
    t0 = time.perf_counter()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(res):
        res["wall_s"] = time.perf_counter() - t0
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
        tmp.replace(out)

    try:
        res = run_all(args, save)
    except NoGPU:
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    save(res)
    print_table(res)
    print(f"\nwrote {out} ({res['wall_s']:.0f} s in all)")
    failed = [c for c in res["cases"] if c.get("error") and not str(c["error"]).startswith("skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
