"""Side-by-side rounds: every candidate once per round, in turn; medians of the steady rounds.

A candidate is a callable returning the seconds it measured itself, so work that must not be
timed (making a new feature tensor, fetching the next sampled batch) happens inside it, before its
own timer starts.

granii may spend its first calls timing candidate plans against each other (a measured
tie-break) before it keeps one. ``settled()`` says whether every optimized copy has kept its
choice; the rounds from the first one that starts settled on are the *steady* rounds, and the
steady time of every candidate is the median of those same rounds. Rounds stop at
``max_rounds``, or once ``min_rounds`` are done, ``budget`` seconds have passed and at least
``min_steady`` steady rounds are in; never later than ``cap`` seconds. When the cap ends them
before that, the candidates named in ``settle`` (the optimized copies) go on alone, round by
round, until they are settled, within ``2 cap`` seconds more and ``max_rounds`` rounds in all:
otherwise the calls of their tie-break, which a slow layer's few rounds are made of, would stand
for their steady time. Once settled, every candidate runs ``after_alone`` (5) more rounds side by
side, and these are the steady rounds of all (the index returned is then ``-after_alone``: the
optimized copies' samples are longer than the others'). Five, not three: on layers whose calls
write tens of MB, one call in three can take twice the others (page faults), and a median of three
rounds read 0.42x for a configuration whose other runs read 1.5-1.65x. When they do not settle in
time, the others' steady time is the median of all their rounds.
"""
import statistics
import time


def timed(fn, *args):
    """Seconds of one call ``fn(*args)``."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def interleaved(cands, warmup=0, max_rounds=30, min_rounds=3, budget=None, settled=None,
                min_steady=3, cap=None, settle=(), after_alone=5):
    """``({name: [seconds per round]}, index of the first steady round)`` for the candidates
    ``{name: measure()}`` (see module doc; without ``settled`` every round is steady)."""
    for _ in range(warmup):
        for measure in cands.values():
            measure()
    samples = {k: [] for k in cands}
    steady_from = 0 if settled is None else None
    start = time.perf_counter()
    capped = False
    for r in range(max_rounds):
        if steady_from is None and settled():
            steady_from = r
        for k, measure in cands.items():
            samples[k].append(measure())
        elapsed = time.perf_counter() - start
        n_steady = 0 if steady_from is None else r + 1 - steady_from
        if (budget is not None and r + 1 >= min_rounds and elapsed > budget
                and n_steady >= min(min_steady, r + 1)):
            break
        if cap is not None and elapsed > cap:
            capped = n_steady < min(min_steady, r + 1)
            break
    if capped and settle and settled is not None:
        if _settle_alone({k: cands[k] for k in settle}, samples, settled, max_rounds, 2 * cap):
            for _ in range(after_alone):
                for k, measure in cands.items():
                    samples[k].append(measure())
            steady_from = -after_alone
    return samples, steady_from


def _settle_alone(cands, samples, settled, max_rounds, cap):
    """Rounds of ``cands`` alone until they are settled: whether they are (see module doc)."""
    start = time.perf_counter()
    while True:
        if settled():
            return True
        if len(samples[next(iter(cands))]) >= max_rounds or time.perf_counter() - start > cap:
            return False
        for k, measure in cands.items():
            samples[k].append(measure())


def steady_median(samples, steady_from):
    """Median of a candidate's steady rounds (``samples[steady_from:]``); of all its rounds when
    it has none there."""
    steady = samples[steady_from:] if steady_from is not None else samples
    return statistics.median(steady or samples)


def summarise(first, samples, steady_from, calls):
    """``(steady median, total of `calls` calls)`` of one candidate: the first call, the calls
    measured, and the steady median for the calls not measured."""
    med = steady_median(samples, steady_from)
    measured = samples[:calls - 1]
    return med, first + sum(measured) + max(0, calls - 1 - len(measured)) * med


def median(xs):
    return statistics.median(xs) if xs else float("nan")


__all__ = ["interleaved", "summarise", "steady_median", "timed", "median"]
