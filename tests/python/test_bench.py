"""The benchmark harnesses' own logic (no GPU): bench/swap.py's self-test (budgets, the Belady bound, the resident
rerun, the peers' bookkeeping, on a fake runner), bench/stack_top.py's and bench/swap_stats.py's."""
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", ["swap.py", "stack_top.py", "swap_stats.py"])
def test_self_test(script):
    r = subprocess.run([sys.executable, str(BENCH / script), "--self-test"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
