"""The walkthrough notebook runs from top to bottom, and its committed outputs are there."""
import json
import os
import subprocess
import sys
from pathlib import Path

import dgl  # noqa: F401  - the walkthrough runs DGL models: skipped on a stack without DGL

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "walkthrough.ipynb"


def test_every_cell_of_the_walkthrough_completes():
    env = dict(os.environ, OMP_NUM_THREADS="2", MPLBACKEND="Agg")
    res = subprocess.run([sys.executable, "-m", "notebooks.run", str(NOTEBOOK), "--check"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    code_cells = sum(c["cell_type"] == "code" for c in json.loads(NOTEBOOK.read_text())["cells"])
    assert res.stdout.count("cell ") == code_cells


def test_the_committed_notebook_has_its_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["execution_count"] for c in code)
    kinds = {o["output_type"] for c in code for o in c["outputs"]}
    assert "error" not in kinds and "display_data" in kinds      # the plots are there
    text = "".join("".join(o.get("text", "")) for c in code for o in c["outputs"])
    assert "largest difference from DGL's output" in text and "== layer" in text


def test_a_failing_cell_fails_the_run(tmp_path):
    """The runner stops at a cell that raises and writes nothing."""
    nb = {"cells": [{"cell_type": "code", "source": "x = 1", "outputs": [], "metadata": {},
                     "execution_count": None},
                    {"cell_type": "code", "source": "raise ValueError('broken cell')",
                     "outputs": [], "metadata": {}, "execution_count": None}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "bad.ipynb"
    path.write_text(json.dumps(nb))
    res = subprocess.run([sys.executable, "-m", "notebooks.run", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "broken cell" in res.stderr
    assert json.loads(path.read_text()) == nb
