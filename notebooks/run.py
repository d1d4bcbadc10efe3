"""Run a notebook's code cells in order, in one namespace, and store their outputs in it.

    python -m notebooks.run notebooks/walkthrough.ipynb            # run, write outputs in place
    python -m notebooks.run notebooks/walkthrough.ipynb --check    # run, write nothing

A small stand-in for Jupyter's executor, so running the walkthrough needs nothing beyond the
project's own requirements: each code cell's printed text becomes a ``stream`` output, the value
of its last expression an ``execute_result`` (its ``repr``; none after a closing ``;``), and every matplotlib figure open at
its end a ``display_data`` PNG (then closed). A cell that raises stops the run (exit status 1,
the traceback printed); outputs are written only when every cell completed. The notebook opens
in Jupyter as usual (nbformat 4).
"""
import argparse
import ast
import base64
import contextlib
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _source(cell):
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _lines(text):
    return text.splitlines(keepends=True)


def _figures():
    """PNG outputs of the open matplotlib figures, which are then closed."""
    if "matplotlib.pyplot" not in sys.modules:
        return []
    import matplotlib.pyplot as plt
    out = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png", dpi=80, bbox_inches="tight")
        out.append({"output_type": "display_data", "metadata": {},
                    "data": {"image/png": base64.b64encode(buf.getvalue()).decode(),
                             "text/plain": ["<Figure>"]}})
    plt.close("all")
    return out


def run_cell(code, ns, count):
    """``outputs`` of one cell run in ``ns`` (raises what the cell raises)."""
    tree = ast.parse(code)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(tree, f"<cell {count}>", "exec"), ns)
        value = eval(compile(last, f"<cell {count}>", "eval"), ns) if last is not None else None
    outputs = []
    if buf.getvalue():
        outputs.append({"output_type": "stream", "name": "stdout", "text": _lines(buf.getvalue())})
    outputs += _figures()
    if value is not None:
        outputs.append({"output_type": "execute_result", "execution_count": count,
                        "metadata": {}, "data": {"text/plain": _lines(repr(value))}})
    return outputs


def run(path, write=True, log=print):
    """Run every code cell of the notebook at ``path`` (module doc); returns the seconds each
    took. Runs from the repository root, with the root on ``sys.path``."""
    path = Path(path)
    nb = json.loads(path.read_text())
    os.chdir(ROOT)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import matplotlib
    matplotlib.use("Agg")
    ns = {"__name__": "__main__"}
    count, times = 0, []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        count += 1
        t0 = time.perf_counter()
        cell["outputs"] = run_cell(_source(cell), ns, count)
        cell["execution_count"] = count
        times.append(time.perf_counter() - t0)
        log(f"cell {count}: {times[-1]:.1f} s")
    if write:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook")
    ap.add_argument("--check", action="store_true", help="run only; write nothing")
    args = ap.parse_args(argv)
    try:
        run(args.notebook, write=not args.check)
    except Exception:                      # noqa: BLE001 - the failing cell's traceback, exit 1
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
