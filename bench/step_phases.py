"""A training step's phases (forward, backward, optimizer), as swap_models.train records them, and their medians.
Torch-free, so that bench/swap.py's parent process, which never imports torch, pools the workers' phases with the
same code the workers use."""
import statistics

PHASES = ("forward", "backward", "optimizer")  # a step's phases, in the order of train()'s phase_times_s entries


def median_phases(steps):
    """{phase: [median wall, median main-thread CPU, median autograd-thread CPU or None]} over `steps`, a list of
    swap_models.train()'s phase_times_s entries."""
    out = {}
    for k, name in enumerate(PHASES):
        values = []
        for j in (0, 1, 2):
            xs = [p[k][j] for p in steps if len(p[k]) > j and p[k][j] is not None]
            values.append(statistics.median(xs) if xs else None)
        out[name] = values
    return out
