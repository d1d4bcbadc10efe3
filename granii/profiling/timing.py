"""Timing: warm-up, repeats, medians; several candidates interleaved so drift hits all alike."""
import statistics
import time

import torch


def fix_threads(n=2):
    """Pin torch's intra-op thread count (the machine's 2 cores) and return it."""
    torch.set_num_threads(n)
    return torch.get_num_threads()


def time_once(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(fns, warmup=2, repeat=7, budget=None, lead=0, least=3):
    """``{name: (median seconds, list of samples)}`` for each callable in ``fns``.

    Rounds run every candidate once, in turn, so machine noise spreads over all of them; the
    ratios of medians are what to compare. ``budget`` (seconds) caps the repeats of slow inputs
    (at least ``least`` rounds are always run). ``lead``: untimed calls of a candidate right
    before each of its timed ones, so that what it follows is itself, as in a loop that calls it
    again and again, not the candidate before it in the round (measured: six GCN plans running
    the same GEMM on every call took 0.53-1.07 ms each after the others in a fixed order,
    0.49-0.55 ms after themselves).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples = {k: [] for k in fns}
    start = time.perf_counter()
    for r in range(repeat):
        for k, fn in fns.items():
            for _ in range(lead):
                fn()
            samples[k].append(time_once(fn))
        if budget is not None and r >= least - 1 and time.perf_counter() - start > budget:
            break
    return {k: (statistics.median(v), v) for k, v in samples.items()}


def median_time(fn, warmup=2, repeat=7, budget=None):
    return side_by_side({"f": fn}, warmup, repeat, budget)["f"][0]
