"""A later fresh process's first ``granii(...)`` reads what the first one cached instead of
redoing it: no model file parsed or even read (the parsed trees are cached under each file's
hash), no reference graph built to predict a transferred folder's reference calls (stored in its
manifest), no calibration measured (cached per machine), no layer source parsed, no plan
enumerated and no generated code compiled (``granii.diskcache``). Each process is a real one
(subprocess); nothing here is timed."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(2)
import dgl
from dgl.nn import GraphConv
from granii import calibration, diskcache, learned, reference
from granii import api as granii_api, granii
from granii.runtime import variants

strict = sys.argv[1] == "strict"
calibration.measure = lambda repeat=7: {"stream": 2e-3, "gemm": 4e-3, "sparse": 6e-3,
                                        "small": 1e-4}
read = []
if strict:
    def boom(*a, **k):
        raise AssertionError("did again what the first process cached")
    reference.uniform = boom                       # no reference graph built
    calibration.measure = boom                     # no calibration measured
    learned.Trees.__init__ = boom                  # no model file parsed
    variants._enumerate = boom                     # no plan enumerated
    diskcache.compile = boom                       # no plan or check compiled
    import ast
    ast.parse = boom                               # no layer source parsed
    real_read = Path.read_bytes
    def recorded(self):
        if self.suffix == ".json":
            read.append(self.name)
        return real_read(self)
    Path.read_bytes = recorded
torch.manual_seed(0)
src, dst = torch.randint(0, 300, (2, 2400))        # the same graph in every process (DGL's
g = dgl.graph((src, dst), num_nodes=300)           # rand_graph draws from its own generator)
x = torch.randn(300, 16)
layer = GraphConv(16, 8, allow_zero_in_degree=True).eval()
with torch.no_grad():
    want = layer(g, x)
    granii(layer, g, x)
    got = layer(g, x)
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
model = learned.default_cost_model()
ran = next(iter(granii_api.what_ran(layer).values()))
print("RESULT " + json.dumps({"read": read, "model": model.name, "ran": ran.kind,
                              "why": ran.reason}))
"""


def _run(mode, env):
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def _own_folder(dest):
    """A shipped folder copied under this machine's fingerprint: this machine's own models."""
    from granii.fingerprint import fingerprint_id, machine_fingerprint
    fp = machine_fingerprint(2)                   # the child runs with 2 threads
    fid = fingerprint_id(fp)
    src = sorted((ROOT / "costmodels").glob("*/manifest.json"))[0].parent
    shutil.copytree(src, dest / fid)
    manifest = json.loads((dest / fid / "manifest.json").read_text())
    manifest["fingerprint"] = dict(manifest["fingerprint"], **fp)
    manifest["fingerprint_id"] = fid
    (dest / fid / "manifest.json").write_text(json.dumps(manifest))
    return dest


@pytest.mark.dgl                 # its child processes build DGL graphs
@pytest.mark.parametrize("models", ["shipped", "own"])
def test_a_later_process_reads_what_the_first_cached(tmp_path, models):
    """``shipped``: the checkout's folders as they are (on a machine without its own models,
    one transferred by a calibration); ``own``: a folder made for this machine."""
    env = dict(os.environ, GRANII_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="2")
    env.pop("GRANII_COSTMODELS", None)
    if models == "own":
        env["GRANII_COSTMODELS"] = str(_own_folder(tmp_path / "models"))
    first = _run("first", env)
    later = _run("strict", env)
    assert later["read"] == [] and later["model"] == first["model"]
    assert first["ran"] != "fallback" and later["ran"] != "fallback", later["why"]
    if models == "own":
        assert first["model"].startswith("learned (")
    assert any((tmp_path / "cache" / "trees").glob("*.i32"))
