"""layerswap's launch tracker: which of layerswap's regions every CUDA kernel launch touches (see docs/tracker.md).

It starts by itself when layerswap is enabled (``LAYERSWAP_TRACK=auto``, the default). CUPTI, which it listens
through, takes one subscriber per process, so ``torch.profiler`` gets no GPU events while the tracker holds it.
Profile inside :func:`paused`::

    import layerswap
    with layerswap.tracker.paused():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()

Importing this module imports neither torch nor the extension.
"""

import contextlib

__all__ = ["start", "stop", "pause", "resume", "paused", "stats", "drain", "region_of", "is_active"]


def _C():
    from . import _ext

    return _ext()


def start():
    """Takes CUPTI and tracks launches. False when CUPTI is missing or held by another tool (nsys, a profiler)."""
    return bool(_C().tracker_start())


def stop():
    """Stops tracking and releases CUPTI; the counters stay readable."""
    _C().tracker_stop()


def pause():
    """Releases CUPTI so that another subscriber (torch.profiler) can take it. True when tracking was on."""
    return bool(_C().tracker_pause())


def resume():
    """Retakes CUPTI after :func:`pause`. True when tracking is on afterwards (False when the profiler kept it)."""
    return bool(_C().tracker_resume())


def is_active():
    return bool(_C().tracker_stats()["active"])


@contextlib.contextmanager
def paused():
    """Tracking paused (CUPTI released) inside the block, resumed after it if it was on before."""
    was_on = pause()
    try:
        yield
    finally:
        if was_on:
            resume()


def stats():
    """Counters: launches, decoded, undecoded_by_reason, dropped, no_region_families, subscriber_busy, ..."""
    return dict(_C().tracker_stats())


def drain(max_events=1 << 20):
    """The oldest tracked launches (removed): a list of (launch_no, stream, kernel, [region ids])."""
    return _C().tracker_drain(max_events)


def region_of(ptr):
    """The layerswap region holding a device address (``tensor.data_ptr()``), or 0."""
    return int(_C().region_of(int(ptr)))
