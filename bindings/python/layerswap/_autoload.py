"""The ``torch.backends`` entry point: layerswap with zero code change.

torch calls every ``torch.backends`` entry point at the end of ``import torch`` (unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0), and an exception raised here makes ``import torch`` itself fail. So:

- Inactive (the usual case): nothing at all happens -- no extension is loaded, nothing is printed. Active means
  LAYERSWAP_BUDGET is set (and is not "none") or LAYERSWAP is 1/true/on/yes, and LAYERSWAP is not 0/false/off/no.
- Active, bad setting: raise. The user asked for layerswap; running silently without it would be worse.
- Active, no GPU: one warning line on stderr, and torch goes on without layerswap.
- Active, an unknown LAYERSWAP_* name: one warning line each (usually a typo: LAYERSWAP_BUGDET), written by the
  configuration when it is applied.
"""

import os
import sys

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def requested(environ=None):
    """Whether the environment asks for layerswap. Reads only the environment."""
    environ = os.environ if environ is None else environ
    switch = environ.get("LAYERSWAP", "").strip().lower()
    if switch in _OFF:
        return False
    budget = environ.get("LAYERSWAP_BUDGET", "").strip().lower()
    if budget not in ("", "none"):
        return True
    # An unrecognised switch value ("LAYERSWAP=maybe") counts as a request, so that the configuration reports it
    # as a bad value instead of layerswap silently staying off.
    return switch != ""


def _warn(message):
    print(f"layerswap: {message}", file=sys.stderr, flush=True)


def autoload():
    if not requested():
        return
    import layerswap

    if layerswap._defer_autoload:  # layerswap.enable() or the command line is importing torch: it decides
        return
    from layerswap import _C

    overrides = {"LAYERSWAP": "1"}  # the same request as a bare layerswap.enable(); Note [Same settings twice]
    _C.check_settings(overrides)  # a bad value raises ValueError: import torch fails, with our message
    if not _C.gpu_available():
        # Applying the settings costs nothing without a GPU, and reports each unknown LAYERSWAP_* name (the
        # configuration logs "layerswap: warning: unknown setting ..." once per name when it is applied).
        _C.configure(overrides)
        what = "LAYERSWAP_BUDGET" if os.environ.get("LAYERSWAP_BUDGET", "").strip() else "LAYERSWAP"
        _warn(f"{what} is set but no CUDA GPU is visible; running without layerswap")
        return
    layerswap._activate(overrides, "layerswap (enabled by the environment)")
