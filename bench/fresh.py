"""First calls in a fresh process: what a user's script pays on its first call.

The benchmark's own process has loaded the cost models and run the correctness checks before it
times a configuration, which fills granii's process-wide caches (parsed forwards, enumerations,
calibration, cost-model trees) and warms torch's and DGL's lazy state; a first call timed there
is a warm process's. Here each first call runs in a process of its own:

* ``Zygote`` starts ``python -m bench.fresh`` once per run. That process imports torch, DGL,
  granii and the benchmark's modules, sets torch's thread count, and does nothing else: no
  tensor operation, no granii call, no cost model loaded, no OpenMP region entered (so forking
  it is safe: the OpenMP runtime has no threads yet).
* For each request it forks a child. The child is what a user's process is after its imports:
  it first copies the pages it shares with the zygote (``own_pages``: a user's process owns its
  pages; a forked child would pay a copy at its first write to each), then it loads the graph
  and builds the model from the request (as the in-process measurement does, same seeds), then
  times one candidate's first call:

  - ``dgl``:    the model's first forward (training: the first epoch's step);
  - ``granii``: ``granii(model, g, x)`` with its default cost model (loaded by that call, as a
                user's first call loads it), then the first forward on new features (or the
                first training step, or the first mini-batch epoch with ``granii`` on its first
                batch).

  The child sends the seconds back and exits; nothing it did survives it.

One child per candidate, so neither candidate's first call warms the other's. Seeds and shapes
follow ``bench.fullbatch``, ``bench.minibatch`` and ``bench.single``.
"""
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 180.0


# -- the child's work ------------------------------------------------------------------------------
def _layer(req):
    import torch
    from granii import granii
    from . import models
    from .inputs import FreshFeatures, fresh_graph, load
    from .single import _call, cached_twin
    inp = load(req["graph"])
    seed = req.get("seed", 0)
    layer = models.build(req["model"], req["k_in"], req["k_out"], seed).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(inp.g.num_nodes(), req["k_in"], generator=gen)
    new = req["features"] == "new"
    xi = FreshFeatures(x.shape, seed=seed + 11).next() if new else x
    x0 = torch.randn(x.shape, generator=gen)
    if req["candidate"] == "dgl" and not new:
        layer = cached_twin(layer) or layer
    g = fresh_graph(inp.g)
    t0 = time.perf_counter()
    if req["candidate"] == "granii":
        granii(layer, g, x0 if new else x)
    _call(layer, g, xi)
    return time.perf_counter() - t0


def _model(req):
    import torch
    from granii import granii
    from .examples import FULL, build, set_graph
    from .fullbatch import _infer, _train_step
    from .inputs import FreshFeatures, fresh_graph, load
    inp = load(req["graph"])
    seed = req.get("seed", 0)
    spec = FULL[req["model"]]
    training = req["task"] == "train"
    g = fresh_graph(inp.g)
    m = set_graph(build(spec, inp.g, inp.features, inp.classes, training, seed), g)
    if training:
        opt = torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=5e-4)
        m.train()
        t0 = time.perf_counter()
        if req["candidate"] == "granii":
            granii(m, g, inp.x)
        _train_step(spec, m, opt, g, inp.x, inp.y, inp.train)
        return time.perf_counter() - t0
    m.eval()
    x1 = FreshFeatures(inp.x.shape, seed=seed + 7).next()
    t0 = time.perf_counter()
    if req["candidate"] == "granii":
        granii(m, g, inp.x)
    _infer(spec, m, g, x1)
    return time.perf_counter() - t0


def _minibatch(req):
    import torch
    from .examples import SAMPLED
    from .inputs import fresh_graph, load
    from .minibatch import DEFAULT_COST_MODEL, Epoch, seeds_of
    inp = load(req["graph"])
    seed = req.get("seed", 0)
    spec, fanouts = SAMPLED[req["model"]]
    seeds = seeds_of(inp.g, req.get("max_seeds", 4096), seed)
    torch.manual_seed(seed)
    m = spec.build(inp.g, inp.features, inp.classes, True)
    ep = Epoch(spec, m, fresh_graph(inp.g), inp, seeds, fanouts, seed + 1,
               DEFAULT_COST_MODEL if req["candidate"] == "granii" else None)
    return ep()


def _probe(req):
    """How many cost models this process has loaded (a fresh child: none)."""
    from granii import learned
    return float(len(learned._LOADED))


def _shared(req):
    """Kilobytes of this process's private writable memory still shared with the zygote (a
    child after ``own_pages``: none)."""
    return float(shared_kb())


KINDS = {"layer": _layer, "model": _model, "minibatch": _minibatch, "probe": _probe,
         "shared": _shared}


# -- a forked child's memory, made its own ---------------------------------------------------------
MADV_POPULATE_WRITE = 23        # Linux 5.14 on: fault pages in writable, copying shared ones


def _writable_private():
    """``(start, end)`` of each private writable mapping of this process."""
    with open("/proc/self/maps") as f:
        lines = f.readlines()
    for line in lines:
        span, perms = line.split()[:2]
        if perms[1] == "w" and perms[3] == "p":
            lo, hi = span.split("-")
            yield int(lo, 16), int(hi, 16)


def own_pages():
    """Give this forked child a copy of every page it shares with the zygote, before anything
    is timed. A forked child shares its parent's memory copy-on-write: the first write to each
    page (a Python object's reference count, an allocator's free list) copies it, which a user's
    process, whose pages are its own from the start, never pays. Measured on a first call of a
    2-layer GCN on Cora: 9-12 ms of DGL's and 27-31 ms of granii's in a plain forked child, 6 ms
    and 16-17 ms after this, as in a process started on its own (6.5-8 and 16-18 ms). One
    ``madvise`` per mapping (a third of a second, untimed); where the kernel lacks
    ``MADV_POPULATE_WRITE`` each page is written with its own value instead."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    for lo, hi in list(_writable_private()):
        if libc.madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
            for p in range(lo, hi, page):
                ctypes.memmove(p, p, 1)


def shared_kb():
    """``Shared_Dirty`` kilobytes of this process's private writable mappings (``smaps``)."""
    total, inside = 0, False
    spans = set(_writable_private())
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = head.split("-")
                inside = (int(lo, 16), int(hi, 16)) in spans
            elif inside and head == "Shared_Dirty:":
                total += int(line.split()[1])
    return total


def run_request(req):
    """``{"seconds": s}`` or ``{"error": text}`` for one request, in this process."""
    try:
        return {"seconds": KINDS[req["kind"]](req)}
    except Exception as e:                       # noqa: BLE001 - sent back, the run goes on
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


# -- the zygote ------------------------------------------------------------------------------------
def _read_all(fd, deadline):
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        data = os.read(fd, 1 << 16)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def serve(stdin=sys.stdin, stdout=sys.stdout):
    """The zygote's loop: one JSON request a line in, one JSON answer a line out."""
    import warnings
    warnings.simplefilter("ignore")
    import torch
    import dgl  # noqa: F401
    import granii  # noqa: F401
    from . import examples, fullbatch, inputs, minibatch, models, single  # noqa: F401
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(json.dumps({"ready": os.getpid()}), file=stdout, flush=True)
    for line in stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                # the child: a fresh process
            os.close(r)
            try:
                own_pages()
                out = json.dumps(run_request(req)).encode()
                os.write(w, out)
            finally:
                os._exit(0)
        os.close(w)
        data = _read_all(r, time.monotonic() + req.get("timeout", TIMEOUT))
        os.close(r)
        if data is None:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        ans = json.loads(data) if data else {"error": "the child gave no answer (timed out or "
                                                      "crashed)"}
        print(json.dumps(ans), file=stdout, flush=True)


class Zygote:
    """The benchmark's handle on the zygote process (module doc): ``first_call(**request)``."""

    def __init__(self, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.fresh"], cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env if env is not None else dict(os.environ))
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError("bench.fresh: the zygote did not start")
        self.errors = []

    def first_call(self, **req):
        """Seconds of the first call the request describes, or ``nan`` (the error kept)."""
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        ans = json.loads(line) if line else {"error": "the zygote died"}
        if "seconds" in ans:
            return ans["seconds"]
        self.errors.append((req, ans.get("error"), ans.get("traceback", "")))
        return float("nan")

    def firsts(self, candidates, **req):
        """``{candidate: seconds}`` for each of ``candidates`` (one fresh child each)."""
        return {c: self.first_call(candidate=c, **req) for c in candidates}

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    serve()
