"""Where lit_cbs/__init__.py finds ``BatchChange`` until it points at lit_cbs.rules.warmup_core."""

from lit_cbs.rules.warmup_core import BatchChange

__all__ = ["BatchChange"]
