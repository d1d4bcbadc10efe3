"""Side-by-side rounds: every candidate once per round, in turn, after a warm-up; medians.

A candidate is a callable returning the seconds it measured itself, so work that must not be
timed (making a new feature tensor, fetching the next sampled batch) happens inside it, before its
own timer starts. Rounds stop at ``max_rounds`` or, once ``min_rounds`` are done, when ``budget``
seconds have passed since the first timed round.
"""
import statistics
import time


def timed(fn, *args):
    """Seconds of one call ``fn(*args)``."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def interleaved(cands, warmup=1, max_rounds=30, min_rounds=3, budget=None):
    """``{name: [seconds per round]}`` for the candidates ``{name: measure()}``."""
    for _ in range(warmup):
        for measure in cands.values():
            measure()
    samples = {k: [] for k in cands}
    start = time.perf_counter()
    for r in range(max_rounds):
        for k, measure in cands.items():
            samples[k].append(measure())
        if budget is not None and r + 1 >= min_rounds and time.perf_counter() - start > budget:
            break
    return samples


def median(xs):
    return statistics.median(xs) if xs else float("nan")


__all__ = ["interleaved", "timed", "median"]
