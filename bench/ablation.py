"""The allocator's share of the gain, apart from plan choice and kernels.

granii serves the large tensors made while an optimized layer runs from a caching allocator
(``granii.kernels.pool``), installed as torch's CPU allocator by the first ``granii(...)`` call and
active only inside granii's scope; the same scope covers DGL's own forward when granii's tie-break
runs it. Two more candidates, timed in the same rounds as the others, separate what the pool gives
from what the plans and kernels give:

* ``dgl_pool``       DGL's model as written, each call (training: the whole step) inside the
                     pool's scope: DGL with the same allocator;
* ``granii_nopool``  granii's copy with pooling off during its calls (``pool.set_limit(0)``: every
                     request goes to torch's allocator, freed blocks are not kept).

With steady times ``t``:

    DGL / granii = (DGL / DGL_pool) x (DGL_pool / granii)      what the pool would give DGL,
                                                                x plan and kernels, both pooled
                 = (DGL / granii_nopool) x (granii_nopool / granii)
                                                                plan and kernels, neither pooled,
                                                                x what the pool gives granii
"""
import contextlib

from granii.kernels import pool

CANDIDATES = ("dgl_pool", "granii_nopool")


@contextlib.contextmanager
def pooled():
    """The pool's scope, as granii opens it around a layer call."""
    pool.install()
    pool.enter()
    try:
        yield
    finally:
        pool.leave()


@contextlib.contextmanager
def unpooled():
    """No pooling inside: the limit is 0 (``pool.set_limit``), restored after."""
    limit = pool.stats()["limit"]
    pool.set_limit(0)
    try:
        yield
    finally:
        pool.set_limit(limit)


CONTEXT = {"dgl_pool": pooled, "granii_nopool": unpooled}


def run_in(name, fn, *args):
    """``fn(*args)`` in the context of candidate ``name`` (module doc)."""
    with CONTEXT[name]():
        return fn(*args)


def ratios(row):
    """The ablation's ratios of steady times (module doc), added to ``row``."""
    def r(a, b):
        try:
            return float(row[a]) / float(row[b])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return float("nan")
    row["pool_gain_dgl"] = r("dgl_ms", "dgl_pool_ms")
    row["pool_gain_granii"] = r("granii_nopool_ms", "granii_ms")
    row["plan_gain_pooled"] = r("dgl_pool_ms", "granii_ms")
    row["plan_gain_unpooled"] = r("dgl_ms", "granii_nopool_ms")
    return row


__all__ = ["CANDIDATES", "pooled", "unpooled", "run_in", "ratios"]
