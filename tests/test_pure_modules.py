"""The pure rules import no Lightning and no plotting stack: each is imported in a fresh Python whose
import system refuses lightning and matplotlib, so a user can read a probe record, fit a schedule or
plan a run on a machine without either, and a module that starts needing them fails here. The CBS probe's
callback imports no plotting library until it draws its curve."""

from __future__ import annotations

import subprocess
import sys

import pytest
from launch import subprocess_env

PURE_MODULES = [
    "lit_cbs",
    "lit_cbs.analysis",
    "lit_cbs.analysis.curves",
    "lit_cbs.analysis.fits",
    "lit_cbs.analysis.forecast",
    "lit_cbs.analysis.probe_schedule",
    "lit_cbs.errors",
    "lit_cbs.gns.estimator",
    "lit_cbs.gns.groups",
    "lit_cbs.models.hf",
    "lit_cbs.models.decoder",
    "lit_cbs.models.olmo",
    "lit_cbs.probe.reading",
    "lit_cbs.run.plan",
    "lit_cbs.rules.batch_schedules",
    "lit_cbs.rules.guard",
    "lit_cbs.rules.lr_schedules",
    "lit_cbs.rules.scaling",
    "lit_cbs.rules.smoothing",
    "lit_cbs.rules.warmup_core",
]

BLOCKED = ("lightning", "lightning_fabric", "pytorch_lightning", "matplotlib")

IMPORT_BLOCKED = f"""
import importlib, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked")

sys.meta_path.insert(0, Refuse())
failed = []
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except ImportError as error:
        failed.append(f"{{module}}: {{error}}")
print("\\n".join(failed))
"""


@pytest.mark.slow
def test_pure_modules_import_without_lightning_or_matplotlib():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_BLOCKED, *PURE_MODULES],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"these pure modules import a blocked package:\n{result.stdout}"


def test_the_block_refuses_what_it_should():
    # The check above is only as good as the block: a module that needs Lightning must fail under it.
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_BLOCKED, "lit_cbs.callbacks.warmup", "lit_cbs.analysis.plots"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert "lit_cbs.callbacks.warmup: lightning" in result.stdout
    assert "lit_cbs.analysis.plots: matplotlib" in result.stdout


def test_the_analysis_package_loads_plotting_on_first_use():
    code = (
        "import sys, lit_cbs.analysis as a; a.forecast_cbs; assert 'matplotlib' not in sys.modules; "
        "a.plot_forecast; assert 'matplotlib' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env(), timeout=120)


# Which lit_cbs module runs an import statement of matplotlib or scipy, while the modules in argv are imported. The
# import system cannot simply refuse them here: Lightning imports torchmetrics, which imports both where installed.
IMPORTS_OF_PLOTTING = """
import builtins, importlib, sys

real_import = builtins.__import__
seen = set()

def spy(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    if importer.startswith("lit_cbs") and name.partition(".")[0] in ("matplotlib", "scipy"):
        seen.add(f"{importer}: {name.partition('.')[0]}")
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = spy
for module in sys.argv[1:]:
    importlib.import_module(module)
print("\\n".join(sorted(seen)))
"""


def plotting_imports(*modules: str) -> list[str]:
    """``importer: package`` for each lit_cbs module that imports matplotlib or scipy while a fresh Python imports
    ``modules``."""
    command = [sys.executable, "-c", IMPORTS_OF_PLOTTING, *modules]
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_probe_callback_imports_no_plotting_library_until_it_draws():
    # scipy comes with the EMA a branch is scored by, not with the metrics-CSV reader or a plot.
    assert plotting_imports("lit_cbs.probe.callback") == ["lit_cbs.rules.smoothing: scipy"]
    # What _draw imports when it draws does import matplotlib: the check sees it.
    assert "lit_cbs.analysis.plots: matplotlib" in " ".join(plotting_imports("lit_cbs.analysis.plots"))
