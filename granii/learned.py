"""Learned per-(primitive, implementation) cost models (XGBoost), trained per machine.

One gradient-boosted tree ensemble per (primitive, implementation, phase) predicts the natural log
of the seconds of one call:

    log t = log b(prim, sizes, graph) + f(features)

``b`` is a roofline baseline (``baseline_seconds``: flops and bytes at fixed nominal rates plus a
call overhead) passed to XGBoost as the base margin, and the trees ``f`` learn the correction: the
achieved efficiency as a function of the graph's structure and the sizes. Trees are constant
outside the range they were trained on; with the baseline as margin a graph or size larger than
any profiled one still scales with its work instead of saturating.

Phases: ``"forward"``, one call without autograd, and ``"train"``, the forward with autograd and
the backward computing the gradients of the operands ``TRAIN_GRADS`` names (its baseline counts
one forward more per gradient). ``granii.select`` prices a training step from both.

Features (``model_features``): for the sparse primitives ``featurize(gi, sizes)`` with the sizes of
``MODEL_SIZES`` (``k`` for the SpMMs and the fused normalised SpMM, ``heads`` for edge scores and
softmax, ``heads`` and ``k = heads x F`` for the fused GAT aggregation, ``heads`` and the shared
width ``k`` for the per-head sum ``spmm_heads``, none for ``sddmm_scale``); the dense primitives
do not depend on the graph and see only their sizes (``dense_features``: each size, pairwise and
full products, their log2; ``head_gemm``'s are ``m``, ``k``, ``n = heads x F`` and ``heads``).

Models live in ``costmodels/<fingerprint id>/`` (``granii.fingerprint``) as one XGBoost JSON file
per model and a ``manifest.json`` (with the machine's calibration, ``granii.calibration``);
``load`` refuses a folder made for another machine or feature set, with the command that fixes
it (a damaged model file: when its model is first needed). ``default_cost_model`` returns this machine's models; without them, the models of
another machine rescaled by a short calibration of this one (``granii.calibration.Transfer``); a
pair no model covers is priced by the analytical roofline with calibrated rates. Each of these
substitutions is announced once.
"""
import functools
import hashlib
import itertools
import json
import math
import mmap
import os
import warnings
from pathlib import Path

import numpy as np

from . import diskcache
from .diskcache import cache_dir
from .costmodel import PRICED_AS, AnalyticalCost
from .featurize import feature_names, featurize
from .fingerprint import differences, fingerprint_id, machine_fingerprint

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / "costmodels"
FIX = "bash scripts/init.sh (or the console command granii-init; add --quick for a short run)"
MANIFEST = "manifest.json"
FORMAT = 1
BASELINE = "roofline-v1"

# primitive -> ("dense" or "graph", size names the model reads from ``dims``)
MODEL_SIZES = {
    "gemm": ("dense", ("m", "k", "n")),
    "row_scale": ("dense", ("n", "k")),
    "spmm": ("graph", ("k",)),
    "spmm_weighted": ("graph", ("k",)),
    "spmm_mean": ("graph", ("k",)),
    "spmm_max": ("graph", ("k",)),
    "sddmm_scale": ("graph", ()),
    "sddmm_add": ("graph", ("heads",)),
    "edge_softmax": ("graph", ("heads",)),
    "spmm_norm": ("graph", ("k",)),
    "gat_aggregate": ("graph", ("heads", "k")),
    "spmm_heads": ("graph", ("heads", "k")),
    "head_gemm": ("dense", ("m", "k", "n", "heads")),
    "head_dot": ("dense", ("m", "k", "n")),
}
# The phases a model can be trained for: "forward" (one call, no autograd) and "train" (the
# forward with autograd and the backward of the gradients ``TRAIN_GRADS`` names).
PHASES = ("forward", "train")
# primitive -> positions (among the arguments after ``gi``) of the operands whose gradient the
# profiled training call computes: features, weights, edge values and attention terms; never
# degree vectors (they depend on the graph alone).
TRAIN_GRADS = {
    "gemm": (0, 1), "row_scale": (1,), "spmm": (0,), "spmm_mean": (0,), "spmm_max": (0,),
    "spmm_weighted": (0, 1), "sddmm_scale": (), "sddmm_add": (0, 1), "edge_softmax": (0,),
    "spmm_norm": (2,), "gat_aggregate": (0, 1, 2), "spmm_heads": (0, 1), "head_gemm": (0, 1),
    "head_dot": (0, 1),
}
SIZE_DEFAULTS = {"heads": 1}

# nominal rates of the baseline (only its shape matters: the trees learn the scale)
_FLOPS, _STREAM, _GATHER, _CALL = 40e9, 8e9, 3e9, 5e-6


class CostModelError(ValueError):
    """A cost-model folder that cannot be used on this machine, with the reason and the fix."""


class CostModelWarning(UserWarning):
    pass


# -- features and baseline (shared by training and prediction) --------------------------------------
def model_sizes(prim, dims):
    """``{size name: value}`` the model of ``prim`` reads from a call's ``dims``."""
    _, names = MODEL_SIZES[prim]
    return {s: dims[s] if s in dims else SIZE_DEFAULTS[s] for s in names}


def dense_feature_names(size_names):
    """Names of ``dense_features`` for sizes ``size_names`` (in the given order)."""
    names = [x for s in size_names for x in (s, f"log2_{s}")]
    for a, b in itertools.combinations(size_names, 2):
        names += [f"{a}*{b}", f"log2_{a}*{b}"]
    if len(size_names) > 2:
        names += ["*".join(size_names), "log2_" + "*".join(size_names)]
    return names + ["log2_pair_sum"]


def dense_features(sizes):
    """Sizes, their pairwise products and (for three) the full product, with log2; last
    ``log2(sum of pairwise products)``: the elements the operands and result hold (GEMM)."""
    vals = [float(v) for v in sizes.values()]
    row = [x for v in vals for x in (v, math.log2(max(v, 1.0)))]
    pairs = [a * b for a, b in itertools.combinations(vals, 2)]
    for p in pairs:
        row += [p, math.log2(max(p, 1.0))]
    if len(vals) > 2:
        p = math.prod(vals)
        row += [p, math.log2(max(p, 1.0))]
    row.append(math.log2(max(sum(pairs), 1.0)))
    return np.array(row, dtype=np.float64)


def model_feature_names(prim):
    """Column names of the features of ``prim``'s model, as ``model_features`` builds them."""
    return list(_feature_names(prim))


@functools.lru_cache(maxsize=None)
def _feature_names(prim):
    kind, names = MODEL_SIZES[prim]
    return tuple(dense_feature_names(names) if kind == "dense" else feature_names(names))


def model_features(prim, gi, dims):
    """Feature row of one call: ``dense_features`` or ``featurize(gi, sizes)``."""
    kind, _ = MODEL_SIZES[prim]
    sizes = model_sizes(prim, dims)
    return dense_features(sizes) if kind == "dense" else featurize(gi, sizes)


def baseline_seconds(prim, dims, num_src=0, num_dst=0, num_edges=0):
    """Roofline seconds of one call: ``flops / 40e9 + streamed bytes / 8e9 + gathered bytes / 3e9
    + 5 us``. Sparse kernels gather one ``k``-row of ``X`` (or ``heads`` scores) per edge."""
    s = model_sizes(prim, dims) if prim in MODEL_SIZES else dict(dims)
    e, f = float(num_edges), 4.0
    if prim in ("gemm", "head_gemm"):           # head_gemm: n = H F, X of shape (m, H, k)
        m, k, n, h = s["m"], s["k"], s["n"], s.get("heads", 1)
        t = 2.0 * m * k * n / _FLOPS + f * (m * h * k + k * n + m * n) / _STREAM
    elif prim == "row_scale":
        t = 2 * f * s["n"] * s["k"] / _STREAM
    elif prim == "head_dot":                   # X (m, k = H F) read once, (m, n = H) written
        t = f * s["m"] * (s["k"] + s["n"]) / _STREAM
    elif prim == "spmm_heads":                 # X rows gathered once for all heads
        h, k = s["heads"], s["k"]
        t = f * e * k / _GATHER + f * num_dst * h * k / _STREAM + f * e * h / _STREAM
    elif prim.startswith("spmm"):
        k = s["k"]
        t = f * e * k / _GATHER + f * num_dst * k / _STREAM + 8 * e / _STREAM
    elif prim == "gat_aggregate":
        h, k = s["heads"], s["k"]
        t = f * e * (k + 2 * h) / _GATHER + f * num_dst * k / _STREAM + 8 * e / _STREAM
    elif prim == "sddmm_scale":
        t = 3 * f * e / _GATHER + f * (num_src + num_dst) / _STREAM
    elif prim == "sddmm_add":
        h = s["heads"]
        t = 2 * f * e * h / _GATHER + f * e * h / _STREAM + 8 * e / _STREAM
    elif prim == "edge_softmax":
        h = s["heads"]
        t = 2 * f * e * h / _GATHER + 4 * f * e * h / _STREAM + f * num_dst * h / _STREAM
    else:
        t = f * max(float(s.get("n", 1)), 1.0) / _STREAM
    return t + _CALL


def model_inputs(prim, gi, dims, phase="forward"):
    """``(feature row, base margin = log baseline seconds)`` of one call on graph ``gi``
    (``None`` for the dense primitives). A training call's baseline counts one forward per
    gradient it computes beside its own forward."""
    if MODEL_SIZES[prim][0] == "dense":
        b = baseline_seconds(prim, dims)
    else:
        b = baseline_seconds(prim, dims, gi.num_src, gi.num_dst, gi.num_edges)
    if phase == "train":
        b *= 1 + len(TRAIN_GRADS.get(prim, ()))
    return model_features(prim, gi, dims), math.log(b)


def model_file(prim, impl, phase="forward"):
    return f"{prim}__{impl}.json" if phase == "forward" else f"{prim}__{impl}__{phase}.json"


def model_key(prim, impl, phase="forward"):
    """The manifest key of a model: ``prim/impl`` (forward) or ``prim/impl/train``."""
    return f"{prim}/{impl}" if phase == "forward" else f"{prim}/{impl}/{phase}"


def parse_model_key(key):
    """``(prim, impl, phase)`` of a manifest key."""
    prim, impl, phase = (key.split("/") + ["forward"])[:3]
    return prim, impl, phase


# -- tree ensembles --------------------------------------------------------------------------------
class Trees:
    """An XGBoost regression tree ensemble, from its JSON model, evaluated without XGBoost.

    Node ``i`` of a tree sends a row left when ``x[split_indices[i]] < split_conditions[i]``
    (compared in float32, as XGBoost does; a missing value goes by ``default_left``); a leaf
    (``left_children[i] == -1``) holds its value in ``split_conditions[i]``. The prediction is the
    base margin plus the sum of the leaves reached: walked tree by tree by the native extension
    (about 5 us a row), or with numpy, all trees one level per step (``depth`` vectorised steps,
    about 60 us a row); one thread, deterministic.
    """

    def __init__(self, model):
        learner = model["learner"]
        booster = learner["gradient_booster"]
        if booster.get("name") != "gbtree":
            raise ValueError(f"booster {booster.get('name')!r} is not gbtree")
        trees = booster["model"]["trees"]
        self.num_features = int(learner["learner_model_param"]["num_feature"])
        width = max((len(t["left_children"]) for t in trees), default=1)
        shape = (max(len(trees), 1), width)
        self.left = np.full(shape, -1, dtype=np.int64)
        self.right = np.full(shape, -1, dtype=np.int64)
        self.feature = np.zeros(shape, dtype=np.int64)
        self.cond = np.zeros(shape, dtype=np.float32)
        self.default_left = np.zeros(shape, dtype=bool)
        for i, t in enumerate(trees):
            n = len(t["left_children"])
            if any(t.get("split_type", [0])) or t.get("categories"):
                raise ValueError("categorical splits are not supported")
            self.left[i, :n] = t["left_children"]
            self.right[i, :n] = t["right_children"]
            self.feature[i, :n] = t["split_indices"]
            self.cond[i, :n] = t["split_conditions"]
            self.default_left[i, :n] = np.asarray(t["default_left"], dtype=bool)
        self._check_splits()
        self.depth = self._depth()
        self.rows = np.arange(shape[0])[None, :]

    def _check_splits(self):
        if self.feature.max(initial=0) >= max(self.num_features, 1) or \
                self.feature.min(initial=0) < 0:
            raise ValueError("a split reads a feature beyond num_feature")
        width = self.left.shape[1]
        for children in (self.left, self.right):
            if children.max(initial=-1) >= width or children.min(initial=-1) < -1:
                raise ValueError("a tree node points outside its tree")

    ARRAYS = ("left", "right", "feature", "cond", "default_left")

    @classmethod
    def from_arrays(cls, arrays, checked=True):
        """The ensemble from the arrays ``ARRAYS`` (as kept in the cache: indices and flags may
        be int32) plus ``num_features`` and ``depth``. ``checked`` false: the indices are
        checked when first walked by numpy (``predict_numpy``); the native walk checks each
        index it reads, so a process that predicts natively never reads the arrays whole."""
        trees = cls.__new__(cls)
        for name in cls.ARRAYS:
            setattr(trees, name, np.asarray(arrays[name]))
        trees.num_features, trees.depth = int(arrays["num_features"]), int(arrays["depth"])
        if len({getattr(trees, name).shape for name in cls.ARRAYS}) != 1 or trees.left.ndim != 2:
            raise ValueError("inconsistent tree arrays")
        trees._checked = False
        if checked:
            trees._check_splits()
            trees._checked = True
        trees.rows = np.arange(trees.left.shape[0])[None, :]
        return trees

    @classmethod
    def from_flat(cls, flat):
        """The ensemble kept as one int32 array, as a cache file holds it (``_cached_trees``, its
        header checked there): the native walk reads the array as it is; the arrays ``ARRAYS``
        are views of it made when first read (``__getattr__``), for numpy."""
        trees = cls.__new__(cls)
        trees._flat = flat
        trees.num_features, trees.depth = int(flat[2]), int(flat[3])
        trees._checked = False
        return trees

    def __getattr__(self, name):
        # only for an attribute not set: the arrays of an ensemble made by ``from_flat``
        flat = self.__dict__.get("_flat")
        if flat is None or name not in self.ARRAYS + ("rows",):
            raise AttributeError(name)
        t, w = int(flat[4]), int(flat[5])
        self.left, self.right, self.feature, cond, self.default_left = flat[6:].reshape(5, t, w)
        self.cond = cond.view(np.float32)
        self.rows = np.arange(t)[None, :]
        return getattr(self, name)

    def _depth(self):
        """Levels of the deepest tree: all trees' nodes, one level at a time from the roots."""
        tree = np.arange(self.left.shape[0])
        node = np.zeros_like(tree)
        for depth in range(self.left.shape[1] + 1):
            inner = self.left[tree, node] >= 0
            if not inner.any():
                return depth
            tree, node = tree[inner], node[inner]
            tree, node = (np.concatenate([tree, tree]),
                          np.concatenate([self.left[tree, node], self.right[tree, node]]))
        raise ValueError("a tree has a cycle")

    def predict(self, X, margin):
        """``margin + sum of leaves`` for each row of ``X`` (shape ``(rows, num_features)``): by
        the native walk (``csrc/forest.cpp``) when the extension is built, else by numpy (the
        same leaves; the sums may differ in the last bit)."""
        X = np.asarray(X, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} features, got {X.shape}")
        walk = _native_walk()
        if walk is None:
            return self.predict_numpy(X, margin)
        import torch
        x = torch.from_numpy(np.ascontiguousarray(X))
        flat, flat_walk = self.__dict__.get("_flat"), _native_flat_walk()
        if flat is not None and flat_walk is not None:
            if "_flat_tensor" not in self.__dict__:
                self._flat_tensor = torch.from_numpy(flat)
            sums = flat_walk(self._flat_tensor, x)
        else:
            if "_tensors" not in self.__dict__:     # in the dtypes they were read in: no copies
                self._tensors = [torch.from_numpy(np.ascontiguousarray(getattr(self, name)))
                                 for name in self.ARRAYS]
            sums = walk(*self._tensors, x, self.depth)
        return np.asarray(margin, dtype=np.float64) + sums.numpy()

    def predict_numpy(self, X, margin):
        """``predict`` by numpy: all trees advance one level per step."""
        if not self.__dict__.get("_checked", True):
            self._check_splits()
            self._checked = True
        X = np.asarray(X, dtype=np.float32)
        node = np.zeros((X.shape[0], self.left.shape[0]), dtype=np.int64)
        r = np.arange(X.shape[0])[:, None]
        for _ in range(self.depth):
            left, right = self.left[self.rows, node], self.right[self.rows, node]
            value = X[r, self.feature[self.rows, node]]
            go_left = np.where(np.isnan(value), self.default_left[self.rows, node],
                               value < self.cond[self.rows, node])
            node = np.where(left < 0, node, np.where(go_left, left, right))
        leaves = self.cond[self.rows, node].astype(np.float64)
        return np.asarray(margin, dtype=np.float64) + leaves.sum(axis=1)


@functools.lru_cache(maxsize=None)
def _native_walk():
    """``torch.ops.granii.forest_predict`` when the native extension is loaded, else ``None``."""
    try:
        import torch
        from .kernels import native
    except ImportError:             # no extension: numpy evaluates the trees
        return None
    return getattr(torch.ops.granii, "forest_predict", None) if native.AVAILABLE else None


@functools.lru_cache(maxsize=None)
def _native_flat_walk():
    """``torch.ops.granii.forest_predict_flat`` when the native walk is there, else ``None``."""
    if _native_walk() is None:
        return None
    import torch
    return getattr(torch.ops.granii, "forest_predict_flat", None)


# -- the cost model ---------------------------------------------------------------------------------
_TOKENS = itertools.count()
_WARNED = set()
_ROOFLINE = AnalyticalCost()


def _warn_once(msg, stacklevel=3):
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, CostModelWarning, stacklevel=stacklevel)


class _Lazy:
    """A value computed on first use (``get``): a calibration is only measured when a transferred
    model actually prices a call."""

    def __init__(self, make, analytical=False):
        self.make, self.value, self.done = make, None, False
        self.analytical = analytical        # makes the analytical model (LearnedCost.fallback)

    def get(self):
        if not self.done:
            self.value, self.done = self.make(), True
        return self.value


def _resolve(x):
    """``x``, or what it makes when it is a ``_Lazy`` (which may make another ``_Lazy``)."""
    while isinstance(x, _Lazy):
        x = x.get()
    return x


class LearnedCost:
    """Predicted seconds of primitive calls by the learned models of one model folder.

    ``predict(prim, impl, gi, dims)``: one forward call (no autograd). ``predict_train(prim, impl,
    gi, dims)``: the forward with autograd plus the backward computing the gradients of the
    operands ``TRAIN_GRADS[prim]`` names, or ``None`` when this folder has a forward model of the
    pair but no training one (the caller then estimates the backward from the forward).

    ``transfer`` (a ``granii.calibration.Transfer``, or ``None`` for models of this machine)
    rescales every prediction from the machine the models were trained on to this one.
    A pair without a model is priced by ``fallback`` (another folder's models transferred, or the
    analytical model), with one warning naming the pair and who prices it.

    Graph features are cached in ``gi.cache`` by ``featurize``; each prediction is cached there too,
    under this instance, the phase, the primitive, the implementation and ``dims``.
    """

    def __init__(self, trees, manifest, path=None, fallback=None, train_trees=None, transfer=None):
        self.trees = trees                       # {(prim, impl): Trees} of the forward
        self.train_trees = train_trees or {}     # {(prim, impl): Trees} of forward + backward
        self.manifest = manifest
        self.path = path
        self._fallback = fallback
        self._transfer = transfer
        fid = manifest.get("fingerprint_id", "?")
        self.name = f"learned ({fid})" if transfer is None else f"transferred ({fid}, calibrated)"
        self._token = ("learned_cost", next(_TOKENS))

    @property
    def fallback(self):
        fb = _resolve(self._fallback)
        self._fallback = fb if fb is not None else AnalyticalCost()
        return self._fallback

    def learned_fallback(self):
        """The fallback when it is other folders' learned models, else ``None``; the analytical
        fallback is not built here (building it measures this machine's calibration, a second
        or so, which a question about learned models should not cost)."""
        fb = self._fallback
        if isinstance(fb, _Lazy) and not fb.analytical:
            fb = self._fallback = fb.get()        # reads other folders' manifests, measures nothing
        return fb if isinstance(fb, LearnedCost) else None

    @property
    def transfer(self):
        self._transfer = _resolve(self._transfer)
        return self._transfer

    def has_model(self, prim, impl, phase="forward"):
        return (prim, impl) in (self.trees if phase == "forward" else self.train_trees)

    @property
    def complete(self):
        """Whether these models come from a full profile that ran to its end: a pair it lacks
        has no model anywhere (``select._learned`` then asks no other folder)."""
        run = self.manifest.get("run") or {}
        return run.get("mode") == "full" and run.get("stopped_early") is False

    def pricer(self, prim, impl, phase="forward"):
        """The name of the cost model that prices ``(prim, impl)`` in ``phase``."""
        prim, impl = PRICED_AS.get((prim, impl), (prim, impl))
        if self.has_model(prim, impl, phase):
            return self.name
        if phase != "forward" and self.has_model(prim, impl):
            return f"{self.name}, backward from the forward"
        fb = self.fallback
        return fb.pricer(prim, impl, phase) if isinstance(fb, LearnedCost) else fb.name

    def predict(self, prim, impl, gi, dims):
        return self._predict("forward", prim, impl, gi, dims, True)

    def predict_train(self, prim, impl, gi, dims):
        return self._predict("train", prim, impl, gi, dims, True)

    def _predict(self, phase, prim, impl, gi, dims, warn):
        prim, impl = PRICED_AS.get((prim, impl), (prim, impl))
        if prim not in MODEL_SIZES:      # add, cat, row_slice, diag_mul: never profiled
            return _ROOFLINE.predict(prim, impl, gi, dims) if phase == "forward" else None
        trees = self.trees if phase == "forward" else self.train_trees
        if (prim, impl) not in trees:
            if phase == "train" and (prim, impl) in self.trees:
                if warn and self.train_trees:
                    _warn_once(f"granii: no training-phase cost model for {prim}/{impl} in "
                               f"{self.name}; its backward is estimated from the forward",
                               stacklevel=4)
                elif warn:
                    _warn_once(f"granii: the models in {self.name} have no training-phase "
                               "models (made before backward passes were profiled); backward "
                               "passes are estimated from the forward", stacklevel=4)
                return None
            fb = self.fallback
            if warn:
                _warn_once(f"granii: no cost model for {prim}/{impl} in {self.name}; priced by "
                           f"{self.pricer(prim, impl, phase)}", stacklevel=4)
            if isinstance(fb, LearnedCost):
                return fb._predict(phase, prim, impl, gi, dims, False)
            return fb.predict(prim, impl, gi, dims) if phase == "forward" else None
        key = (self._token, phase, prim, impl, tuple(sorted(dims.items())))
        cache = getattr(gi, "cache", None)
        if cache is not None and key in cache:
            return cache[key]
        try:
            t = float(self.predict_many(prim, impl, gi, [dims], phase)[0])
        except KeyError:
            if (prim, impl) in trees:
                raise
            return self._predict(phase, prim, impl, gi, dims, warn)    # its file was damaged
        if cache is not None:
            cache[key] = t
        return t

    def predict_many(self, prim, impl, gi, dims_list, phase="forward", rescale=True):
        """Seconds for several ``dims`` on one graph, in one batch (``gi`` may differ per row if
        a list of graphs is given); ``rescale=False``: on the machine the models were trained
        on (no transfer)."""
        trees = (self.trees if phase == "forward" else self.train_trees)[(prim, impl)]
        gis = gi if isinstance(gi, (list, tuple)) else [gi] * len(dims_list)
        rows, margins = zip(*(model_inputs(prim, g, d, phase) for g, d in zip(gis, dims_list)))
        t = np.exp(trees.predict(np.vstack(rows), np.array(margins)))
        tr = self.transfer if rescale else None
        if tr is not None:
            t = np.array([tr.scale(prim, float(x), impl) for x in t])
        return t


def _read_manifest(path):
    mpath = path / MANIFEST
    if not path.is_dir():
        raise CostModelError(f"granii: no cost-model folder {path}: run {FIX}")
    if not mpath.is_file():
        raise CostModelError(f"granii: {path} holds no {MANIFEST} (an interrupted or partial "
                             f"install): run {FIX}")
    try:
        manifest = diskcache.parsed_json(mpath)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CostModelError(f"granii: {mpath} is not readable JSON ({e}): re-run {FIX}") from None
    missing = [k for k in ("format", "fingerprint", "fingerprint_id", "models")
               if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise CostModelError(f"granii: {mpath} lacks {', '.join(missing)}: re-run {FIX}")
    if manifest["format"] != FORMAT:
        raise CostModelError(f"granii: {mpath} has format {manifest['format']}, this granii reads "
                             f"format {FORMAT}: re-run {FIX}")
    return manifest


def load(path, fingerprint=None, check=True):
    """The ``LearnedCost`` of the model folder ``path``, after checking it fits this machine.

    Refuses (``CostModelError``, naming the fix) a folder without a readable manifest, one made on
    another machine or setup (``fingerprint``: the expected one, by default this machine's at the
    current torch thread count; not checked with ``check=False``, for a transfer), one trained for
    another feature set, and missing model files. With the manifest's SHA-256 of each file (every
    folder made since the manifests kept them) no model file is read here: a file is checked
    against its hash when a prediction first needs its model (a damaged one is then priced as
    missing, with a warning naming it and the fix) and its parse cached under that hash; a
    later process reads the cache alone. Older folders are read and parsed whole here.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    if check:
        here = fingerprint if fingerprint is not None else machine_fingerprint()
        diff = differences(here, manifest["fingerprint"])
        if diff:
            raise CostModelError(
                f"granii: the cost models in {path} were made for another machine or setup "
                f"({'; '.join(diff)}): run {FIX} to profile this one")
    models = {"forward": {}, "train": {}}
    folder = str(path)
    for key, entry in manifest["models"].items():
        prim, impl, phase = parse_model_key(key)
        if prim not in MODEL_SIZES or phase not in models:
            continue
        want = model_feature_names(prim)
        if entry.get("features") != want or entry.get("baseline", BASELINE) != BASELINE:
            raise CostModelError(
                f"granii: the {key} model in {path} was trained for another feature set "
                f"({len(entry.get('features') or [])} features, {len(want)} now): re-run {FIX}")
        fpath = os.path.join(folder, entry.get("file", model_file(prim, impl, phase)))
        if entry.get("sha256"):      # checked against its hash and parsed on first use
            if not os.path.isfile(fpath):
                raise CostModelError(f"granii: cost-model file {fpath} is missing: re-run {FIX}")
            models[phase][(prim, impl)] = _LazyTrees(fpath, len(want), entry["sha256"])
        else:                        # folders made before the manifest kept hashes
            models[phase][(prim, impl)] = read_trees(fpath, len(want))
    return LearnedCost(_TreeMap(models["forward"]), manifest, path,
                       train_trees=_TreeMap(models["train"]))


def file_sha256(path):
    """Hex SHA-256 of a file's bytes (the manifest keeps one per model file)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _check_bytes(fpath, data, sha256):
    """``CostModelError`` unless ``data``, the bytes of the model file ``fpath``, have the
    manifest's ``sha256``."""
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CostModelError(f"granii: cost-model file {fpath} is damaged (its SHA-256 "
                             f"differs from the manifest's): re-run {FIX}")


def read_trees(fpath, n_features, sha256=None):
    """The ``Trees`` of one model file, or ``CostModelError`` naming the file and the fix. With
    the manifest's ``sha256`` of the file, its arrays are read from the cache of parsed models
    when there, and otherwise parsed from the file (after checking its bytes have that hash) and
    put there: a process then reads a few small binary files instead of hashing and parsing
    megabytes of JSON."""
    trees = _cached_trees(sha256)
    if trees is not None and trees.num_features == n_features:
        return trees
    try:
        data = Path(fpath).read_bytes()
    except OSError as e:
        raise CostModelError(f"granii: cost-model file {fpath} is missing or damaged "
                             f"({e.strerror}): re-run {FIX}") from None
    if sha256:                      # the cache is keyed by the bytes parsed: check them first
        _check_bytes(fpath, data, sha256)
    try:
        trees = Trees(json.loads(data))
        n_feat = trees.num_features
    except (ValueError, KeyError, TypeError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CostModelError(
            f"granii: cost-model file {fpath} is missing or damaged ({first[:200]}): "
            f"re-run {FIX}") from None
    if n_feat != n_features:
        raise CostModelError(f"granii: cost-model file {fpath} expects {n_feat} features, "
                             f"its manifest {n_features}: re-run {FIX}")
    _cache_trees(sha256, trees)
    return trees


def trees_cache(sha256):
    """The cache file of the parsed model whose JSON has this SHA-256 (under ``GRANII_CACHE``)."""
    return Path(_trees_path(sha256))


def _trees_path(sha256):
    env = os.environ
    return os.path.join(_trees_dir(env.get("GRANII_CACHE"), env.get("HOME")), f"{sha256}.i32")


@functools.lru_cache(maxsize=8)
def _trees_dir(granii_cache, home):
    """The folder of the cached models for these values of ``GRANII_CACHE`` and ``HOME``, what
    ``diskcache.cache_dir`` reads (a first call reads a dozen models: the folder is found
    once, not for each)."""
    return os.path.join(cache_dir(), "trees")


def _mapped(path):
    """The int32 values of the file at ``path``, mapped into memory, not read: a prediction's
    walk touches a few nodes of each tree, so a model costs the pages it reads (0.8 ms for the
    dozen models of a first call, against 3 ms read whole). The mapping is private (copy on
    write: a write would stay in this process; the walks only read) and so writable, as torch
    wants the arrays it takes. The cache files are written beside and renamed over
    (``_cache_trees``), never rewritten in place, so a mapping stays whole."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size == 0:
            return np.empty(0, dtype="<i4")
        data = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)    # private: torch takes it as is
    finally:
        os.close(fd)
    return np.frombuffer(data, dtype="<i4", count=len(data) // 4)


# int32 header of a cache file: magic, format, num_features, depth, trees, nodes per tree
_CACHE_MAGIC, _CACHE_FORMAT = 0x67726E74, 1


def _cached_trees(sha256):
    """The cached ``Trees`` of a model file, or ``None`` (no hash, not cached, unreadable).

    A cache file is raw little-endian int32 values (no header to parse, no pickle; mapped, not
    read: ``_mapped``): ``_CACHE_MAGIC, _CACHE_FORMAT, num_features, depth, T, W``, then
    ``left``, ``right``, ``feature``, the bits of the float32 ``cond`` and ``default_left``,
    each ``T x W``."""
    if not sha256:
        return None
    try:
        flat = _mapped(_trees_path(sha256))
        if flat.dtype != np.int32 or flat.ndim != 1 or flat.size < 6 or \
                (int(flat[0]), int(flat[1])) != (_CACHE_MAGIC, _CACHE_FORMAT):
            return None
        n_feat, depth, t, w = (int(v) for v in flat[2:6])
        if t < 1 or w < 1 or depth < 0 or flat.size != 6 + 5 * t * w:
            return None
        return Trees.from_flat(flat)
    except (OSError, ValueError, EOFError):
        return None           # parsed again from the JSON, and the cache file written anew


def _cache_trees(sha256, trees):
    if not sha256:
        return
    path = trees_cache(sha256)
    t, w = trees.left.shape
    head = np.array([_CACHE_MAGIC, _CACHE_FORMAT, trees.num_features, trees.depth, t, w],
                    dtype=np.int32)
    body = [trees.left.astype(np.int32), trees.right.astype(np.int32),
            trees.feature.astype(np.int32), trees.cond.astype(np.float32).view(np.int32),
            trees.default_left.astype(np.int32)]
    # whole or not at all, whatever runs beside; a read-only home: the JSON is parsed each process
    diskcache.write_whole(path, np.concatenate([head] + [b.ravel() for b in body])
                          .astype("<i4").tobytes())


class _LazyTrees:
    """A model file whose bytes matched the manifest's hash, parsed on first use."""
    __slots__ = ("path", "n_features", "sha256")

    def __init__(self, path, n_features, sha256):
        self.path, self.n_features, self.sha256 = path, n_features, sha256


class _TreeMap(dict):
    """``{(prim, impl): Trees}`` whose files are parsed when first looked up (a 13 MB folder of
    JSON takes 0.4 s to parse; a run needs a few of its models)."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, _LazyTrees):
            try:
                value = read_trees(value.path, value.n_features, value.sha256)
            except CostModelError as e:       # as a file missing from the folder from now on
                _warn_once(f"{e}; until then {key[0]}/{key[1]} is priced as if it had no model",
                           stacklevel=5)
                dict.__delitem__(self, key)
                raise KeyError(key) from None
            self[key] = value
        return value

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def values(self):
        return [v for _, v in self.items()]

    def items(self):
        out = []
        for k in list(self):
            v = self.get(k)
            if v is not None:
                out.append((k, v))
        return out


_LOADED = {}


def models_dir():
    """Where models are looked up: ``$GRANII_COSTMODELS`` if set, else ``costmodels/``."""
    return Path(os.environ.get("GRANII_COSTMODELS", DEFAULT_DIR))


def foreign_models(root, fp):
    """The loadable model folders of ``root`` made for other setups than ``fp``, closest first
    (same processor and threads, then same processor, then the most models)."""
    fid = fingerprint_id(fp)
    found = []
    for mpath in sorted(Path(root).glob(f"*/{MANIFEST}")):
        if mpath.parent.name == fid:
            continue
        try:
            m = load(mpath.parent, check=False)
        except CostModelError:
            continue
        theirs = m.manifest["fingerprint"]
        found.append(((theirs.get("cpu_model") != fp["cpu_model"],
                       theirs.get("threads") != fp["threads"],
                       -len(m.trees) - len(m.train_trees), mpath.parent.name), m))
    return [m for _, m in sorted(found, key=lambda x: x[0])]


def model_calibration(model):
    """Reference times of the machine ``model`` was trained on, as its own models predict them
    for the reference calls; the times measured at its init (manifest ``calibration``) only for
    a reference without a model. The models' predictions are consistent with what the models
    learned (the fastest rounds of the profiled points), whereas a calibration measured while
    other processes held the cores is not. The predictions are read from the manifest
    (``calibration.predicted``, written by ``granii-init``) when they were made for the current
    reference calls."""
    from . import calibration
    measured = (model.manifest.get("calibration") or {}).get("times") or {}
    theirs = calibration.stored_prediction(model.manifest)
    return {**measured, **(theirs if theirs is not None else calibration.predicted(model))}


def transferred(models, here):
    """``models`` (foreign ``LearnedCost``s, closest first) chained as fallbacks of each other,
    each rescaled by a ``Transfer`` to this machine's calibration ``here`` (a ``_Lazy``); the
    last falls back to the analytical model with calibrated rates. Returns the first of the
    chain (or that analytical model when ``models`` is empty)."""
    from . import calibration
    chain = _Lazy(lambda: AnalyticalCost(name="analytical (calibrated)",
                                         **calibration.analytical_rates(here.get()["times"])),
                  analytical=True)
    for m in reversed(models):
        m._transfer = _Lazy(lambda m=m: calibration.Transfer(model_calibration(m),
                                                               here.get()["times"]))
        m._fallback = chain
        m.name = f"transferred ({m.manifest['fingerprint_id']}, calibrated)"
        chain = m
    return chain


def default_cost_model(root=None):
    """The cost model granii uses on this machine, with one warning when it is not this
    machine's own:

    * the learned models of ``root/<fingerprint id>/`` when they fit this machine; pairs they
      lack are priced as below;
    * otherwise the models of the closest other setup in ``root``, rescaled by a short calibration
      of this machine (``granii.calibration``: a few seconds on first use, cached);
    * without any, the analytical model with the calibrated rates.
    """
    from . import calibration
    root = Path(root) if root is not None else models_dir()
    fp = machine_fingerprint()
    fid = fingerprint_id(fp)
    key = (str(root.resolve()), fid)
    if key in _LOADED:
        return _LOADED[key]
    path = root / fid
    own, reason = None, None
    try:
        own = load(path, fp)
    except CostModelError as e:
        reason = e
    here = _Lazy(lambda: calibration.this_machine(fp))
    if own is not None:         # other setups' models are read only if a pair lacks a model here
        own._fallback = _Lazy(lambda: transferred(
            foreign_models(root, fp) if root.is_dir() else [], here))
        _LOADED[key] = own
        return own
    foreign = foreign_models(root, fp) if root.is_dir() else []
    chain = transferred(foreign, here)
    scaled = (f"rescaled by a calibration of this machine (a few seconds once, cached in "
              f"{calibration.cache_dir()})")
    what = (f"the models of {foreign[0].manifest['fingerprint_id']} "
            f"({foreign[0].manifest['fingerprint'].get('cpu_model')}, "
            f"{foreign[0].manifest['fingerprint'].get('isa', 'vector extensions not recorded')}, "
            f"{foreign[0].manifest['fingerprint'].get('threads')} threads) {scaled}"
            if foreign else "the analytical cost model with this machine's calibrated rates")
    if (path / MANIFEST).exists():
        msg = f"{reason}. Using {what} meanwhile."
    else:
        msg = (f"granii: no learned cost models for this machine ({fp['cpu_model']}, "
               f"{fp['isa']}, {fp['threads']} threads, torch {fp['torch']}; id {fid}) in {root}; "
               f"using "
               f"{what}. Run {FIX} to profile this machine.")
    _warn_once(msg)
    model = _resolve(chain)
    _LOADED[key] = model
    return model
