"""What ``pip install .`` installs, and what the library imports.

The distribution holds the package ``granii`` alone (the profiler is ``granii.profiling``; the
benchmarks and scripts stay in the repository); the library's modules import one another without
a cycle and never import the repository's tooling, and nothing outside ``granii.profiling``
imports the profiler.
"""
import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "granii"
TOOLING = ("scripts", "bench", "profiler", "tests")


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _library_modules():
    return {_module_name(p): p for p in LIB.rglob("*.py")}


def _imports(name, path, modules):
    """``(module names imported, top-level names imported)`` by the file, at any depth
    (function-level imports count: they run too). ``from a import b`` imports ``a.b`` when that
    is a module, else ``a``."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
    return found


def _graph():
    modules = _library_modules()
    return {n: _imports(n, p, modules) for n, p in modules.items()}, modules


def _cycle(graph):
    """One import cycle among the graph's nodes (a list of names), or ``None``."""
    state = {}

    def visit(n, stack):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m, stack)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n, [])
            if found:
                return found
    return None


def test_library_modules_import_no_cycle():
    imports, modules = _graph()
    graph = {n: {m for m in found if m in modules and m != n} for n, found in imports.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_library_imports_no_tooling_and_only_the_profiler_imports_it():
    imports, _ = _graph()
    bad = sorted((n, m) for n, found in imports.items() for m in found
                 if m.split(".")[0] in TOOLING)
    assert not bad, f"the library imports repository tooling: {bad}"
    profiling = sorted((n, m) for n, found in imports.items() for m in found
                       if m.startswith("granii.profiling") and not n.startswith("granii.profiling"))
    assert not profiling, f"library modules import the profiler: {profiling}"


def test_only_granii_packages_are_found():
    """The packages setuptools puts into the distribution, as pyproject.toml configures it."""
    import setuptools
    import tomllib
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = conf["tool"]["setuptools"]["packages"]["find"]
    found = setuptools.find_packages(str(ROOT), include=find.get("include", ("*",)),
                                     exclude=find.get("exclude", ()))
    assert "granii" in found and "granii.profiling" in found
    assert all(p == "granii" or p.startswith("granii.") for p in found), found


def test_console_commands_are_in_the_library():
    import tomllib
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    scripts = conf["project"]["scripts"]
    assert {"granii-init", "granii-explain"} <= set(scripts)
    modules = _library_modules()
    for command, target in scripts.items():
        module, _, func = target.partition(":")
        assert module in modules, f"{command} runs {module}, which is not installed"
        tree = ast.parse(modules[module].read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == func for n in tree.body), target


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the tracked files")
def test_wheel_holds_only_granii(tmp_path):
    """``pip wheel`` of the project (its tracked files, the native build skipped): every file
    under ``granii/``, the console commands pointing into it, tooling-only packages extras."""
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "granii",
                            "pyproject.toml", "setup.py", "README.md"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    env = dict(os.environ, GRANII_NO_NATIVE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", str(src), "-w", str(tmp_path / "dist")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("granii-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_dir = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = z.read(f"{meta_dir}/entry_points.txt").decode()
        metadata = z.read(f"{meta_dir}/METADATA").decode()
    tops = {n.split("/")[0] for n in names} - {meta_dir}
    assert tops == {"granii"}, tops
    assert "granii/profiling/init_machine.py" in names
    targets = [line.split("=", 1)[1].strip() for line in entry_points.splitlines()
               if "=" in line]
    assert "granii.profiling.init_machine:main" in targets
    assert all(t.startswith("granii.") for t in targets), targets
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    unconditional = {r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip()
                     for r in requires if "extra ==" not in r}
    assert {"torch", "numpy"} <= unconditional
    # the framework is an extra: granii imports where only one of DGL and PyG is installed
    extras = {r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip().replace("_", "-")
              for r in requires if "extra ==" in r}
    assert "dgl" not in unconditional and {"dgl", "torch-geometric"} <= extras, requires
    assert not unconditional & {"pytest", "hypothesis", "matplotlib", "tqdm", "pandas"}, \
        json.dumps(sorted(unconditional))


def test_shipped_cost_models_can_match_some_machine():
    """Each folder of ``costmodels/`` is named by its manifest's fingerprint id, and that
    fingerprint has every field ``machine_fingerprint`` fills in (a folder without one, such as
    the vector extension, differs from every machine's fingerprint and is never loaded as its
    own). ``costmodels/gpu`` holds the GPUs' fitted models, named by their GPU
    (``test_gpu_costmodel``)."""
    from granii.fingerprint import FIELDS, fingerprint_id, machine_fingerprint
    here = machine_fingerprint()
    assert set(FIELDS) <= set(here) and all(here[k] is not None for k in FIELDS)
    folders = sorted(p for p in (ROOT / "costmodels").iterdir() if p.is_dir() and p.name != "gpu")
    assert folders
    for folder in folders:
        manifest = json.loads((folder / "manifest.json").read_text())
        fp = manifest["fingerprint"]
        missing = [k for k in FIELDS if fp.get(k) is None]
        assert not missing, f"costmodels/{folder.name} lacks {missing}: it can match no machine"
        assert fingerprint_id(fp) == folder.name == manifest["fingerprint_id"]


def test_pyg_frontend_loads_with_the_first_pyg_layer():
    """``import granii`` does not load PyTorch Geometric's frontend (milliseconds of a DGL user's
    first call); wrapping a PyG layer does, and the layer then runs a plan."""
    pytest.importorskip("torch_geometric")
    code = (
        "import sys, torch, granii\n"
        "assert 'granii.pyg' not in sys.modules\n"
        "from torch_geometric.nn import GCNConv\n"
        "assert 'granii.pyg' not in sys.modules\n"
        "torch.manual_seed(0)\n"
        "conv, x = GCNConv(4, 4), torch.randn(30, 4)\n"
        "ei = torch.randint(0, 30, (2, 90))\n"
        "want = conv(x, ei)\n"
        "granii.granii(conv, x, ei, tune=False)\n"
        "torch.testing.assert_close(conv(x, ei), want, rtol=1e-4, atol=1e-5)\n"
        "assert 'granii.pyg' in sys.modules\n"
        "print(next(iter(granii.api.what_ran(conv).values())).kind)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["plan"]
