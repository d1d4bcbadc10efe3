"""Which tests need DGL, for the two stacks (``scripts/test.sh`` runs both).

The DGL stack (``requirements.lock``) runs every test. The current stack
(``requirements-current.lock``: current torch with PyTorch Geometric, no DGL) runs the
framework-neutral ones. A test needs DGL when importing DGL is what fails in it: a test module
whose import needs DGL (``import dgl``, ``from dgl.nn import ...``) is skipped there as a whole,
and a test that fails, in its setup or its run, on ``import dgl`` (building a DGL graph, say) is
reported as skipped, the missing import as the reason; ``@pytest.mark.dgl`` marks a test that
needs DGL beforehand. ``NEUTRAL`` lists the modules that must run without DGL: in them a missing
DGL is a failure, not a skip.
"""
import importlib.util

import pytest

HAVE_DGL = importlib.util.find_spec("dgl") is not None
NEUTRAL = {"test_stacks.py", "test_head_dot.py", "test_segment_mm.py", "test_compile.py"}


def _needs_dgl(exc):
    """The ``ModuleNotFoundError`` for DGL in ``exc``'s chain of causes, or ``None``."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "dgl":
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


class _Module(pytest.Module):
    """A test module that is skipped, not failed, when its import needs DGL and DGL is absent."""

    def collect(self):
        try:
            self.obj                            # imports the test module
        except pytest.Collector.CollectError as e:
            missing = None if HAVE_DGL else _needs_dgl(e)
            if missing is None or self.path.name in NEUTRAL:
                raise
            pytest.skip(f"needs DGL ({missing}), which this stack does not have",
                        allow_module_level=True)
        return super().collect()


def pytest_pycollect_makemodule(module_path, parent):
    return _Module.from_parent(parent, path=module_path)


def pytest_configure(config):
    config.addinivalue_line("markers", "dgl: the test needs DGL (skipped on a stack without it)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if HAVE_DGL or not rep.failed or call.excinfo is None or item.path.name in NEUTRAL:
        return
    missing = _needs_dgl(call.excinfo.value)
    if missing is not None:
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0,
                        f"needs DGL ({missing}), which this stack does not have")


def pytest_collection_modifyitems(config, items):
    if HAVE_DGL:
        return
    skip = pytest.mark.skip(reason="needs DGL, which this stack does not have")
    for item in items:
        if item.get_closest_marker("dgl") is not None:
            item.add_marker(skip)
