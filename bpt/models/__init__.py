"""Model families: GPT (bpt.models.gpt), FLASH (bpt.models.flash) and the Agentic
Transformer (bpt.models.agentic), chosen by model.family.

All share one call contract (bpt.models.lm.CausalLM): inputs (tokens; AT: a chain of
trajectories) -> outputs (logits; AT: actions), or the loss record (CrossEntropy; AT: the
actions' squared error in its loss field) given targets and a loss_mask; decode=True with a
cache.
"""

from __future__ import annotations

from bpt.models.agentic import AgenticConfig, AgenticTransformer
from bpt.models.flash import FLASH, FLASHConfig
from bpt.models.gpt import GPT, GPTConfig
from bpt.parallel.mesh import Parallelism

FAMILIES = {"gpt": GPTConfig, "flash": FLASHConfig, "agentic": AgenticConfig}
MODELS = {GPTConfig: GPT, FLASHConfig: FLASH, AgenticConfig: AgenticTransformer}


def make_model(config: GPTConfig | FLASHConfig, parallel: Parallelism | None = None) -> GPT | FLASH:
    """The module of the family whose config this is."""
    return MODELS[type(config)](config, parallel=parallel)


__all__ = [
    "FAMILIES", "FLASH", "FLASHConfig", "GPT", "GPTConfig", "AgenticConfig", "AgenticTransformer", "make_model",
]  # fmt: skip
