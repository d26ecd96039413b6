"""One markdown file, several benchmarks: each writes only its own marked section.

A benchmark named ``name`` owns the text between ``<!-- {name}:start -->`` and
``<!-- {name}:end -->`` of the file (docs/RESULTS.md); everything else in it is left as it is, so
benchmarks run at different times do not overwrite each other's results.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def section_markers(name: str) -> tuple[str, str]:
    """The start and end marker lines of section ``name``."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"section name {name!r} must be letters, digits, '_', '.' or '-' (it goes into an HTML comment)")
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(path: str | os.PathLike, name: str, text: str) -> None:
    """Put ``text`` between the markers of section ``name`` in the markdown file ``path``.

    A missing (or empty) file is created with a ``# Results`` heading and the section; a file
    without the section gets it appended; otherwise only the text between its markers changes.
    """
    path = Path(path)
    start, end = section_markers(name)
    if start in text or end in text:
        raise ValueError(f"the text for section {name!r} contains its own marker {start} or {end}")
    block = f"{start}\n{text.strip(chr(10))}\n{end}"
    old = path.read_text() if path.exists() else ""
    starts, ends = old.count(start), old.count(end)
    if starts == ends == 0:
        head = old.rstrip("\n") or "# Results"
        new = f"{head}\n\n{block}\n"
    elif starts == ends == 1 and old.index(start) < old.index(end):
        new = old[: old.index(start)] + block + old[old.index(end) + len(end) :]
    else:
        raise ValueError(
            f"{path} has {starts} '{start}' and {ends} '{end}'; section {name!r} needs one of each, start first: "
            "fix the markers by hand"
        )
    # Write beside it and rename, so a reader never sees half a file.
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(new)
    os.replace(partial, path)
