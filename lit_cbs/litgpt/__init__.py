"""lit_cbs for LitGPT (``pip install ".[litgpt]"``): ``litgpt pretrain`` at a lit_cbs batch schedule, and its CBS.

``python -m lit_cbs.litgpt pretrain <litgpt's arguments> --lit_cbs CONFIG.yaml`` runs LitGPT's own loop through
``LitGPTRun``; ``probe_checkpoint`` reads the CBS at one of its checkpoints; ``LitGPTModule`` is LitGPT's ``GPT``
in a Lightning Trainer, beside lit_cbs's callbacks. docs/guides/litgpt.md says which to choose when.
"""

from lit_cbs.litgpt.loop import LitGPTRun
from lit_cbs.litgpt.parts import LitGPTModule, checkpoint_parts, probe_checkpoint

__all__ = ["LitGPTModule", "LitGPTRun", "checkpoint_parts", "probe_checkpoint"]
