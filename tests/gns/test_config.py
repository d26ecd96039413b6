"""GNSConfig: every setting checked when built, one line naming the field."""

from __future__ import annotations

import pytest
from gns.regression import (
    squared_error,
)

from lit_cbs.gns import GradientNoiseScale


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"ema_decay": 1.0}, ValueError, r"ema_decay=1.0 must be a float in \[0, 1\)"),
        ({"ema_decay": -0.1}, ValueError, "ema_decay"),
        ({"per_example_loss": "mse"}, TypeError, "per_example_loss must be a callable"),
        ({"per_example_chunk_size": 4}, ValueError, "also pass per_example_loss"),
        ({"per_example_loss": squared_error, "per_example_chunk_size": 0}, ValueError, "positive int"),
        ({"groups": "layers"}, ValueError, r"groups='layers' is not supported; use None, one of \('param_groups', 'blocks'\)"),
        ({"groups": {}}, ValueError, "a non-empty dict of group name -> regex"),
        ({"groups": {"attention": "("}}, ValueError, r"groups\['attention'\]='\(' is not a valid regex"),
        ({"groups": {"attention": 3}}, TypeError, "must be a regex string over parameter names"),
        ({"groups": {"": "weight"}}, ValueError, "group names must be non-empty strings"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientNoiseScale(**kwargs)
