"""One version everywhere a user reads it: pyproject.toml, lit_cbs.__version__ and CHANGELOG.md's latest release,
under an [Unreleased] section for what comes next."""

from __future__ import annotations

import re
from pathlib import Path

import lit_cbs

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_the_changelog_and_pyproject_name_one_version():
    (project,) = re.findall(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    unreleased, latest, *_ = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert unreleased == "Unreleased" and latest == project == lit_cbs.__version__
