"""The Python package: public API, the torch autoload, the command line, and the README's settings table.

Runs without a GPU. Tests that need the built extension skip (pytest.importorskip("layerswap._C")); tests that
need the installed package (the torch.backends entry point) skip when it is not pip-installed; tests about the
absence of a GPU skip where one is visible, and their GPU counterparts skip where none is.
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

try:
    import layerswap
except ImportError:  # not installed: test the source tree (the extension-dependent tests then skip)
    sys.path.insert(0, str(REPO / "bindings" / "python"))
    import layerswap

from layerswap import _autoload, cli  # noqa: E402

PACKAGE_PARENT = str(Path(layerswap.__file__).resolve().parent.parent)
INSTALLED = any(ep.name == "layerswap" for ep in importlib.metadata.entry_points(group="torch.backends"))
TIMEOUT = 300  # seconds for one subprocess; `import torch` alone takes a few


def ext():
    pytest.importorskip("torch")  # first: the extension links against the libc10 that torch loads
    return pytest.importorskip("layerswap._C", reason="layerswap._C is not built (pip install . builds it)")


def needs_install():
    if not INSTALLED:
        pytest.skip("layerswap is not pip-installed: torch's entry point for it is not registered")


@pytest.fixture(scope="module")
def gpu():
    return ext().gpu_available()


@pytest.fixture
def no_gpu(gpu):
    if gpu:
        pytest.skip("a CUDA GPU is visible: this test is about running without one")


@pytest.fixture
def with_gpu(gpu):
    if not gpu:
        pytest.skip("no CUDA GPU is visible")


def clean_env(**extra):
    """The environment without any LAYERSWAP* variable, plus `extra`; the package importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP")}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    if not INSTALLED:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def python(*args, cwd=None, **env):
    return subprocess.run([sys.executable, *args], env=clean_env(**env), cwd=cwd, capture_output=True,
                          text=True, timeout=TIMEOUT)


# ---- the package itself: no GPU, no torch ----

def test_import_needs_no_gpu_and_no_torch():
    result = python("-c", "import sys, layerswap; print(layerswap.__version__, 'torch' in sys.modules, "
                          "layerswap.is_enabled())", CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [layerswap.__version__, "False", "False"]


def test_version_matches_pyproject():
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    assert match and match.group(1) == layerswap.__version__
    if INSTALLED:
        assert importlib.metadata.version("layerswap") == layerswap.__version__


@pytest.mark.parametrize("env, active", [
    ({}, False),
    ({"LAYERSWAP_BUDGET": "6GiB"}, True),
    ({"LAYERSWAP_BUDGET": "75%"}, True),
    ({"LAYERSWAP_BUDGET": "none"}, False),
    ({"LAYERSWAP_BUDGET": "None"}, False),
    ({"LAYERSWAP_BUDGET": ""}, False),
    ({"LAYERSWAP": "1"}, True),
    ({"LAYERSWAP": "yes"}, True),
    ({"LAYERSWAP": "ON"}, True),
    ({"LAYERSWAP": "true"}, True),
    ({"LAYERSWAP": "0"}, False),
    ({"LAYERSWAP": ""}, False),
    ({"LAYERSWAP": "0", "LAYERSWAP_BUDGET": "6GiB"}, False),
    ({"LAYERSWAP": "off", "LAYERSWAP_BUDGET": "6GiB"}, False),
    ({"LAYERSWAP": "maybe"}, True),  # a bad switch value is reported by the configuration, not ignored
    ({"LAYERSWAP_LOG": "info"}, False),
])
def test_autoload_is_requested_only_by_the_switch_or_a_budget(env, active):
    assert _autoload.requested(env) is active


@pytest.mark.parametrize("argv, expected", [
    (["train.py"], ([], "train.py", None, [])),
    (["train.py", "--budget", "3", "-m", "x"], ([], "train.py", None, ["--budget", "3", "-m", "x"])),
    (["--budget", "6GiB", "--log=info", "t.py", "a"], (["--budget", "6GiB", "--log=info"], "t.py", None, ["a"])),
    (["--set", "stats=1", "-m", "pkg.mod", "--x"], (["--set", "stats=1"], None, "pkg.mod", ["--x"])),
    (["-mpkg.mod", "a"], ([], None, "pkg.mod", ["a"])),
    (["--", "-odd.py", "a"], ([], "-odd.py", None, ["a"])),
    (["-h"], (["-h"], None, None, [])),
    ([], ([], None, None, [])),
])
def test_run_splits_its_options_from_the_scripts(argv, expected):
    assert cli._split_run(argv) == expected


def test_run_executes_the_script_as_main(tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import sys
        assert __name__ == "__main__"
        RESULT = list(sys.argv)
        if sys.argv[1:] == ["fail"]:
            raise KeyError("from the script")
        sys.exit(int(sys.argv[1]))
    """))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exit_info:
        cli._exec(str(script), None, ["7", "--budget", "1"])
    assert exit_info.value.code == 7
    assert sys.argv == [str(script), "7", "--budget", "1"]
    assert sys.path[0] == str(tmp_path)
    with pytest.raises(KeyError, match="from the script"):
        cli._exec(str(script), None, ["fail"])


def test_cli_help():
    for args in (["--help"], ["run", "--help"], ["config", "--help"], ["doctor", "--help"]):
        result = python("-m", "layerswap", *args)
        assert result.returncode == 0, result.stderr
        assert "usage:" in result.stdout
    assert "-m module" in python("-m", "layerswap", "run", "--help").stdout


def test_run_usage_errors_exit_2(tmp_path):
    result = python("-m", "layerswap", "run")
    assert result.returncode == 2
    assert "name a script to run" in result.stderr
    result = python("-m", "layerswap", "run", str(tmp_path / "missing.py"))
    assert result.returncode == 2
    assert "missing.py" in result.stderr
    result = python("-m", "layerswap", "run", "--bogus", "x.py")
    assert result.returncode == 2


# ---- the public API against the extension ----

def test_enable_rejects_an_unknown_keyword_with_a_suggestion():
    ext()
    with pytest.raises(TypeError, match=r"bugdet.*did you mean 'budget'"):
        layerswap.enable(bugdet="6GiB")
    with pytest.raises(TypeError, match=r"'log'"):
        layerswap.enable(logg="info")
    assert not layerswap.is_enabled()


def budget_row(_C):
    rows = {row[0]: row for row in _C.settings_table()}
    assert "LAYERSWAP_BUDGET" in rows
    return rows["LAYERSWAP_BUDGET"]


def test_bad_budget_names_the_variable_the_value_and_the_accepted_forms():
    _C = ext()
    accepted = budget_row(_C)[2]
    with pytest.raises(ValueError) as info:
        _C.check_settings({"LAYERSWAP_BUDGET": "6 gigs"})
    message = str(info.value)
    assert "LAYERSWAP_BUDGET" in message and "6 gigs" in message and accepted in message, message
    # enable() reports the same before anything else, GPU or not
    with pytest.raises(ValueError, match="LAYERSWAP_BUDGET"):
        layerswap.enable(budget="6 gigs")
    with pytest.raises(TypeError, match="75%"):
        layerswap.enable(budget=0.75)
    assert not layerswap.is_enabled()


def test_good_settings_are_accepted():
    _C = ext()
    for budget in ("6GiB", "6144MiB", "75%", str(6 << 30)):
        assert "LAYERSWAP_BUDGET" in _C.check_settings({"LAYERSWAP_BUDGET": budget})


def test_settings_table_is_complete():
    ext()
    table = layerswap.settings()
    names = [s.name for s in table]
    assert len(names) == len(set(names))
    for s in table:
        assert s.name == "LAYERSWAP" or s.name.startswith("LAYERSWAP_")
        assert s.default and s.accepted and s.help, s
    assert {"LAYERSWAP", "LAYERSWAP_BUDGET", "LAYERSWAP_LOG", "LAYERSWAP_STATS", "LAYERSWAP_VA_RESERVE"} <= set(names)
    # config() names every setting; in a process with no LAYERSWAP_ variable, each at its default.
    result = python("-c", "import json, layerswap; print(json.dumps(layerswap.config()))", CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    in_force = json.loads(result.stdout)
    assert set(in_force) == set(names), f"config() and the settings table differ: {set(in_force) ^ set(names)}"
    for s in table:
        assert in_force[s.name] == s.default, (s.name, in_force[s.name], s.default)


def readme_settings():
    """{name: default} from README.md's table rows that start with a `LAYERSWAP...` name."""
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) >= 3:
            match = re.fullmatch(r"`(LAYERSWAP(?:_[A-Z_]+)?)`", cells[0])
            if match:
                rows[match.group(1)] = cells[1].strip("`")
    return rows


def test_readme_documents_every_setting_with_its_default():
    documented = readme_settings()
    assert "LAYERSWAP_BUDGET" in documented, "README.md has no settings table"
    _C = ext()
    table = {row[0]: row[1] for row in _C.settings_table()}
    assert set(documented) == set(table), ("README.md's settings table and the code's differ: "
                                           f"only in README: {sorted(set(documented) - set(table))}, "
                                           f"only in code: {sorted(set(table) - set(documented))}")

    def norm(text):
        return re.sub(r"\s+", "", text).lower()

    for name, default in table.items():
        assert norm(documented[name]) == norm(default), f"{name}: README says {documented[name]!r}, code {default!r}"


def test_stats_when_not_enabled():
    ext()
    if not layerswap.is_enabled():
        assert layerswap.stats() == {}
        with pytest.raises(LookupError, match="no allocator for CUDA device 0"):
            layerswap.stats(0)


def test_config_command_prints_every_setting():
    _C = ext()
    result = python("-m", "layerswap", "config", "--verbose", LAYERSWAP_BUDGET="6GiB", LAYERSWAP_BUGDET="1")
    assert result.returncode == 0, result.stderr
    for row in _C.settings_table():
        assert row[0] in result.stdout
    assert "6GiB" in result.stdout
    assert "did you mean LAYERSWAP_BUDGET" in result.stdout + result.stderr


def test_config_command_reports_a_bad_value():
    ext()
    result = python("-m", "layerswap", "config", LAYERSWAP_BUDGET="bogus")
    assert result.returncode == 2
    assert "LAYERSWAP_BUDGET" in result.stderr and "bogus" in result.stderr


def test_doctor():
    ext()
    result = python("-m", "layerswap", "doctor")
    assert "torch" in result.stdout and "extension   loads" in result.stdout, result.stdout + result.stderr
    assert "GPU" in result.stdout
    assert result.returncode == 0, result.stdout + result.stderr


# ---- the torch autoload (the installed entry point) ----

def import_torch(code="import torch", **env):
    return python("-c", code, **env)


def test_autoload_does_nothing_when_not_asked():
    needs_install()
    ext()
    result = import_torch("import torch, sys; print('layerswap._C' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert "layerswap" not in result.stderr
    result = import_torch("import torch, sys; print('layerswap._C' in sys.modules)", LAYERSWAP="0",
                          LAYERSWAP_BUDGET="bogus")
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_autoload_fails_loudly_on_a_bad_setting():
    needs_install()
    ext()
    result = import_torch(LAYERSWAP_BUDGET="bogus")
    assert result.returncode != 0
    assert "LAYERSWAP_BUDGET" in result.stderr and "bogus" in result.stderr, result.stderr


def test_autoload_without_gpu_warns_and_continues(no_gpu):
    needs_install()
    result = import_torch("import torch, layerswap; print(torch.ones(2).sum().item(), layerswap.is_enabled())",
                          LAYERSWAP_BUDGET="6GiB", LAYERSWAP_BUGDET="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2.0", "False"]
    assert ("layerswap: LAYERSWAP_BUDGET is set but no CUDA GPU is visible; running without layerswap"
            in result.stderr), result.stderr
    assert "did you mean LAYERSWAP_BUDGET" in result.stderr
    assert result.stderr.count("no CUDA GPU is visible") == 1


def test_enable_without_gpu_says_so(no_gpu):
    result = python("-c", "import layerswap; layerswap.enable(budget='6GiB')")
    assert result.returncode != 0
    assert "no CUDA GPU is visible" in result.stderr and "layerswap needs one" in result.stderr, result.stderr


def test_run_without_gpu_exits_2(no_gpu, tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text("print('the script ran')\n")
    for env in ({}, {"LAYERSWAP_BUDGET": "6GiB"}):
        result = python("-m", "layerswap", "run", "--budget", "1GiB", str(script), **env)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "no CUDA GPU is visible" in result.stderr
        assert "the script ran" not in result.stdout
        assert result.stderr.count("no CUDA GPU is visible") == 1, result.stderr


# ---- with a GPU: the same paths succeed ----

def test_autoload_with_gpu_enables_layerswap(with_gpu):
    needs_install()
    code = ("import torch, layerswap\n"
            "x = torch.ones(1 << 20, device='cuda')\n"
            "s = layerswap.stats(0)\n"
            "print(layerswap.is_enabled(), s['allocated_bytes']['current'] >= x.numel() * 4)\n")
    result = import_torch(code, LAYERSWAP_BUDGET="2GiB")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


def test_enable_twice_and_too_late(with_gpu):
    code = textwrap.dedent("""
        import torch, layerswap
        layerswap.enable(budget="2GiB")
        x = torch.ones(1024, device="cuda")
        layerswap.enable(budget="2GiB")          # the same settings: a no-op
        try:
            layerswap.enable(budget="3GiB")      # different, after memory was handed out
        except RuntimeError as err:
            print("refused:", err)
        print(layerswap.is_enabled(), sorted(layerswap.stats()))
    """)
    result = python("-c", code)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "can no longer change" in result.stdout
    assert result.stdout.strip().endswith("True [0]")

    late = "import torch, layerswap\nx = torch.ones(1, device='cuda')\nlayerswap.enable()\n"
    result = python("-c", late)
    assert result.returncode != 0
    assert "already allocated by PyTorch's own allocator" in result.stderr, result.stderr
    assert "LAYERSWAP_BUDGET" in result.stderr


def test_run_with_gpu_propagates_the_exit_status(with_gpu, tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, layerswap
        x = torch.ones(1024, device="cuda")
        print("enabled", layerswap.is_enabled(), sys.argv[1:])
        sys.exit(3)
    """))
    result = python("-m", "layerswap", "run", "--budget", "1GiB", str(script), "--budget", "x")
    assert result.returncode == 3, result.stderr
    assert "enabled True ['--budget', 'x']" in result.stdout
