"""The GPU's fitted cost model (``granii/gpu_costmodel.py``) and its profiler
(``granii/profiling/gpu.py``): the fit recovers known coefficients, and a profile made on the GPU
path (here on the CPU, the Triton kernels under the interpreter, in a child process) writes its
timings and a model that the GPU path then loads for that device and prices with."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from granii.gpu_costmodel import FittedCost, features, fit, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fit_recovers_the_terms_of_a_sum():
    """Timings made by ``t = 5 us + 2e-11 E k + 3e-10 dmax k`` (an SpMM whose hub row bounds it)
    give back those coefficients and price an unseen size within 1%."""
    pytest.importorskip("scipy")
    true = [5e-6, 2e-11, 0.0, 0.0, 3e-10]
    rows = []
    for n in (1000, 30000, 500000):
        for d in (3, 20):
            for k in (16, 128):
                for dmax in (d, 40 * d):
                    x = features("spmm", n, n, n * d, dmax, {"k": k})
                    rows.append(("spmm", "triton", "forward", n, n, n * d, dmax, {"k": k},
                                 sum(c * v for c, v in zip(true, x))))
    coef = fit(rows)[("spmm", "triton", "forward")]
    assert all(c >= 0 for c in coef)
    for got, want in zip(coef, true):
        assert math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-15), (coef, true)


class _Analytical:
    name = "analytical"

    def predict(self, prim, impl, gi, dims):
        return 1.0


def test_a_fitted_model_prices_what_it_has_and_falls_back(tmp_path):
    data = {"format": 1, "gpu": "NVIDIA H200, 132 SMs, 140 GiB, CUDA 13.0, torch 2.11",
            "points": 3, "models": [{"prim": "gemm", "impl": "torch", "phase": "forward",
                                     "coef": [1e-5, 1e-12, 0.0]}]}
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "gpu_model.json").write_text(json.dumps(data))
    assert load(tmp_path, "NVIDIA H100 80GB HBM3, 132 SMs, 79 GiB", _Analytical()) is None
    model = load(tmp_path, "NVIDIA H200, 132 SMs, 140 GiB, CUDA 13.1, torch 2.12",
                 _Analytical())
    assert isinstance(model, FittedCost) and model.has_model("gemm", "torch")
    t = model.predict("gemm", "torch", None, {"m": 1000, "k": 100, "n": 10})
    assert math.isclose(t, 1e-5 + 1e-12 * 1e6)
    assert model.predict("spmm", "triton", None, {"k": 4}) == 1.0       # the fallback's
    assert model.predict_train("gemm", "torch", None, {"m": 1, "k": 1, "n": 1}) is None


def _skip():
    try:
        from granii.kernels.triton import available
        return None if available() else "Triton older than 3.0"
    except ImportError as e:
        return f"no Triton ({e})"


PROFILE = """
import json, sys, torch, warnings
warnings.simplefilter("ignore")
from granii import device
device.GPU_PATH_ON_CPU[0] = True
from granii.profiling import gpu
out = sys.argv[1]
gpu.profile(torch.device("cpu"), out, budget=600, nodes=(24,), degrees=(3,), widths=(4,),
            heads=((2, 2),), gemm=[(64, 8, 8), (256, 16, 16)], rows_grid=[(64, 8)],
            prims=("spmm_norm", "gat_aggregate"), log=lambda *a: None)
model = device.gpu_cost_model("cpu", out)
from granii.pyg.graph import IndexGraph, graph_info
gi = graph_info(IndexGraph(torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0]), 3))
print(json.dumps({"name": model.name,
                  "spmm_norm": model.predict("spmm_norm", "triton", gi, {"k": 4}),
                  "has": model.has_model("spmm_norm", "triton")}))
"""


@pytest.mark.skipif(_skip() is not None, reason=_skip() or "")
def test_a_profile_on_the_gpu_path_gives_the_model_it_then_loads(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", PROFILE, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["name"].startswith("fitted-gpu") and got["has"], got
    assert got["spmm_norm"] > 0
    rows = (tmp_path / "gpu_points.csv").read_text().splitlines()
    prims = {r.split(",")[0] for r in rows[1:]}
    assert {"gemm", "row_scale", "spmm_norm", "gat_aggregate"} <= prims, prims
    data = json.loads((tmp_path / "gpu_model.json").read_text())
    assert data["gpu"].startswith("cpu") and data["points"] == len(rows) - 1
    assert {(m["prim"], m["impl"]) for m in data["models"]} >= {("spmm_norm", "triton"),
                                                                ("gat_aggregate", "triton")}


def test_the_gpu_path_takes_gpu_kernels_only_and_the_cpu_none_of_triton():
    from granii.device import GPU_IMPLS, free_memory, runs_on
    assert {i for i in ("native", "dgl", "torch", "torch_csr", "triton", "inline")
            if runs_on(i, gpu=True)} == set(GPU_IMPLS)
    assert not runs_on("triton", gpu=False) and runs_on("native", gpu=False)
    assert free_memory(torch.device("cpu")) is None


def test_measured_rates_and_the_analytical_gpu_model_without_a_fitted_one(tmp_path):
    """Without a model for this device in the folder, the GPU path prices by the analytical
    model with rates measured on the device, and says so."""
    from granii import device
    rates = device.measure_rates(torch.device("cpu"))
    assert set(rates) == {"stream_rate", "gather_rate", "flop_rate"}
    assert all(v > 0 and math.isfinite(v) for v in rates.values())
    with pytest.warns(RuntimeWarning, match="no cost models trained on this GPU"):
        model = device.gpu_cost_model("cpu", str(tmp_path))
    assert model.name.startswith("analytical-gpu")
    from granii.pyg.graph import IndexGraph, graph_info
    gi = graph_info(IndexGraph(torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0]), 3))
    slow = model.predict("spmm", "torch", gi, {"n": 3, "k": 64})       # PyG-style scatter
    fast = model.predict("spmm", "triton", gi, {"n": 3, "k": 64})
    assert slow > fast > 0


def test_the_shipped_h200_model_serves_that_card_only_and_prices_every_gpu_kernel():
    """``costmodels/gpu`` holds the model fitted on the H200 of the GPU check: found for that
    card (whatever its CUDA, torch or driver versions), not for another; it prices the SpMM
    family, the GAT kernels and GEMM by its own fit, in both phases."""
    from granii.device import GPU_MODELS
    h200 = "NVIDIA H200, 132 SMs, 140 GiB, CUDA 13.2, torch 2.12.0, driver 590.1"
    model = load(GPU_MODELS, h200, fallback=None)
    assert model is not None and model.gpu.startswith("NVIDIA H200, 132 SMs")
    assert load(GPU_MODELS, "NVIDIA H100 80GB HBM3, 132 SMs, 79 GiB", fallback=None) is None
    for prim, impl in (("spmm", "triton"), ("spmm", "torch_csr"), ("spmm_norm", "triton"),
                       ("spmm_weighted", "triton"), ("gat_aggregate", "triton"),
                       ("edge_softmax", "triton"), ("gemm", "torch")):
        assert model.has_model(prim, impl) and model.has_model(prim, impl, "train"), (prim, impl)


def test_the_driver_version_is_read_from_the_kernel_modules_line(tmp_path):
    from granii.device import driver_version
    f = tmp_path / "version"
    f.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 1 2026\n"
                 "GCC version:  gcc version 12.3.0\n")
    assert driver_version(f) == "570.86.15"
    assert driver_version(tmp_path / "missing") == "unknown"
