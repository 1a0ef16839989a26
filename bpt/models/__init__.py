"""Model families: GPT (bpt.models.gpt) and FLASH (bpt.models.flash), chosen by model.family.

Both are causal LMs with one call contract (bpt.models.lm.CausalLM): tokens -> logits, or
the CrossEntropy given targets; decode=True with a cache.
"""

from __future__ import annotations

from bpt.models.flash import FLASH, FLASHConfig
from bpt.models.gpt import GPT, GPTConfig
from bpt.parallel.mesh import Parallelism

FAMILIES = {"gpt": GPTConfig, "flash": FLASHConfig}
MODELS = {GPTConfig: GPT, FLASHConfig: FLASH}


def make_model(config: GPTConfig | FLASHConfig, parallel: Parallelism | None = None) -> GPT | FLASH:
    """The module of the family whose config this is."""
    return MODELS[type(config)](config, parallel=parallel)


__all__ = ["FAMILIES", "FLASH", "FLASHConfig", "GPT", "GPTConfig", "make_model"]
