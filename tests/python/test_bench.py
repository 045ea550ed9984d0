"""The benchmark harnesses' own logic (no GPU): bench/swap.py's self-test (budgets, the Belady bound, the resident
rerun, the peers' bookkeeping, on a fake runner), bench/stack_top.py's and bench/swap_stats.py's, the training loop's
per-thread CPU accounting, step phases and CUBLAS_WORKSPACE_CONFIG rule, bench/tracker.py's interleaved estimate,
bench/launch_hook_probe.py's shim on a fake driver and runtime, the perf reports (bench/perf_report.py,
bench/perf_sides.py), bench/ddp_check.py's and bench/infer_check.py's arguments, where bench/gpu_run.sh logs, and
bench/chunk_log.py's counts."""
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def run_script(script, *args):
    """bench/`script` with `args`, its output captured."""
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300)


def assert_refused(script, refusals):
    """bench/`script` exits non-zero with `message` on stderr for each (args, message) of `refusals`."""
    for args, message in refusals:
        r = run_script(script, *args)
        assert r.returncode != 0 and message in r.stderr, (args, r.stderr)


def test_gpu_run_logs_stay_out_of_out_for_ensure_alone(tmp_path):
    """`ensure` alone logs outside $OUT (on the device machine the folder whose files come back, at most 8); any
    other step logs to $OUT; GPU_RUN_LOGS overrides both. GPU_RUN_DEADLINE=0 skips every step."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmp.mkdir()

    def logs_dir(*steps, **env):
        r = subprocess.run(["bash", str(BENCH / "gpu_run.sh"), *steps], capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "OUT": str(out), "TMPDIR": str(tmp),
                                "GPU_RUN_DEADLINE": "0", **env})
        line = next(line for line in r.stdout.splitlines() if line.startswith("gpu_run.sh: steps:"))
        return line.rsplit("logs in ", 1)[1]

    assert logs_dir("ensure") == str(tmp / "layerswap-gpu-run")
    assert list(out.iterdir()) == []
    assert logs_dir("ensure", "ctest") == str(out)
    assert logs_dir("pytest") == str(out)
    assert logs_dir("ensure", GPU_RUN_LOGS=str(tmp_path / "logs")) == str(tmp_path / "logs")


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


def test_drop_cublas_config(monkeypatch):
    """CUBLAS_WORKSPACE_CONFIG is unset after the first step only where PyTorch's default workspace is the one
    ":4096:8" asks for (sm90); anywhere else, or with another value, it stays (swap_models.drop_cublas_config)."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(BENCH))
    import os

    import swap_models
    import torch

    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert swap_models.drop_cublas_config("cuda") == "unset"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert swap_models.drop_cublas_config("cpu").startswith("kept :4096:8")
    capability[0] = (8, 0)
    assert swap_models.drop_cublas_config("cuda").startswith("kept :4096:8: sm80")
    capability[0] = (9, 0)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert swap_models.drop_cublas_config("cuda").startswith("kept :16:8")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert "then unset" in swap_models.drop_cublas_config("cuda")
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_phases_and_tails():
    pytest.importorskip("torch")
    sys.path.insert(0, str(BENCH))
    import swap
    import swap_models

    # Three steps of [wall, main CPU, autograd CPU] per phase; the autograd clock unknown in the first.
    steps = [[[1.0, 0.9, None], [2.0, 0.1, 1.8], [0.5, 0.5, None]],
             [[3.0, 2.9, 0.0], [4.0, 0.1, 3.9], [0.7, 0.7, 0.0]],
             [[5.0, 4.9, 0.0], [6.0, 0.1, 5.8], [0.9, 0.9, 0.0]]]
    got = swap_models.median_phases(steps)
    assert got["forward"] == [3.0, 2.9, 0.0] and got["backward"] == [4.0, 0.1, 3.9], got
    # A side that took turns: the warm-up step (0) and the first step after each pause (1, 3) are left out.
    record = {"lockstep": {"first_after_pause": [0, 1, 3]}, "step_times_s": [9, 9, 1, 9, 2],
              "tail_times_s": [9, 9, 0.001, 9, 0.003], "phase_times_s": [steps[0]] * 2 + [steps[1]] + [steps[0]]
              + [steps[2]]}
    swap.lockstep_medians(record, 1)
    assert record["median_step_s"] == 1.5 and record["median_tail_s"] == pytest.approx(0.002)
    assert record["median_phase_s"]["backward"] == [5.0, 0.1, 4.85], record["median_phase_s"]
    pooled = swap.pooled_phases([{"train": dict(record, warmup=1)}, {"train": {"warmup": 0, "phase_times_s": steps}}])
    assert pooled["optimizer"][0] == 0.7, pooled  # 0.7, 0.9 from the first; 0.5, 0.7, 0.9 from the second
    assert swap.pooled_phases([{"train": {}}]) is None
    assert "forward 3.0 ms (CPU: main 2.9, autograd 0.0)" in swap.phase_text(
        {k: [x / 1e3 for x in v] for k, v in got.items()})
    clock = swap_models.ThreadClock("no such thread")
    assert clock.path is None and clock() is None
    steal = swap_models.cpu_steal_by_core()
    assert all(s >= 0 for s in steal.values())


def test_perf_report_and_sides(tmp_path):
    sys.path.insert(0, str(BENCH))
    import json

    import perf_report
    import perf_sides

    lines = ["  python3   100/100  10.000000:  7f01  at::native::foo<float>(int) (/usr/lib/libtorch_cpu.so)",
             "  python3   100/100  10.001000:  7f02  layerswap::region_map::lookup+0x1c (/x/_C.cpython-312.so)",
             "  python3   100/100  99.000000:  7f02  layerswap::region_map::lookup (/x/_C.cpython-312.so)",
             "  pt_autograd_0 100/101  10.002000:  7f03  [unknown] (/usr/lib/libcupti.so.13)",
             "  python3   200/200  10.000000:  7f04  cuLaunchKernel (/usr/lib/libcuda.so.1)",
             "not a sample line"]
    threads = perf_report.aggregate(lines, {"100": (5.0, 20.0)})
    main = threads[("100", "100")]
    assert main["samples"] == 2 and main["windowed"]  # the sample at 99 s is outside process 100's window
    assert main["sym"]["_C.cpython-312.so layerswap::region_map::lookup"] == 1  # the offset is dropped
    assert threads[("100", "101")]["dso"]["libcupti.so.13"] == 1 and not threads[("200", "200")]["windowed"]
    swap_json = {"settings": {"interleave_cycles": 2, "interleave_block": 3, "steps": 8, "warmup": 2},
                 "models": {"m": {"interleave": {"resident_processes": [{"pid": 200}]}}},
                 "cases": [{"budget_fraction": 0.25, "processes": [{"pid": 100}],
                            "variants": {"idle": {"processes": [{"pid": 300}]}}, "peers": {}}]}
    assert perf_sides.side_pids(swap_json) == {200: "resident", 100: "layerswap 0.25", 300: "layerswap 0.25 [idle]"}
    assert perf_sides.timed_steps(swap_json) == 6
    perf = {"100/100": {"name": "python3", "seconds": 0.006, "windowed": True, "dso": {"_C.so": 6},
                        "sym": {"_C.so layerswap::region_map::lookup": 6}},
            "200/200": {"name": "python3", "seconds": 0.003, "windowed": True, "dso": {"libc10_cuda.so": 3},
                        "sym": {"libc10_cuda.so malloc": 3}}}
    (tmp_path / "swap.json").write_text(json.dumps(swap_json))
    (tmp_path / "perf.json").write_text(json.dumps(perf))
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert perf_sides.main([str(tmp_path / "swap.json"), str(tmp_path / "perf.json")]) == 0
    text = out.getvalue()
    assert "== main: resident 0.5, layerswap 0.25 1.0" in text, text  # 6 ms over 6 steps; 3 ms over 6
    assert "region_map::lookup" in text


def test_ddp_check_arguments():
    """bench/ddp_check.py: bad cases and GPU counts are refused with the form they should take; on a machine with
    fewer GPUs than asked it says so and checks nothing (exit 0); its case parser reads model:fraction[:wrap] lists."""
    assert_refused("ddp_check.py", [
        (["--cases", "unet:0.25"], "llama-full:F[:WRAP] or llama-lora:F[:WRAP]"),
        (["--cases", "llama-full:0.25:zero3"], "not one of ddp, ddp-views, fsdp, solo"),
        (["--cases", "llama-full:quarter"], "is not a number"),
        (["--cases", "llama-full:1.5"], "must be in (0, 1]"),
        (["--gpus", "1"], "at least 2 (only solo cases run on 1)"),
        (["--gpus", "0", "--cases", "llama-full:0.25:solo"], "--gpus: 0 is not a GPU count")])
    sys.path.insert(0, str(BENCH))
    import ddp_check

    assert ddp_check.parse_cases("llama-full:0.25, llama-lora:0.5:fsdp,llama-full:0.1:solo") == [
        ("llama-full", 0.25, "ddp"), ("llama-lora", 0.5, "fsdp"), ("llama-full", 0.1, "solo")]
    probe = lambda safe: {"nccl_probe": {"coalesced": {"safe": safe}}}  # noqa: E731
    assert ddp_check.fifo_unsafe_ranks({"per_rank": [{"rank": 0, **probe(True)}, {"rank": 1, **probe(False)}]}) == [1]
    no_probe = {"rank": 0, "nccl_probe": None}  # the resident side, or an older run
    assert ddp_check.fifo_unsafe_ranks({"per_rank": [no_probe, {"rank": 1, **probe(True)}]}) == []
    assert ddp_check.fifo_unsafe_ranks({"error": "torchrun exited with 1"}) == []
    if pytest.importorskip("torch").cuda.device_count() < 2:
        r = run_script("ddp_check.py", "--gpus", "2", "--steps", "4")
        assert r.returncode == 0 and "nothing checked" in r.stdout, r.stdout + r.stderr


def test_infer_check_arguments():
    """bench/infer_check.py: bad fractions, sides, devices and round counts are refused with the accepted forms, and
    two sides are equal only when every round's tokens and logits are."""
    assert_refused("infer_check.py", [
        (["--fractions", "0.25,half"], "'half' is not a number"),
        (["--fractions", "1.5"], "is not in (0, 1]"),
        (["--sides", "layerswap"], "give resident, optionally with layerswap"),
        (["--device", "cpu"], "layerswap runs on cuda only"),
        (["--rounds", "2", "--warmup", "2"], "at least one round must be timed"),
        (["--variants", "a:PREFETCH=1"], "is not LAYERSWAP_NAME=VALUE"),
        (["--variants", "a,a:LAYERSWAP_PREFETCH=2"], "a name of its own")])
    sys.path.insert(0, str(BENCH))
    import infer_check

    assert infer_check.parse_fractions("0.5, 0.25") == [0.5, 0.25]
    assert infer_check.parse_variants("default, pf1:LAYERSWAP_PREFETCH=1+LAYERSWAP_PIN=first:1") == [
        ("default", {}), ("pf1", {"LAYERSWAP_PREFETCH": "1", "LAYERSWAP_PIN": "first:1"})]
    a = {"rounds": [{"tokens": [1, 2], "logits_sha256": "x"}, {"tokens": [1, 2], "logits_sha256": "x"}]}
    assert infer_check.same_rounds(a, a)
    assert not infer_check.same_rounds(a, {"rounds": a["rounds"][:1]})
    assert infer_check.tuned_text(None) == ""
    assert infer_check.tuned_text({"prefetch_limit": 0, "prefetch_tunings": 0, "prefetch_tune_steps": 0}) == ""
    assert infer_check.tuned_text({"prefetch_limit": 16, "prefetch_tunings": 1, "prefetch_tune_steps": 12,
                                   "prefetch_tune_abandoned": 0}) == (
        "; tuned: 16 regions (tunings finished 1, abandoned 0, steps timed 12)")
    # layerswap.stats(device) keeps them under "residency" (bindings/python_module.cpp)
    snapshot = {"reserved_bytes": {"peak": 1}, "residency": {"prefetch_limit": 8, "prefetch_tunings": 1,
                                                             "prefetch_tune_steps": 9, "prefetch_tune_abandoned": 2}}
    assert infer_check.tuned_stats(snapshot) == {"prefetch_limit": 8, "prefetch_tunings": 1,
                                                 "prefetch_tune_steps": 9, "prefetch_tune_abandoned": 2}
    assert "tuned: 8 regions" in infer_check.tuned_text(infer_check.tuned_stats(snapshot))
    import swap
    assert infer_check.tuned_stats({}) == dict.fromkeys(swap.TUNE_LEVELS)
    assert "tuned: auto" in infer_check.tuned_text({"prefetch_limit": 0, "prefetch_tunings": 2,
                                                    "prefetch_tune_steps": 9})
    assert not infer_check.same_rounds(a, {"rounds": [a["rounds"][0], {"tokens": [1, 2], "logits_sha256": "y"}]})
    assert not infer_check.same_rounds(a, {"rounds": [a["rounds"][0], {"tokens": [1, 3], "logits_sha256": "x"}]})


def test_chunk_log_counts_the_programs_segments_by_step(tmp_path):
    """bench/chunk_log.py skips the lines before the step is learned (64th 0), starts a step where the 64th goes back,
    counts by what was made (composites of spares too) and by 64th, and --last keeps the last steps only."""
    def line(what, made, asked, phase):
        return (f"   layerswap: device 0: the program makes a {what} of {made} for {asked} (room 4.00 MiB, idle 0 B); "
                f"engine: 64th {phase}, reserve 2.64 GiB, unused 0 B; spares 0 B (none); evicting 0 (0 B), "
                f"prefetching 0 (0 B)\n")
    log = tmp_path / "debug.log"
    log.write_text("".join([
        line("chunk", "8.00 MiB", "8.00 MiB", 0),  # warm-up: not counted
        "   layerswap: something else, 64th 30\n",
        line("chunk", "126.00 MiB", "125.00 MiB", 22),  # step 1
        line("slab", "2.00 MiB", "1.00 MiB", 40),
        line("composite of spares", "132.00 MiB", "125.00 MiB", 22),  # step 2
        line("chunk", "12.00 MiB", "11.00 MiB", 22),
        line("chunk", "12.00 MiB", "11.00 MiB", 19),  # step 3
    ]))
    def lines_of(*args):
        r = run_script("chunk_log.py", *args)
        assert r.returncode == 0, r.stderr
        return [" ".join(text.split()) for text in r.stdout.splitlines()]
    out = lines_of(str(log))
    assert "segments the program made in each step once the step was learned: 2 2 1" in out, out
    assert "5 over the 3 steps below (at most 1.7 a step)" in out, out
    assert "composite of spares 132.00 MiB 1 (0.33)" in out, out
    assert "chunk 12.00 MiB 2 (0.67)" in out, out
    assert "64th 22 3 (1.00)" in out, out
    last = lines_of("--last", "1", str(log))
    assert "1 over the 1 steps below (at most 1.0 a step)" in last and "64th 19 1 (1.00)" in last, last
    assert not any("126.00 MiB" in text for text in last), last
    assert_refused("chunk_log.py", [(["--last", "-1", str(log)], "--last must be 0")])
