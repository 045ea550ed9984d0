"""Swapping on a GPU (issue 4): a model whose training state does not fit in LAYERSWAP_BUDGET trains anyway,
with losses bitwise equal to the same run on PyTorch's own allocator, and layerswap reports the bytes it moved.

Each run is a fresh `samples/train_transformer.py --deterministic` process (same seeds, deterministic algorithms):
  1. native, twice (the baseline must repeat bit for bit, or the comparison means nothing);
  2. layerswap with no budget (its own peak of device memory, with layerswap's page rounding);
  3. layerswap at budgets that hold 50% and 25% of the training state (parameters, gradients, AdamW state) plus
     the transient memory measured in 2, with the default placement (split segments, no cache reserve) and, at 25%,
     with the placement that was the default before session 42 (LAYERSWAP_SPLIT=0, LAYERSWAP_CACHE_RESERVE=auto);
  4. layerswap at 25% with the experimental settings that change where activations live (a reserve that follows the
     step, split segments and home segments, no cache reserve), which must be as exact.
Skips, saying so, without a GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "samples" / "train_transformer.py"

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible: the swapping tests need one", allow_module_level=True)

MODEL = ["--layers", "8", "--d-model", "1024", "--vocab", "8192", "--batch", "2", "--seq", "512"]
STEPS = 12
STATE_BYTES_PER_PARAM = 8  # bf16 parameter + bf16 gradient + AdamW's two bf16 moments
MiB = 1 << 20


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP")}
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def train(tmp_path, name, env):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(TRAIN), "--deterministic", "--steps", str(STEPS), "--json", str(out), *MODEL]
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"{name}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text()), proc


def residency(result):
    st = result.get("layerswap_stats") or {}
    return st.get("residency") or {}


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i + 1}: {x} vs {y}"
    return "none"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The native losses (checked to repeat) and the budget rule's inputs: the training state and the transient bytes
    of an unbudgeted layerswap run."""
    tmp_path = tmp_path_factory.mktemp("baseline")
    native1, _ = train(tmp_path, "native1", clean_env())
    native2, _ = train(tmp_path, "native2", clean_env())
    assert native1["losses_hex"] == native2["losses_hex"], (
        "two native runs differ: the baseline does not repeat, so no comparison is possible "
        f"({first_difference(native1['losses_hex'], native2['losses_hex'])})")
    full, _ = train(tmp_path, "layerswap-unbudgeted", clean_env(LAYERSWAP="1"))
    assert full["layerswap"], "LAYERSWAP=1 did not enable layerswap in the sample"
    assert full["losses_hex"] == native1["losses_hex"]
    state = native1["params"] * STATE_BYTES_PER_PARAM
    peak = full["layerswap_stats"]["device_bytes"]["peak"]
    return native1, state, max(peak - state, 0), peak


def budget_for(baseline, fraction):
    _, state, transient, _ = baseline
    return int(transient + fraction * state) + 64 * MiB


def test_training_under_budget_is_bitwise_equal(tmp_path, baseline):
    native1, state, _, peak = baseline
    lines = [f"params {native1['params']:,}, state {state / MiB:.0f} MiB, layerswap peak {peak / MiB:.0f} MiB"]
    former = {"LAYERSWAP_SPLIT": 0, "LAYERSWAP_CACHE_RESERVE": "auto"}  # the defaults before session 42
    for fraction, extra, what in ((0.5, {}, "default"), (0.25, {}, "default"), (0.25, former, "split off, auto")):
        budget = budget_for(baseline, fraction)
        run, proc = train(tmp_path, f"layerswap-{fraction}-{len(extra)}",
                          clean_env(LAYERSWAP_BUDGET=budget, LAYERSWAP_STATS=1, **extra))
        res = residency(run)
        held = run["layerswap_stats"]["device_bytes"]["peak"]
        lines.append(f"budget {fraction:.2f} ({what}): {budget / MiB:.0f} MiB, held peak {held / MiB:.0f} MiB, "
                     f"splits {run['layerswap_stats'].get('num_splits')}, "
                     f"h2d {res.get('bytes_h2d', 0) / MiB:.0f} MiB, d2h {res.get('bytes_d2h', 0) / MiB:.0f} MiB, "
                     f"evictions {res.get('evictions')}, prefetches {res.get('prefetches')}, "
                     f"abandoned {res.get('abandoned')}, step {run['median_step_s']:.4f} s "
                     f"(native {native1['median_step_s']:.4f} s)")
        assert held <= budget, f"budget {budget} exceeded: {held} bytes held"
        assert res.get("bytes_d2h", 0) > 0, f"nothing was evicted at budget {budget}\n{proc.stderr[-3000:]}"
        assert run["losses_hex"] == native1["losses_hex"], (
            f"losses under budget {budget} ({fraction:.0%} of the state, {what}) differ from the native run: "
            f"{first_difference(native1['losses_hex'], run['losses_hex'])}\n{proc.stderr[-3000:]}")
    print("\n" + "\n".join(lines))


def test_attribution_counts_every_timed_launch_once(tmp_path, baseline):
    """LAYERSWAP_TRACK=attribute at 25% (profiler/cupti_tracker.cpp, Note [Launches beside the engine's calls]):
    every launch whose time the tracker took is counted once under the engine's state it met and once in the
    histogram, some met the engine in a VMM call (it moved memory), LAYERSWAP_STATS prints them at exit, and the
    losses do not change."""
    native1 = baseline[0]
    budget = budget_for(baseline, 0.25)
    run, proc = train(tmp_path, "layerswap-attribute",
                      clean_env(LAYERSWAP_BUDGET=budget, LAYERSWAP_TRACK="attribute", LAYERSWAP_STATS=1))
    t = run.get("tracker_stats") or {}
    timed = t.get("launch_api_calls", 0)
    met = {k[len("launch_engine_"):-len("_calls")]: v for k, v in t.items()
           if k.startswith("launch_engine_") and k.endswith("_calls")}
    hist = [v for k, v in t.items() if k.startswith("launch_hist_") and k.endswith("_calls")]
    print(f"\nlaunches timed {timed}, by the engine's call they met {met}, histogram {hist}")
    assert timed > 0 and met and hist, f"no attribution figures in the tracker's stats\n{proc.stderr[-3000:]}"
    assert sum(met.values()) == timed, f"{sum(met.values())} launches attributed, {timed} timed"
    assert sum(hist) == timed, f"{sum(hist)} launches in the histogram, {timed} timed"
    assert residency(run).get("bytes_d2h", 0) > 0, "nothing was evicted: the test proves nothing"
    assert met.get("set_access", 0) + met.get("map", 0) + met.get("unmap", 0) > 0, (
        "no launch met one of the engine's VMM calls while it moved memory: the marking does not work")
    line = "layerswap: launches' time in the driver by the migration thread's driver call they met: "
    assert line in proc.stderr, f"LAYERSWAP_STATS=1 printed no attribution line\n{proc.stderr[-3000:]}"
    print([s for s in proc.stderr.splitlines() if s.startswith(line)][0])
    assert run["losses_hex"] == native1["losses_hex"], (
        f"losses with LAYERSWAP_TRACK=attribute differ from the native run: "
        f"{first_difference(native1['losses_hex'], run['losses_hex'])}\n{proc.stderr[-3000:]}")


def test_experimental_placement_under_budget_is_bitwise_equal(tmp_path, baseline):
    """LAYERSWAP_RESERVE=follow, LAYERSWAP_SPLIT=8 and no cache reserve at 25%: activations go into ranges of freed
    segments and into evicted weights' chunks at their home VAs (allocator/caching_allocator.cpp, Notes [Split
    segments] and [Home segments]), memory that a prefetch then takes back, and the reserve follows the step
    (allocator/residency.cpp, Note [Following reserve]). Losses must not change. (On the H200: ~2,800 splits, ~300
    home segments and ~190 rounds with a following reserve in 12 steps.)"""
    native1 = baseline[0]
    budget = budget_for(baseline, 0.25)
    env = clean_env(LAYERSWAP_BUDGET=budget, LAYERSWAP_STATS=1, LAYERSWAP_RESERVE="follow", LAYERSWAP_SPLIT=8,
                    LAYERSWAP_CACHE_RESERVE="none")
    run, proc = train(tmp_path, "layerswap-placement", env)
    st = run["layerswap_stats"]
    res = residency(run)
    held = st["device_bytes"]["peak"]
    print(f"\nbudget {budget / MiB:.0f} MiB, held peak {held / MiB:.0f} MiB, evictions {res.get('evictions')}, "
          f"splits {st.get('num_splits')}, spare splits {st.get('num_spare_splits')}, "
          f"home segments {st.get('num_home_segments')}, following rounds {res.get('reserve_followed')}")
    assert held <= budget, f"budget {budget} exceeded: {held} bytes held"
    assert res.get("bytes_d2h", 0) > 0, f"nothing was evicted at budget {budget}\n{proc.stderr[-3000:]}"
    assert st.get("num_splits", 0) > 0, "no allocation took a range of a split segment: the test proves nothing"
    assert st.get("num_home_segments", 0) > 0, "no segment was made at a spare's home: the test proves nothing"
    assert res.get("reserve_followed", 0) > 0, "the reserve never followed the step: the test proves nothing"
    assert run["losses_hex"] == native1["losses_hex"], (
        f"losses with the experimental placement differ from the native run: "
        f"{first_difference(native1['losses_hex'], run['losses_hex'])}\n{proc.stderr[-3000:]}")
