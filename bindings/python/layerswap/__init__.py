"""layerswap: run PyTorch on layerswap's CUDA caching allocator (CUDA virtual memory), with no code change.

Turn it on from outside the program (``LAYERSWAP_BUDGET=6GiB python train.py``, ``python -m layerswap run
train.py``) or from inside it::

    import layerswap
    layerswap.enable(budget="6GiB")   # before the first CUDA tensor

Every setting is an environment variable ``LAYERSWAP_<NAME>``; ``enable()`` takes the same names as keywords,
lower case and without the prefix. The environment is read first and keywords win.

Importing this package is cheap and needs no GPU: it imports neither torch nor the extension. Both are loaded
by the first call that needs them, torch first, because the extension ``layerswap._C`` links against the
libc10 that torch loads.
"""

import os
import sys

__version__ = "0.1.0"

__all__ = ["enable", "is_enabled", "stats", "config", "settings", "Setting", "tracker", "__version__"]

_PREFIX = "LAYERSWAP_"
_SWITCH = "LAYERSWAP"  # the on/off switch; enable() always sets it, so it is not a keyword

# The overrides that the last successful enable() (or the torch autoload) applied; None before that. A second
# call with the same overrides is a no-op. See Note [Same settings twice].
_applied = None

# True while enable() or the command line imports torch: torch then calls every "torch.backends" entry point,
# ours included, and the autoload must leave the configuration to whoever is importing torch right now.
_defer_autoload = False


class Setting(tuple):
    """One row of the settings table: ``(name, default, accepted, help)``."""

    __slots__ = ()

    def __new__(cls, name, default, accepted, help):
        return tuple.__new__(cls, (name, default, accepted, help))

    name = property(lambda self: self[0], doc="full variable name, e.g. LAYERSWAP_BUDGET")
    default = property(lambda self: self[1], doc="default value, as a user would write it")
    accepted = property(lambda self: self[2], doc="the accepted forms")
    help = property(lambda self: self[3], doc="one line of help")

    @property
    def keyword(self):
        """The enable() keyword for this setting (``budget`` for LAYERSWAP_BUDGET), or None for LAYERSWAP."""
        return self.name[len(_PREFIX):].lower() if self.name.startswith(_PREFIX) else None

    def __repr__(self):
        return f"Setting(name={self[0]!r}, default={self[1]!r}, accepted={self[2]!r}, help={self[3]!r})"


def _import_torch():
    """Imports torch without letting our own torch.backends autoload act while it does."""
    global _defer_autoload
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    _defer_autoload = True
    try:
        import torch
    finally:
        _defer_autoload = False
    return torch


def _ext():
    """The extension module, torch loaded first."""
    _import_torch()
    from . import _C

    return _C


from . import tracker  # noqa: E402  (layerswap.tracker: pause()/resume()/paused() for torch.profiler, stats())


def settings():
    """The settings table: a list of :class:`Setting` ``(name, default, accepted, help)``, one per variable."""
    return [Setting(*row) for row in _ext().settings_table()]


def config():
    """The effective settings, ``{"LAYERSWAP_BUDGET": "6GiB", ...}``: environment, then enable() keywords."""
    return dict(_ext().config())


def is_enabled():
    """Whether layerswap is PyTorch's CUDA allocator in this process."""
    _C = sys.modules.get(__name__ + "._C")  # never loaded means never installed; do not load it just to ask
    return bool(_C is not None and _C.is_installed())


def stats(device=None):
    """layerswap's allocator statistics.

    With no argument: a dict keyed by device index, one entry per device whose allocator exists (empty when
    layerswap is not enabled or has not allocated yet). With ``device`` (an index, ``"cuda:1"`` or a
    ``torch.device``): the dict of that device. Byte counters (``allocated_bytes``, ``reserved_bytes``, ...) are
    dicts with ``current``, ``peak``, ``allocated`` and ``freed``, as in ``torch.cuda.memory_stats()``.
    """
    per_device = {int(entry["device"]): dict(entry) for entry in _ext().stats()}
    if device is None:
        return per_device
    index = _device_index(device)
    if index not in per_device:
        have = ", ".join(str(d) for d in sorted(per_device)) or "none"
        raise LookupError(f"layerswap has no allocator for CUDA device {index} yet (devices with one: {have}); "
                          f"it is created by the first allocation on that device while layerswap is enabled")
    return per_device[index]


def _device_index(device):
    if isinstance(device, bool):
        raise TypeError(f"device must be an index, 'cuda:N' or a torch.device, not {device!r}")
    if isinstance(device, int):
        return device
    torch = _import_torch()
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"layerswap manages CUDA memory only; got device {device!r}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _closest(word, choices):
    import difflib

    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return match[0] if match else None


def _setting_value(keyword, value):
    """A keyword argument's value as the string the environment variable would hold."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        hint = ' (a fraction of the GPU is written as a percentage, e.g. "75%")' if keyword == "budget" else ""
        raise TypeError(f"layerswap.enable(): {keyword}={value!r} is not a whole number of bytes{hint}")
    if isinstance(value, str):
        return value
    raise TypeError(f"layerswap.enable(): {keyword} must be a string or a number, not {type(value).__name__}")


def _overrides(_C, budget, settings_kw):
    """The full-name overrides for enable(budget=..., **settings_kw); TypeError for an unknown keyword."""
    keywords = {}
    for row in _C.settings_table():
        name = row[0]
        if name.startswith(_PREFIX):
            keywords[name[len(_PREFIX):].lower()] = name
    overrides = {_SWITCH: "1"}
    for keyword, value in [("budget", budget), *settings_kw.items()]:
        if keyword not in keywords:
            hint = _closest(keyword, list(keywords))
            hint = f" (did you mean {hint!r}?)" if hint else ""
            known = ", ".join(sorted(keywords))
            raise TypeError(f"layerswap.enable() got an unexpected keyword argument {keyword!r}{hint}; "
                            f"the settings are: {known}")
        if value is not None:
            overrides[keywords[keyword]] = _setting_value(keyword, value)
    return overrides


_NO_GPU = ("no CUDA GPU is visible to this process, and layerswap needs one (check nvidia-smi, the NVIDIA driver "
           "and CUDA_VISIBLE_DEVICES)")

_TOO_LATE = ("CUDA memory was already allocated by PyTorch's own allocator, so layerswap can no longer become "
             "PyTorch's CUDA allocator in this process. Either set LAYERSWAP_BUDGET=<size> (or LAYERSWAP=1) in the "
             "environment before starting Python (or start the script with `python -m layerswap run`), or call "
             "layerswap.enable() before the first CUDA tensor is created")


def _values(description):
    """The NAME=VALUE part of each line of a settings description, without the '(where it came from)' notes."""
    lines = []
    for line in description.splitlines():
        line = line.strip()
        if line.endswith(")") and " (" in line:
            line = line[:line.rindex(" (")].rstrip()
        if line:
            lines.append(line)
    return sorted(lines)


# Note [Same settings twice]
# enable() may run more than once: the torch autoload (LAYERSWAP_BUDGET in the environment) and then the program's
# own layerswap.enable(), or a library and the program. Once memory is handed out the settings are fixed, and
# _C.configure() refuses to change them. A call that asks for what is already in force must not fail, even when it
# spells it differently (the autoload takes the budget from the environment, the program passes budget="6GiB"):
# two requests are the same when the same overrides were applied, or when _C.check_settings() -- parsed now, under
# the same environment -- describes the same values for both.
def _same_settings(_C, overrides):
    if _applied is None:
        return False
    if overrides == _applied:
        return True
    try:
        return _values(_C.check_settings(overrides)) == _values(_C.check_settings(_applied))
    except ValueError:
        return False


def _activate(overrides, who):
    """Applies `overrides` and makes layerswap PyTorch's CUDA allocator. Raises ValueError for a bad setting,
    RuntimeError when there is no GPU, when it is too late, or when settings would change after memory was handed
    out."""
    global _applied
    _C = _ext()
    _C.check_settings(overrides)  # a bad value is reported the same with or without a GPU
    if _C.is_installed():
        if _same_settings(_C, overrides):
            _applied = dict(overrides)
            return
        try:
            _C.configure(overrides)
        except RuntimeError as err:
            raise RuntimeError(
                f"{who}: layerswap is already enabled and has handed out CUDA memory, so its settings can no longer "
                f"change (in force: {', '.join(_values(_C.describe_config()))}; asked for: "
                f"{_describe_overrides(overrides)}). "
                f"Give the settings to the first layerswap.enable() call, or set them in the environment "
                f"(LAYERSWAP_BUDGET=...) before starting Python") from err
        _applied = dict(overrides)
        return
    if not _C.gpu_available():
        raise RuntimeError(f"{who}: {_NO_GPU}")
    # No pre-check of _C.native_allocator_initialized(): PyTorch initializes its allocator on any CUDA call
    # (torch.cuda.current_device()), and install() still succeeds while that allocator holds no live memory.
    _C.configure(overrides)
    try:
        _C.install()
    except RuntimeError as err:
        if "too late" in str(err):
            raise RuntimeError(f"{who}: {_TOO_LATE}") from err
        if not _C.gpu_available():
            raise RuntimeError(f"{who}: {_NO_GPU}") from err
        raise
    _applied = dict(overrides)


def _describe_overrides(overrides):
    return ", ".join(f"{name}={value}" for name, value in overrides.items())


def enable(budget=None, **settings):
    """Makes layerswap PyTorch's CUDA allocator in this process.

    ``budget`` caps the device memory layerswap holds: ``"6GiB"``, ``"6144MiB"``, ``"75%"`` of the GPU, or a
    number of bytes. Other settings are keywords named after their variables, lower case without the
    ``LAYERSWAP_`` prefix: ``enable(budget="6GiB", log="info", stats=True)``; see :func:`settings`. The
    environment is read first and keywords win.

    Call it before the first CUDA tensor. Calling it again with the same settings does nothing. Raises TypeError
    for an unknown keyword, ValueError for a bad value, and RuntimeError when no GPU is visible, when PyTorch's
    own allocator has already allocated CUDA memory, or when the settings would change after layerswap has handed
    out memory.
    """
    _C = _ext()
    _activate(_overrides(_C, budget, settings), "layerswap.enable()")
