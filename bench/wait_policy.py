"""Small products and kernels on one thread or two, with torch's OpenMP workers spinning (the
default, ``OMP_WAIT_POLICY`` unset) and sleeping (``PASSIVE``): the measurement behind the serial
thresholds of ``granii/kernels/blas.py`` (``SERIAL_MACS``) and ``csrc/native.h``
(``serial_work``).

    python -m bench.wait_policy [--out results/bench/wait_policy]

Each policy runs in a child process of its own (the variable is read when the OpenMP runtime
starts). In it, as in a layer's call, a GEMM ``(N x k) (k x k)`` and the native SpMM of a graph
with ``N`` nodes at width ``k`` alternate; each is timed on two threads and on the calling thread
(``blas.one_thread``; ``spmm_csr(..., parts=1)``), the variants interleaved round by round, medians
of the rounds. Writes ``wait_policy.csv`` and ``wait_policy.md``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = [(2708, 13264, 16), (2708, 13264, 32), (2708, 13264, 128), (19717, 108365, 32),
         (19717, 108365, 128), (37700, 615706, 32)]


def _child(rounds):
    import dgl
    import torch
    from granii.graph import graph_info
    from granii.kernels import blas, native
    torch.set_num_threads(2)
    out = []
    for n, e, k in SIZES:
        g = dgl.rand_graph(n, e)
        gi = graph_info(g)
        native.spmm_native(gi, torch.randn(n, k))          # its CSR, once
        idx = native.csr_index(gi)
        x, w = torch.randn(n, k), torch.randn(k, k)
        x3 = x.view(n, 1, k)

        def spmm(parts):
            return torch.ops.granii.spmm_csr(idx.indptr, idx.indices, x3, None, None, None,
                                             None, None, 0, parts, None)

        def mm_serial():
            with blas.one_thread():
                return x @ w
        cands = {"gemm_2": lambda: x @ w, "gemm_1": mm_serial,
                 "spmm_2": lambda: spmm(2), "spmm_1": lambda: spmm(1)}
        times = {c: [] for c in cands}
        for _ in range(rounds):
            for c, fn in cands.items():
                x.add_(0)                                 # the operand just written, as in a call
                t0 = time.perf_counter()
                fn()
                times[c].append(time.perf_counter() - t0)
        med = {c: statistics.median(v) * 1e6 for c, v in times.items()}
        out.append(dict(nodes=n, edges=e, k=k, gemm_macs=n * k * k, spmm_work=(n + e) * k,
                        **{f"{c}_us": round(v, 1) for c, v in med.items()}))
    print(json.dumps(out))


def run(rounds=200):
    rows = []
    for policy in ("unset", "PASSIVE"):
        env = dict(os.environ, OMP_NUM_THREADS="2")
        env.pop("OMP_WAIT_POLICY", None)
        if policy != "unset":
            env["OMP_WAIT_POLICY"] = policy
        res = subprocess.run([sys.executable, "-m", "bench.wait_policy", "--child",
                              "--rounds", str(rounds)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        if res.returncode:
            raise RuntimeError(res.stderr[-2000:])
        for r in json.loads(res.stdout.strip().splitlines()[-1]):
            rows.append(dict(policy=policy, **r))
    return rows


def _markdown(df):
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench" / "wait_policy"))
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.rounds)
    import pandas as pd
    rows = run(args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    df["gemm_2_over_1"] = (df.gemm_2_us / df.gemm_1_us).round(2)
    df["spmm_2_over_1"] = (df.spmm_2_us / df.spmm_1_us).round(2)
    df.to_csv(out / "wait_policy.csv", index=False)
    (out / "wait_policy.md").write_text(
        "# One thread or two for small products and kernels\n\n`python -m bench.wait_policy`: "
        "medians of interleaved rounds (us); `2 / 1` above 1: the calling thread alone wins.\n\n"
        + _markdown(df) + "\n")
    print(df.to_string(index=False))


if __name__ == "__main__":
    main()
