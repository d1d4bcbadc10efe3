"""Peak memory of one layer, DGL's or granii's, measured by the operating system.

torch's CPU allocator keeps no statistics, so the measure is the resident set (RSS) of a fresh
Python process per (model, graph, sizes). The child loads the graph from a file (no parsing
transients), builds the features, imports granii and loads its cost models, then for each
(mode, candidate) in turn:

1. loads a fresh graph object, builds the layer (its first forward builds DGL's sparse formats
   of the graph), frees everything of the previous candidate, returning
   free memory to the system (``gc.collect`` and glibc's ``malloc_trim``), and reads the RSS: the
   baseline;
2. runs ``granii(layer, g, x)`` (granii only) and ``iterations`` iterations (forward, or forward +
   backward + Adam step) while a thread samples the RSS every 0.5 ms;
3. ``extra_mb`` = largest sample - baseline: the memory the layer needed at its peak, including
   once-per-graph structures (CSR copies, normalised edge values) and, in training, the tensors
   kept for the backward.

Short spikes can fall between samples, and the C allocator may keep a little freed memory: a few
MB are noise. Usage (child): ``python -m bench.memory GRAPH_FILE MODEL K_IN K_OUT``; prints JSON.
"""
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2 ** 20
CANDIDATES = [(mode, cand) for mode in ("inference", "training") for cand in ("dgl", "granii")]


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_MB


def _release():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakSampler:
    """Samples this process's RSS in a thread; ``peak`` is the largest sample (MB)."""

    def __init__(self, interval=0.0005):
        self.interval, self.peak = interval, _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mb())
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _one(graph_file, x, model, k_in, k_out, mode, candidate, cost_model, iterations):
    import dgl
    import torch

    from bench import models
    from bench.measure import Runner
    from granii import granii
    from granii.api import layer_states

    g = dgl.load_graphs(graph_file)[0][0]        # a fresh graph: no cache of another candidate
    layer = models.build(model, k_in, k_out)
    with torch.no_grad():
        shape = layer(g, x).shape                 # also builds DGL's sparse formats of the graph
    out_grad = torch.randn(shape)
    run = Runner(lambda: layer(g, x), layer.parameters(), out_grad, mode == "training")
    _release()
    base = _rss_mb()
    status = "ok"
    try:
        with PeakSampler() as sampler:
            if candidate == "granii":
                granii(layer, g, x, cost_model=cost_model)
                fallback = layer_states(layer)[0].fallback
                status = f"not optimized: {fallback}" if fallback else "ok"
            for _ in range(iterations):
                run()
    except Exception as e:             # noqa: BLE001 - recorded
        return dict(mode=mode, candidate=candidate, status=f"error {type(e).__name__}: {e}"[:200])
    return dict(mode=mode, candidate=candidate, baseline_mb=round(base, 1),
                peak_mb=round(sampler.peak, 1), extra_mb=round(sampler.peak - base, 1),
                status=status)


def child(graph_file, model, k_in, k_out, iterations=3):
    import dgl
    import torch

    from granii.learned import default_cost_model

    torch.set_num_threads(2)
    n = dgl.load_graphs(graph_file)[0][0].num_nodes()
    torch.manual_seed(1)
    x = torch.randn(n, k_in)
    cost_model = default_cost_model()
    out = []
    for mode, cand in CANDIDATES:
        out.append(_one(graph_file, x, model, k_in, k_out, mode, cand, cost_model, iterations))
        _release()
    return out


def measure(graph_file, model, k_in, k_out, timeout=900):
    """Run ``child`` in a new process: a list of rows, or one row with the error."""
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "bench.memory", str(graph_file), model, str(k_in), str(k_out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return [dict(mode=m, candidate=c, status="timeout") for m, c in CANDIDATES]
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return [dict(mode=m, candidate=c, status=f"error: {last[:200]}") for m, c in CANDIDATES]
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(child(a[0], a[1], int(a[2]), int(a[3]))))
