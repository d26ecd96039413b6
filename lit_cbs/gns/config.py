"""``GNSConfig``: GradientNoiseScale's settings, checked in one place when built (no Lightning)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lit_cbs.errors import LitCBSConfigError, positive_int
from lit_cbs.gns.groups import compiled_groups

if TYPE_CHECKING:
    import torch

__all__ = ["GNSConfig"]


@dataclasses.dataclass
class GNSConfig:
    """What ``GradientNoiseScale`` measures and how; every field is checked when the config is built.

    A setting it cannot measure with raises ``LitCBSConfigError`` naming the field, before any
    training. ``GradientNoiseScale(**fields)`` builds one, so a Hydra config lists the fields as flat
    keys. What each mode costs and when to pick it: docs/guides/gns_cost.md. Each field's docstring
    below gives its meaning, unit and default.

    Raises:
        LitCBSConfigError: ``ema_decay`` outside [0, 1), a ``per_example_loss`` that is not callable, a
            ``per_example_chunk_size`` that is not a positive int or comes without ``per_example_loss``,
            or ``groups`` neither None, a preset nor a dict of valid regexes.

    Examples:
        >>> GNSConfig(groups="blocks")
        GNSConfig(ema_decay=0.99, groups='blocks', per_example_loss=None, per_example_chunk_size=None)
        >>> GNSConfig(per_example_chunk_size=8)
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: per_example_chunk_size only applies to per-example mode: ...
    """

    ema_decay: float = 0.99
    """Decay of the exponential moving averages of |G|^2 and tr(Sigma) per measured optimizer step,
    in [0, 1) (dimensionless); the averages span about 1 / (1 - ema_decay) steps."""

    groups: str | Mapping[str, str] | None = None
    """Also measure per group of the optimizer's parameters. None: the whole model only.
    ``"param_groups"``: one group per optimizer parameter group, named by its ``"name"`` (else
    ``pg<i>``). ``"blocks"``: ``block0``, ``block1``, ... per transformer block of the model's stack
    of blocks (an ``nn.ModuleList`` of one class: ``OLMo.blocks``, a transformers model's decoder
    layers; see ``layer_stacks``), and one group per other module holding parameters
    (``embedding``, ``lm_head``; see ``block_groups``). A dict ``{group: regex}``: a parameter (by its
    name in ``named_parameters()`` of the LightningModule, e.g. ``model.blocks.0.mlp.up_proj.weight``)
    is in a group when ``re.search(regex, name)`` finds a match (anchor with ``^``/``$`` for whole
    names); a group that matches no trained parameter, or a parameter matched by two groups, stops
    the fit before training; parameters matched by none count in the whole-model metrics only."""

    per_example_loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    """Turns on per-example mode (B_small = 1 sample): ``per_example_loss(module, batch)`` must return
    the training loss of ``batch`` (a scalar) without logging or side effects. It is called through
    ``torch.func.vmap`` with every tensor of the micro-batch cut to one sample (leading dimension 1),
    with the parameters swapped by ``torch.func.functional_call``. None: the small batch is one
    micro-batch on one rank."""

    per_example_chunk_size: int | None = None
    """Samples per ``vmap`` chunk in per-example mode (None: the whole micro-batch at once); lowers
    per-example mode's memory to this many per-example gradients at once."""

    def __post_init__(self) -> None:
        ema_decay = self.ema_decay
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0.0 <= ema_decay < 1.0:
            raise LitCBSConfigError(f"ema_decay={ema_decay!r} must be a float in [0, 1) (decay per optimizer step)")
        if self.per_example_loss is not None and not callable(self.per_example_loss):
            raise LitCBSConfigError(
                f"per_example_loss must be a callable (module, batch) -> loss, got {self.per_example_loss!r}"
            )
        positive_int("per_example_chunk_size", self.per_example_chunk_size, "samples", optional=True)
        if self.per_example_chunk_size is not None and self.per_example_loss is None:
            raise LitCBSConfigError(
                "per_example_chunk_size only applies to per-example mode: also pass per_example_loss"
            )
        compiled_groups(self.groups)
        self.ema_decay = float(ema_decay)

    @property
    def per_example(self) -> bool:
        """Per-example mode: the small batch is one sample."""
        return self.per_example_loss is not None
