"""The examples in lit_cbs's docstrings run and print what they say, and every user-facing name (what a package
exports in its ``_EXPORTS`` table) has a docstring with an ``Example:`` section a reader can paste and check."""

from __future__ import annotations

import contextlib
import doctest
import importlib
import importlib.util
import inspect
import io
import re

import pytest
from test_import_layers import lazy_exports, module_files

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# A section header in a Google-style docstring: "Example:" or "Examples:" alone on its line.
EXAMPLE_SECTION = re.compile(r"^\s*Examples?:\s*$", re.MULTILINE)


def doctest_modules() -> list:
    """Every module of lit_cbs but the ``__main__`` ones (running them is running a program); ``lit_cbs.models.hf``
    is skipped without the [hf] extra, whose examples build transformers models."""
    params = []
    for name in module_files():
        if name.rsplit(".", 1)[-1] == "__main__":
            continue
        marks = []
        if name == "lit_cbs.models.hf" and not HAS_TRANSFORMERS:
            marks.append(pytest.mark.skip(reason='transformers is not installed: pip install -e ".[hf]"'))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.parametrize("name", doctest_modules())
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):  # the runner writes each failing example, its expected and its output
        result = doctest.testmod(module, optionflags=OPTIONS, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed:\n{report.getvalue()}"


def exported_names() -> dict[str, str]:
    """``package.name`` -> the module that defines it, for every package ``__init__`` with an ``_EXPORTS`` table."""
    names = {}
    for package, path in module_files().items():
        if path.name == "__init__.py":
            for name, module in lazy_exports(path).items():
                names[f"{package}.{name}"] = module
    return names


def public_names() -> dict[str, str]:
    """The user-facing API: what a package exports: ``package.name`` -> the module that defines it."""
    return exported_names()


def lacking_examples() -> list[str]:
    """The public classes and functions whose docstring has no ``Example:`` section. A constant (a preset table)
    cannot carry a docstring of its own: its module's docstring describes it."""
    lacking = []
    for qualified, module in sorted(public_names().items()):
        name = qualified.rsplit(".", 1)[-1]
        if module == "lit_cbs.models.hf" and not HAS_TRANSFORMERS:
            continue
        obj = getattr(importlib.import_module(module), name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if not EXAMPLE_SECTION.search(inspect.getdoc(obj) or ""):
            lacking.append(qualified)
    return lacking


def test_every_public_class_and_function_has_an_example():
    lacking = lacking_examples()
    assert not lacking, f"{len(lacking)} public names have no Example: section in their docstring:\n" + "\n".join(
        lacking
    )
