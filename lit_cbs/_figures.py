"""``save_figure``: the one way lit_cbs writes a matplotlib figure (pyplot's backend left alone)."""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def save_figure(figure: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``figure`` as a PNG at ``path`` (its folder created) through the Agg canvas."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path
