"""The ``layerswap`` command (also ``python -m layerswap``).

  layerswap run [--budget SIZE] [--log LEVEL] [--set NAME=VALUE] (script.py | -m module) [args ...]
  layerswap config [--verbose]
  layerswap doctor

``run`` enables layerswap, then runs the script as ``__main__`` exactly as ``python script.py args`` would (runpy),
so its exceptions and exit status come through unchanged. Everything after the script name (or ``-m module``)
belongs to the script: ``layerswap run train.py --budget 3`` passes ``--budget 3`` to train.py.
"""

import argparse
import os
import sys

import layerswap

_PREFIX = "LAYERSWAP_"

# Exit status when layerswap cannot start (no GPU, a bad setting, a bad command line), like a usage error.
EXIT_CANNOT_START = 2

_DESCRIPTION = """\
layerswap makes its CUDA caching allocator (CUDA virtual memory) PyTorch's, with no change to the program.
Settings are environment variables (see `layerswap config`); setting LAYERSWAP_BUDGET is enough to turn
layerswap on for any Python program that imports torch."""

_RUN_USAGE = "%(prog)s [-h] [--budget SIZE] [--log LEVEL] [--set NAME=VALUE] (script.py | -m module) [args ...]"

_RUN_DESCRIPTION = """\
Run a Python script (or, with -m, a module) with layerswap as PyTorch's CUDA allocator. The script runs as
__main__ with sys.argv = [script.py, args...], as `python script.py args...` would run it; its exceptions and
exit status come through unchanged. Options must come before the script: everything after it is the script's.

layerswap is turned on as if LAYERSWAP=1 were set; the environment's other LAYERSWAP_* settings apply and the
options here override them. The settings are also exported to the environment, so Python subprocesses that
import torch (multiprocessing workers, launchers) run on layerswap too.

Exits with status 2, before running the script, when layerswap cannot start: no CUDA GPU is visible, a setting
is wrong, or the extension does not load."""

_RUN_EPILOG = """\
examples:
  %(prog)s train.py --epochs 3
  %(prog)s --budget 6GiB train.py
  %(prog)s --budget 75%% --log info -m my_project.train --config big.yaml
  LAYERSWAP_BUDGET=6GiB python train.py      (the same without this command: torch loads layerswap)"""


def _parser(prog):
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"layerswap {layerswap.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    commands.required = True

    run = commands.add_parser("run", help="run a script or module with layerswap enabled", usage=_RUN_USAGE,
                              description=_RUN_DESCRIPTION, epilog=_RUN_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--budget", metavar="SIZE",
                     help='cap on the GPU memory layerswap holds: "6GiB", "6144MiB", "75%%" of the GPU, or bytes '
                          "(overrides LAYERSWAP_BUDGET; default: the environment's, else no cap)")
    run.add_argument("--log", metavar="LEVEL", help="log level: warn, info or debug (overrides LAYERSWAP_LOG)")
    run.add_argument("--set", metavar="NAME=VALUE", action="append", default=[], dest="settings",
                     help="any other setting, e.g. --set LAYERSWAP_STATS=1 or --set stats=1 (repeatable)")
    run.add_argument("-m", metavar="module", dest="module", help="run a library module as a script, like python -m")
    # Shown in the help only: the script and its arguments are split off before argparse sees the command line
    # (see _split_run), so that options after the script stay the script's.
    run.add_argument("script", nargs="?", metavar="script.py", help="the Python script to run")
    run.add_argument("args", nargs="*", metavar="args", help="arguments passed to the script or module")

    config = commands.add_parser("config", help="print every setting: value in force, default, accepted forms",
                                 description="Print every layerswap setting: the value in force in this environment, "
                                             "its default and accepted forms; and a warning for each LAYERSWAP_* "
                                             "variable that is not a setting (a typo).")
    config.add_argument("-v", "--verbose", action="store_true", help="also print what each setting does")

    commands.add_parser("doctor", help="check the installation: torch, the extension, the GPU, the settings",
                        description="Print the torch version, whether layerswap's extension loads, whether a CUDA "
                                    "GPU is visible, and the settings in force. Exits 1 when something would stop "
                                    "layerswap from working.")
    return parser, run


def _split_run(argv):
    """Splits the words after `run` into (options, script, module, script_args). The first word that is not an
    option or an option's value is the script; `-m module` names a module; `--` ends the options."""
    options = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            rest = argv[i + 1:]
            return options, (rest[0] if rest else None), None, rest[1:]
        if word == "-m":
            if i + 1 >= len(argv):
                options.append(word)  # argparse reports the missing module name
                return options, None, None, []
            return options, None, argv[i + 1], argv[i + 2:]
        if word.startswith("-m") and not word.startswith("--"):
            return options, None, word[2:], argv[i + 1:]
        if word in ("--budget", "--log", "--set"):
            options.extend(argv[i:i + 2])
            i += 2
            continue
        if word.startswith("-") and word != "-":
            options.append(word)
            i += 1
            continue
        return options, word, None, argv[i + 1:]
    return options, None, None, []


def _fail(prog, message):
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_CANNOT_START


def _load_extension():
    """(extension module, None) or (None, why it does not load)."""
    try:
        return layerswap._ext(), None
    except ImportError as err:  # includes a missing libc10/libcudart (an ImportError from the dynamic loader)
        return None, f"{type(err).__name__}: {err}"
    except OSError as err:
        return None, f"{type(err).__name__}: {err}"


def _settings_keywords(_C, pairs):
    """--set NAME=VALUE words as enable() keywords (budget=..., log=...). ValueError names a bad word."""
    known = {row[0] for row in _C.settings_table()}
    keywords = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--set takes NAME=VALUE, e.g. --set LAYERSWAP_STATS=1; got {pair!r}")
        full = name.upper() if name.upper().startswith(_PREFIX) else _PREFIX + name.upper()
        if full not in known:
            hint = layerswap._closest(full, sorted(known - {"LAYERSWAP"}))
            raise ValueError(f"unknown setting {name!r}" + (f" (did you mean {hint}?)" if hint else "")
                             + "; `layerswap config` lists them")
        keywords[full[len(_PREFIX):].lower()] = value
    return keywords


def _run(prog, run_parser, argv):
    options, script, module, script_args = _split_run(argv)
    ns = run_parser.parse_args(options)  # -h, unknown options and missing values exit here (status 2)
    if script is None and module is None:
        run_parser.error("name a script to run, or -m module")
    if script is not None and not os.path.isfile(script):
        return _fail(prog, f"can't open file {script!r}: no such file")

    _C, why = _load_extension()
    if _C is None:
        return _fail(prog, f"layerswap's extension layerswap._C does not load ({why}); "
                           f"reinstall layerswap (pip install .) against the torch installed here")
    try:
        keywords = _settings_keywords(_C, ns.settings)
        if ns.log is not None:
            keywords["log"] = ns.log
        overrides = layerswap._overrides(_C, ns.budget, keywords)
        layerswap._activate(overrides, prog)
    except (TypeError, ValueError, RuntimeError) as err:
        message = str(err)
        return _fail(prog, message[len(prog) + 2:] if message.startswith(prog + ": ") else message)
    os.environ.update(overrides)  # Python subprocesses that import torch get layerswap through the autoload
    _exec(script, module, script_args)
    return 0


def _exec(script, module, script_args):
    """Runs the script (or module) as __main__, as the python command would. Its exceptions and SystemExit
    propagate to the caller unchanged."""
    import runpy

    if module is not None:
        sys.argv = [module, *script_args]  # runpy replaces argv[0] with the module's file, as python -m does
        sys.path[0:1] = [os.getcwd()]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *script_args]
        sys.path[0:1] = [os.path.dirname(os.path.abspath(script))]
        runpy.run_path(script, run_name="__main__")


def _table(rows):
    widths = [max(len(str(row[c])) for row in rows) for c in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths)] + [str(row[-1])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _parse_description(_C, description):
    """({name: value in force}, [warning lines]) from _C.check_settings()'s description: one "NAME=VALUE  (note)"
    line per setting, then one line per unknown LAYERSWAP_* name. Parsing the description instead of reading
    _C.config() keeps these commands from applying the configuration (which logs the warnings itself)."""
    names = sorted((row[0] for row in _C.settings_table()), key=len, reverse=True)
    values, warnings = {}, []
    for line in description.splitlines():
        if not line.strip():
            continue
        name = next((n for n in names if line.startswith(n + "=")), None)
        if name is None:
            warnings.append(line.strip())
        else:
            values[name] = line[len(name) + 1:].split("  (", 1)[0].strip()
    return values, warnings


def _config(prog, verbose):
    _C, why = _load_extension()
    if _C is None:
        print(f"{prog}: error: layerswap's extension layerswap._C does not load ({why})", file=sys.stderr)
        return 1
    try:
        description = _C.check_settings({})
    except ValueError as err:
        return _fail(prog, str(err))
    table = [tuple(row) for row in _C.settings_table()]
    values, warnings = _parse_description(_C, description)
    rows = [("SETTING", "VALUE", "DEFAULT", "ACCEPTED")]
    from_env = False
    for name, default, accepted, _help in table:
        value = values.get(name, default)
        if os.environ.get(name, "").strip():
            value = f"{value} *"
            from_env = True
        rows.append((name, value, default, accepted))
    print(f"layerswap {layerswap.__version__} settings: environment variables; layerswap.enable() takes them as "
          f"keywords (LAYERSWAP_BUDGET -> budget=...)")
    print()
    print(_table(rows))
    if from_env:
        print("\n* set in the environment")
    if verbose:
        print()
        for name, _default, _accepted, help_text in table:
            print(f"{name}\n    {help_text}")
    if warnings:
        print()
        for message in warnings:
            print(f"warning: {message}")
    return 0


def _doctor(prog):
    import importlib.metadata
    import platform

    problems = []
    here = os.path.dirname(os.path.abspath(layerswap.__file__))
    print(f"layerswap   {layerswap.__version__} ({here})")
    print(f"python      {platform.python_version()} ({sys.executable})")
    try:
        torch = layerswap._import_torch()
        print(f"torch       {torch.__version__} (built for CUDA {torch.version.cuda})")
    except Exception as err:  # noqa: BLE001 -- a doctor reports whatever went wrong
        print(f"torch       does not import: {type(err).__name__}: {err}")
        print("\nlayerswap needs torch (pip install torch)")
        return 1
    _C, why = _load_extension()
    if _C is None:
        print(f"extension   does NOT load: {why}")
        problems.append("the extension layerswap._C does not load: reinstall layerswap (pip install .) against this "
                        "torch")
    else:
        print(f"extension   loads ({_C.__file__})")
    for label, lib in (("C library", "liblayerswap.so"), ("LD_PRELOAD", "liblayerswap_preload.so")):
        path = os.path.join(here, lib)
        print(f"{label:<11} {path}" + ("" if os.path.isfile(path) else "  (MISSING)"))
    entry = [ep for ep in importlib.metadata.entry_points(group="torch.backends") if ep.name == "layerswap"]
    autoload_on = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"
    from layerswap._autoload import requested
    print(f"autoload    {'registered' if entry else 'NOT registered (is layerswap pip-installed?)'}; "
          f"torch autoload {'on' if autoload_on else 'off (TORCH_DEVICE_BACKEND_AUTOLOAD)'}; "
          f"{'requested by the environment' if requested() else 'not requested (set LAYERSWAP_BUDGET or LAYERSWAP=1)'}")
    if _C is not None:
        if _C.gpu_available():
            try:
                count = torch.cuda.device_count()
                names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
                print(f"GPU         {count} visible to torch ({names})")
            except Exception as err:  # noqa: BLE001
                print(f"GPU         visible to the driver, but torch cannot use it: {type(err).__name__}: {err}")
                problems.append("torch cannot use the GPU")
        else:
            print("GPU         none visible: layerswap needs a CUDA GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        try:
            description = _C.check_settings({})
        except ValueError as err:
            print(f"settings    INVALID: {err}")
            problems.append("a setting is invalid")
        else:
            values, warnings = _parse_description(_C, description)
            print("settings    " + ", ".join(f"{name}={value}" for name, value in values.items()))
            for message in warnings:
                print(f"  warning: {message}")
    if problems:
        print("\nproblems:\n" + "\n".join(f"  - {p}" for p in problems))
        return 1
    print("\nno problems found")
    return 0


def main(argv=None, prog=None):
    """Entry point of the `layerswap` console script and of `python -m layerswap`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or os.path.basename(sys.argv[0] or "layerswap")
    if prog in ("__main__.py", "-c", ""):
        prog = "layerswap"
    parser, run_parser = _parser(prog)
    if argv and argv[0] == "run":
        return _run(f"{prog} run", run_parser, argv[1:])
    ns = parser.parse_args(argv)
    # config and doctor load torch: our own torch autoload must not act while they look (layerswap._import_torch).
    if ns.command == "config":
        return _config(f"{prog} config", ns.verbose)
    if ns.command == "doctor":
        return _doctor(f"{prog} doctor")
    parser.error(f"unknown command {ns.command!r}")
    return EXIT_CANNOT_START
