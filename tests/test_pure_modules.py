"""The pure rules import no Lightning and no plotting stack: each is imported in a fresh Python whose
import system refuses lightning and matplotlib, so a user can read a probe record, fit a schedule or
plan a run on a machine without either, and a module that starts needing them fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest
from launch import subprocess_env

PURE_MODULES = [
    "lit_cbs",
    "lit_cbs.analysis",
    "lit_cbs.analysis.compare",
    "lit_cbs.analysis.curves",
    "lit_cbs.analysis.fits",
    "lit_cbs.analysis.forecast",
    "lit_cbs.analysis.probe_schedule",
    "lit_cbs.errors",
    "lit_cbs.gns.config",
    "lit_cbs.gns.estimator",
    "lit_cbs.gns.groups",
    "lit_cbs.models.decoder",
    "lit_cbs.models.olmo",
    "lit_cbs.probe.reading",
    "lit_cbs.recipes.plan",
    "lit_cbs.rules.batch_schedules",
    "lit_cbs.rules.guard",
    "lit_cbs.rules.lr_schedules",
    "lit_cbs.rules.scaling",
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
        [sys.executable, "-c", IMPORT_BLOCKED, *PURE_MODULES], capture_output=True, text=True, env=subprocess_env(), timeout=120
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
    code = "import sys, lit_cbs.analysis as a; a.fit_mccandlish; assert 'matplotlib' not in sys.modules; a.plot_es; assert 'matplotlib' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env(), timeout=120)
