"""Which device's kernels a call runs, and what the GPU path needs.

Features on the CPU run the CPU's kernels: granii's C++ kernels (``native``), MKL through torch,
DGL's, and the CPU allocator pool. Features on a CUDA device run the GPU's: granii's Triton
kernels (``triton``), torch's own CUDA kernels (``torch``: scatter and index adds; ``torch_csr``:
cuSPARSE's CSR product) and cuBLAS. A plan's steps take only implementations of their device
(``runs_on``), the per-graph indices live on the graph's device, a measured turn of the tie-break
waits for the device (``synchronize``), and the GPU's costs come from ``gpu_cost_model``.

``GPU_PATH_ON_CPU``: tests run the GPU path on CPU tensors, with the Triton kernels under Triton's
interpreter (``TRITON_INTERPRET=1``): the same choices and kernels, where no GPU is at hand.
"""
import functools
import time
import warnings
from pathlib import Path

import torch

GPU_IMPLS = frozenset({"torch", "torch_csr", "triton", "inline"})
GPU_PATH_ON_CPU = [False]


def is_gpu(device):
    """Whether ``device`` (a ``torch.device``) runs the GPU path."""
    return device.type == "cuda" or (GPU_PATH_ON_CPU[0] and device.type == "cpu")


def runs_on(impl, gpu):
    """Whether kernel implementation ``impl`` runs on the GPU path (``gpu``) or the CPU's."""
    return impl in GPU_IMPLS if gpu else impl != "triton"


def gpu_unavailable(device):
    """Why features on ``device`` cannot take the GPU path (a string), or ``None``: it needs
    Triton (shipped with torch's CUDA builds), and registers the Triton kernels on first use."""
    try:
        import triton  # noqa: F401
        from .kernels.triton import impls
    except ImportError as e:
        return f"features on {device}: the GPU path needs Triton ({e})"
    impls.register()
    return None


def synchronize(gpu):
    """Wait for the device's queued work, so a host clock reads the time of what ran."""
    if gpu and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def is_out_of_memory(error):
    """Whether ``error`` is an allocation failure (CUDA's, or a CPU allocator's)."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(error, oom) or "out of memory" in str(error).lower()


def free_cached_memory():
    """Give the CUDA caching allocator's free blocks back after an allocation failed."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def rng_state(gpu):
    """The random-number states a plan's first run may draw from (restored when it raises)."""
    cuda = gpu and torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None


def set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


GPU_MODELS = Path(__file__).resolve().parent.parent / "costmodels" / "gpu"


@functools.lru_cache(maxsize=None)
def gpu_cost_model(device, folder=None):
    """The cost model of GPU ``device`` (a string): the model fitted to timings profiled on
    this GPU (``granii/profiling/gpu.py``) in ``folder`` (default ``costmodels/gpu/``) when
    one names this GPU, pricing what it has; for the rest, and on a GPU without one (with a
    warning), the analytical model (``costmodel.AnalyticalCost``) with the card's rates
    measured once per process (``measure_rates``). The measured tie-break then settles the
    close choices."""
    from .costmodel import AnalyticalCost
    from .gpu_costmodel import load
    rates = measure_rates(torch.device(device))
    analytical = AnalyticalCost(name=f"analytical-gpu ({describe(device)})",
                                impl_factor=GPU_FACTORS, call_overhead=8e-6, **rates)
    fitted = load(GPU_MODELS if folder is None else folder, describe(device), analytical)
    if fitted is not None:
        return fitted
    warnings.warn(f"granii: no cost models trained on this GPU ({describe(device)}); pricing "
                  f"plans by its measured rates ({rates['stream_rate'] / 1e9:.0f} GB/s stream, "
                  f"{rates['gather_rate'] / 1e9:.0f} GB/s gather, "
                  f"{rates['flop_rate'] / 1e12:.1f} TFLOP/s) and timing the close ones",
                  RuntimeWarning, stacklevel=2)
    return analytical


# Relative speed of implementations on the GPU, read off results/gpu (H200, the 2M-node power-law
# graph): PyG's gather-scatter SpMM ran 7-8x cuSPARSE's; cuSPARSE's CSR product (torch_csr) 2.0x
# granii's Triton SpMM at 32 columns and 1.24x at 128 (run 3); the edge-wise torch GAT 24x the
# fused Triton one (fwd+bwd).
GPU_FACTORS = (("spmm", "torch", 8.0), ("spmm_norm", "torch", 8.0),
               ("spmm_weighted", "torch", 8.0), ("spmm_mean", "torch", 8.0),
               ("spmm", "torch_csr", 1.3), ("spmm_mean", "torch_csr", 1.4),
               ("spmm_weighted", "torch_csr", 1.5), ("gat_aggregate", "torch", 8.0),
               ("sddmm_add", "torch", 2.0), ("edge_softmax", "torch", 3.0))


def describe(device):
    """The GPU as its cost model is named: model, SMs, memory, CUDA, torch and driver versions
    (a fitted model serves a GPU of the same model and SM count)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"{dev} (the GPU path on the CPU)"
    p = torch.cuda.get_device_properties(dev)
    return (f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
            f"CUDA {torch.version.cuda}, torch {torch.__version__}, driver {driver_version()}")


def driver_version(path="/proc/driver/nvidia/version"):
    """The NVIDIA kernel driver's version (Linux), or ``"unknown"``."""
    try:
        text = Path(path).read_text()
    except OSError:
        return "unknown"
    words = text.split("Kernel Module", 1)[-1].split()
    return words[0] if words and words[0][:1].isdigit() else "unknown"


def free_memory(device, share=0.8):
    """Bytes a plan's predicted extra memory may take on a GPU ``device``: ``share`` of what
    the device has free now (``None`` on the CPU, where no such limit is set)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(share * free)


def measure_rates(device, size=1 << 24):
    """``{"stream_rate", "gather_rate", "flop_rate"}`` of ``device`` in bytes or flops per
    second: a copy of ``size`` floats (bytes read and written), a gather of ``size`` floats in
    random rows of 32 (bytes gathered), and a 1024-square float32 product; best of three each,
    after a warm-up."""
    size = size if device.type == "cuda" else size // 16
    x = torch.randn(size, device=device)
    rows = x.reshape(-1, 32)
    idx = torch.randint(0, rows.shape[0], (rows.shape[0],), device=device)
    m = 1024 if device.type == "cuda" else 256
    a = torch.randn(m, m, device=device)

    def best(fn):
        fn()
        times = []
        for _ in range(3):
            synchronize(device.type == "cuda")
            t = time.perf_counter()
            fn()
            synchronize(device.type == "cuda")
            times.append(time.perf_counter() - t)
        return max(min(times), 1e-9)
    return {"stream_rate": 8 * size / best(lambda: x.clone()),
            "gather_rate": 4 * size / best(lambda: rows.index_select(0, idx)),
            "flop_rate": 2 * m ** 3 / best(lambda: a @ a)}
