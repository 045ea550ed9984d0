"""The benchmark harnesses' own logic (no GPU): bench/swap.py's self-test (budgets, the Belady bound, the resident
rerun, the peers' bookkeeping, on a fake runner), bench/stack_top.py's and bench/swap_stats.py's, and the training
loop's per-thread CPU accounting, bench/tracker.py's interleaved estimate, and bench/launch_hook_probe.py's shim on a
fake driver and runtime."""
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", ["swap.py", "stack_top.py", "swap_stats.py", "tracker.py", "launch_hook_probe.py"])
def test_self_test(script):
    r = subprocess.run([sys.executable, str(BENCH / script), "--self-test"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_thread_time_per_step():
    pytest.importorskip("torch")  # bench/swap_models.py imports it
    sys.path.insert(0, str(BENCH))
    import swap_models

    before = {"1": ("python3", 1.0, 0.0), "2": ("pt_autograd_0", 2.0, 0.5)}
    after = {"1": ("python3", 1.4, 0.0), "2": ("pt_autograd_0", 3.0, 0.5), "3": ("layerswap-move", 0.2, 0.1)}
    got = swap_models.thread_time_per_step(before, after, 2)
    assert list(got) == ["pt_autograd_0", "python3", "layerswap-move"], got  # largest CPU first
    assert got["pt_autograd_0"]["cpu_s"] == pytest.approx(0.5) and got["python3"]["cpu_s"] == pytest.approx(0.2)
    assert got["layerswap-move"] == {"threads": 1, "cpu_s": pytest.approx(0.1), "runqueue_s": pytest.approx(0.05)}
    now = swap_models.thread_times()  # this process, on Linux
    assert any(name for name, _, _ in now.values()) and all(run >= 0 for _, run, _ in now.values())
    steal = swap_models.cpu_steal_s()
    assert steal is None or steal >= 0


def test_pin_threads(monkeypatch):
    pytest.importorskip("torch")
    sys.path.insert(0, str(BENCH))
    import threading

    import swap_models

    calls = []
    monkeypatch.setattr(swap_models.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(swap_models.os, "sched_setaffinity", lambda tid, cores: calls.append((tid, set(cores))))
    worker = threading.Thread(target=threading.Event().wait, args=(5,), name="other", daemon=True)
    worker.start()
    got = swap_models.pin_threads(log=lambda s: None)
    assert got == {"python": 2}  # the only busy thread here: the one that trains
    pinned = dict(calls)
    assert pinned[threading.get_native_id()] == {2}
    assert pinned[worker.native_id] == set(range(16)) - {2, 4, 6, 8}  # the others keep the rest
    calls.clear()
    assert swap_models.pin_threads("3,5,7,9", log=lambda s: None) == {"python": 3}
    with pytest.raises(ValueError, match="--pin-cores"):
        swap_models.pin_threads("1,2", log=lambda s: None)
    monkeypatch.setattr(swap_models.os, "sched_getaffinity", lambda pid: {0, 1})
    assert swap_models.pin_threads(log=lambda s: None) == {}  # too few cores: nothing pinned
