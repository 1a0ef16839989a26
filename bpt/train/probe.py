"""The full training step of a config (forward, backward, AdamW update) compiled from shapes,
before anything is allocated: the memory it needs (StepMemory), the device's budget, and
model.remat_layer=auto's choice, the fastest policy whose step fits (resolve_remat).

bpt-train uses these for its remat choice and its fit check. The benchmark protocol over them
(real steps timed, the search for the longest context that fits) is scripts/benchlib.py.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from bpt.config import check_config, model_config
from bpt.data.tokenizers import GPT2_VOCAB
from bpt.models import make_model
from bpt.models.lm import stack_unrolled
from bpt.train.state import jit_initializer, jit_steps, make_parallelism


def memory_budget(memory_gib: float = 0.0) -> int:
    """Bytes a step may use: memory_gib when given, else the device allocator's limit (0
    where the backend reports none, a CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(memory_gib * 2**30) or stats.get("bytes_limit", 0)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes of the compiled step, as XLA's memory analysis reports them."""

    arguments: int  # train state and batch
    outputs: int  # the new train state and the metrics
    aliased: int  # outputs written over donated arguments (the state)
    temp: int  # everything the step allocates while it runs: activations, gradients
    code: int

    @property
    def peak(self) -> int:
        """What the device must hold at once to run the step."""
        return self.arguments + self.outputs - self.aliased + self.temp + self.code

    @classmethod
    def of(cls, compiled) -> StepMemory:
        m = compiled.memory_analysis()
        return cls(
            arguments=m.argument_size_in_bytes,
            outputs=m.output_size_in_bytes,
            aliased=m.alias_size_in_bytes,
            temp=m.temp_size_in_bytes,
            code=m.generated_code_size_in_bytes,
        )


def is_out_of_memory(error: BaseException | str) -> bool:
    """Whether an error (or a log's text) is XLA's running out of device memory."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


# model.remat_layer=auto tries these, the fastest first, and takes the first whose step fits.
AUTO_REMAT = ("attention_and_dots_saveable", "attention_saveable", "nothing_saveable")
# Where the layers' LayerNorms run as bpt's kernels (runs_norm_kernels) and the layer stack
# runs unrolled, auto tries this one first: it keeps what they computed too, so the backward
# runs no norm forward again (GPT-1B on an H200, unrolled, paired: +1.3% at 8K, +0.75% at
# 32K, for 6 GiB more a 32K-token step; docs/notes/step_speed.md). In a loop over layers it
# has not been measured (what the backward keeps goes through the loop's per-layer stacks),
# and elsewhere it is attention_and_dots_saveable's step: auto does not compile it there.
AUTO_NORMS = "attention_dots_and_norms_saveable"
_SAY = functools.partial(print, flush=True)  # resolve_remat's progress lines, printed at once


def auto_policies(model: ConfigDict, *, norm_kernels: bool = False) -> tuple[str, ...]:
    """The policies auto tries for this model, the fastest first: AUTO_REMAT, after "none" (no
    layer remat) and AUTO_NORMS (where norm_kernels: runs_norm_kernels) where the layer stack
    runs unrolled (model.scan_unroll >= num_layers, or scan_layers off); for a loop that
    auto_unroll may unroll, resolve_remat tries AUTO_NORMS on the unrolled stack. In a loop
    over layers, what the backward keeps goes through the loop's per-layer stacks, and
    keeping everything was slower than nothing_saveable (FLASH-125M at 8K on an H100: 251,796 tokens/s in 68.1 GiB against 306,794 in 6.7);
    unrolled it was the fastest (380,789 in 37.2 GiB; the GPT 271,791 in 15.0 GiB against
    257K keeping attention and the matmuls: docs/notes/flash.md)."""
    unrolled = stack_unrolled(model) and _one_loop(model)
    return (("none",) if unrolled else ()) + ((AUTO_NORMS,) if unrolled and norm_kernels else ()) + AUTO_REMAT


def runs_norm_kernels(config: ConfigDict, devices=None, *, vocab_size: int = GPT2_VOCAB) -> bool:
    """Whether the layers' LayerNorms run as bpt's kernels in the model config describes on
    the mesh config.mesh makes of `devices` (the model's own runs_norm_kernels: a GPT with
    LayerNorm whose model.norm_impl is "pallas", or "auto" on one GPU)."""
    parallel = make_parallelism(config, devices)
    return make_model(step_model_config(config, vocab_size=vocab_size), parallel).runs_norm_kernels()


# How auto's choice line ("model.remat_layer=auto: POLICY (NOTE; step memory: ...)") says that
# the chosen step differs from the plain policy; scripts/check_gpus.py reads them back.
CHOICE_NOTES = {
    "unrolled": "the layer stack unrolled",
    "offloaded": "the saved layer inputs offloaded to the host",
    "split": "the first layers under",  # ... "{policy}: {n} of {num_layers}"
}
# Where model.auto_offload asks, auto tries this policy a second time, with the saved layer
# inputs offloaded to the host (model.offload_layer_inputs), before the policy after it.
AUTO_OFFLOAD = "attention_saveable"


def auto_candidates(model: ConfigDict, *, norm_kernels: bool = False) -> tuple[tuple[str, bool], ...]:
    """(policy, offload_layer_inputs) for each step auto compiles, in order: auto_policies'
    with the model's own offload_layer_inputs, and where may_offload(model) AUTO_OFFLOAD once
    more with the inputs offloaded, right after it."""
    own = model.get("offload_layer_inputs", False)
    candidates = []
    for policy in auto_policies(model, norm_kernels=norm_kernels):
        candidates.append((policy, own))
        if policy == AUTO_OFFLOAD and may_offload(model):
            candidates.append((policy, True))
    return tuple(candidates)


def may_offload(model: ConfigDict) -> bool:
    """Whether remat auto also tries AUTO_OFFLOAD with the saved layer inputs offloaded: asked
    for (model.auto_offload), not offloaded already, and no nested remat (which offloading
    does not take)."""
    return (
        model.get("auto_offload", False)
        and not model.get("offload_layer_inputs", False)
        and model.get("remat_group", 1) == 1
    )


def _one_loop(model: ConfigDict) -> bool:
    """Whether the layer stack runs as one loop that unrolling covers: no nested remat (its
    own loops) and no offloaded layer inputs."""
    return model.get("remat_group", 1) == 1 and not model.get("offload_layer_inputs", False)


def resolve_remat(
    config: ConfigDict,
    *,
    vocab_size: int = GPT2_VOCAB,
    devices=None,
    budget: int | None = None,
    need: Callable[[ConfigDict], int] | None = None,
    say=_SAY,
) -> ConfigDict:
    """config itself, or where model.remat_layer is "auto" a copy with the first candidate of
    auto_candidates(config.model, norm_kernels=runs_norm_kernels(config, devices)) (a policy
    of auto_policies', and where model.auto_offload asks, AUTO_OFFLOAD with the saved layer
    inputs offloaded to the host) whose training step fits the memory budget (default: the
    device's). need(config) is a step's bytes (default: its compiled peak, from shapes:
    nothing is allocated). Where the device reports no limit (a CPU) auto is nothing_saveable; where none fits, the last
    (and bpt-train's preflight says what would make it fit). Where the first policy fits and
    may_unroll(config.model), its step with the layer stack unrolled (scan_unroll =
    num_layers) is compiled too and taken if it fits as well, and before it, where the norm
    kernels run, AUTO_NORMS' unrolled step. Where a later candidate fits and
    may_split(config.model), the step between it and the one before, that one's policy in
    the first layers (_split), is compiled too and taken if it fits; and where
    may_unroll(config.model), the chosen step unrolled, then the later policy's alone
    (_unroll).
    Each candidate is compiled once, and the chosen one is the step that runs (choose_remat:
    TrainingStep and bpt-train keep it; the others are extra compilations, once per run). Each
    candidate is announced before it compiles (minutes at long contexts), then one line says
    the choice."""
    if config.model.remat_layer != "auto":
        return config
    if config.model.get("family", "gpt") == "agentic":
        raise ValueError(
            "model.remat_layer=auto compiles a language model's step on random tokens; for "
            f"model.family='agentic' name a policy: {', '.join(AUTO_REMAT)}"
        )
    if config.model.get("remat_first_layers", 0):
        raise ValueError(
            f"model.remat_first_layers={config.model.remat_first_layers} needs a named "
            "model.remat_layer; with remat_layer=auto set model.auto_split=True to let auto split the stack"
        )
    budget = memory_budget() if budget is None else budget
    chosen = copy.deepcopy(config)
    if not budget:
        chosen.model.remat_layer = AUTO_REMAT[-1]
        say(f"model.remat_layer=auto: {AUTO_REMAT[-1]} (the device reports no memory limit)")
        return chosen
    if need is None:
        need = lambda c: TrainingStep(c, vocab_size=vocab_size, devices=devices).memory().peak  # noqa: E731
    needs, started, fits, measured = [], time.perf_counter(), False, []
    own_offload = config.model.get("offload_layer_inputs", False)
    norm_kernels = runs_norm_kernels(config, devices, vocab_size=vocab_size)
    candidates = auto_candidates(config.model, norm_kernels=norm_kernels)
    for policy, offload in candidates:
        added = offload != own_offload  # auto_offload's candidate
        chosen.model.remat_layer = policy
        if added or "offload_layer_inputs" in chosen.model:
            chosen.model.offload_layer_inputs = offload
        what = f"and {CHOICE_NOTES['offloaded']} (model.auto_offload)" if added else "to measure its memory"
        say(f"remat auto: compiling the step with {policy} {what} ...")
        bytes_ = need(chosen)
        needs.append(f"{policy}{' offloaded' if added else ''} {bytes_ / 2**30:.1f} GiB")
        measured.append((policy, offload, bytes_))
        if fits := bytes_ <= budget:
            break
    how = f"{CHOICE_NOTES['offloaded']}; " if fits and added else ""
    per_layer = _per_layer(measured[-2:], config.model.num_layers) if len(measured) > 1 else 0.0
    if fits and per_layer > 0 and may_split(config.model):
        more, within = measured[-2][0], measured[-1][2]
        chosen, how = _split(chosen, how, more, within, per_layer, budget, need, needs, say)
    if fits and may_unroll(config.model):
        first = candidates[0][0]
        chosen, how = _unroll(chosen, how, first, norm_kernels, per_layer, budget, need, needs, say)
    say(f"model.remat_layer=auto: {chosen.model.remat_layer} ({how}step memory: {', '.join(needs)}; "
        f"the device has {budget / 2**30:.1f} GiB; chosen in {time.perf_counter() - started:.0f} s)")  # fmt: skip
    return chosen


def _per_layer(pair, layers: int) -> float:
    """The bytes a layer adds under the first of auto's last two candidates measured, pair's
    (policy, offloaded, bytes), against the second (0 where they differ in more than policy)."""
    (more, offload, over), (policy, chosen_offload, within) = pair
    return 0.0 if offload != chosen_offload or more == policy else max(0.0, (over - within) / layers)


def _split(chosen: ConfigDict, how: str, more: str, within: int, per_layer: float, budget: int, need, needs: list, say):
    """resolve_remat's split (model.auto_split): `more` is the policy measured before the
    chosen one and over the budget, within the chosen step's bytes, per_layer the bytes a
    layer adds under `more` (_per_layer, > 0). The step with `more` in the first n layers
    (model.remat_first_layers) is compiled, n the layers the budget leaves room for, and
    taken where it fits (_fit_split). Returns (the config, the choice note)."""
    n = min(chosen.model.num_layers - 1, int((budget - within) // per_layer))
    trial = _fit_split(chosen, more, n, per_layer, budget, need, needs, say)
    return (trial, f"{how}{_split_note(trial)}; ") if trial else (chosen, how)


def _fit_split(base: ConfigDict, more: str, n: int, per_layer: float, budget: int, need, needs: list, say):
    """base with `more` in its first n layers where that step fits the budget; where it does
    not, n shrinks by what it was over at per_layer bytes a layer (at most three
    compilations). None where none fits."""
    layers, unrolled = base.model.num_layers, stack_unrolled(base.model)
    how = " and the layer stack unrolled" if unrolled else ""
    for _ in range(3):
        if n < 1:
            break
        trial = copy.deepcopy(base)
        trial.model.remat_first, trial.model.remat_first_layers = more, n
        say(f"remat auto: compiling the step with {more} in its first {n} of {layers} layers{how} (model.auto_split) ...")
        bytes_ = need(trial)
        needs.append(f"{more} in {n} layers{' unrolled' if unrolled else ''} {bytes_ / 2**30:.1f} GiB")
        if bytes_ <= budget:
            return trial
        n = min(n - 1, n - math.ceil((bytes_ - budget) / per_layer))
    return None


def _split_note(config: ConfigDict) -> str:
    m = config.model
    return f"{CHOICE_NOTES['split']} {m.remat_first}: {m.remat_first_layers} of {m.num_layers}"


def _unroll(chosen, how, first, norm_kernels, per_layer, budget, need, needs, say) -> tuple[ConfigDict, str]:
    """resolve_remat's unrolled steps (model.auto_unroll), the fastest first; the first that
    fits is taken, else the loop stays. Where auto's first policy fitted: AUTO_NORMS' step
    (where the norm kernels run), then that policy's. Where a later one fitted: the split
    chosen (model.auto_split), unrolled, its first layers shrunk where it is over
    (_fit_split), then the later policy's step alone. GPT-1B at 64K on an H100 with the copy
    task's 17 tokens (a loop under attention_saveable 47.7% MFU, split 47.9%): unrolled 49.0%,
    split and unrolled 50.6%; with GPT-2's vocabulary, split and unrolled 50.1%."""
    m = chosen.model
    if not _one_loop(m):  # auto_offload's candidate was taken
        return chosen, how
    unrolled = copy.deepcopy(chosen)
    unrolled.model.scan_unroll = m.num_layers
    if split := m.get("remat_first_layers", 0):  # _split took it: per_layer > 0
        unrolled.model.remat_first_layers = 0
        if trial := _fit_split(unrolled, m.remat_first, split, per_layer, budget, need, needs, say):
            return trial, f"{CHOICE_NOTES['unrolled']}; {_split_note(trial)}; "
    norms = (AUTO_NORMS,) if norm_kernels and m.remat_layer == first else ()
    for policy in norms + (m.remat_layer,):
        trial = copy.deepcopy(unrolled)
        trial.model.remat_layer = policy
        say(f"remat auto: compiling the step with {policy} and the layer stack unrolled (model.auto_unroll) ...")
        bytes_ = need(trial)
        needs.append(f"{policy + ' ' if policy != m.remat_layer else ''}unrolled {bytes_ / 2**30:.1f} GiB")
        if bytes_ <= budget:
            return trial, f"{CHOICE_NOTES['unrolled']}; "
    return chosen, how


def may_split(model: ConfigDict) -> bool:
    """Whether remat auto also tries a step between its last two candidates, the first
    layers under the one that did not fit (model.remat_first_layers): asked for
    (model.auto_split), and no nested remat (which the split does not take)."""
    return model.get("auto_split", False) and model.get("remat_group", 1) == 1


def choose_remat(
    config: ConfigDict, *, vocab_size: int = GPT2_VOCAB, devices=None
) -> tuple[ConfigDict, TrainingStep | None]:
    """resolve_remat's choice, and the TrainingStep it compiled for the chosen policy (None
    where nothing was compiled: a named policy, or a device without a memory limit). The
    other candidates' executables are dropped."""
    tried = {}
    key = lambda c: (  # noqa: E731
        c.model.remat_layer,
        c.model.scan_unroll,
        c.model.get("offload_layer_inputs", False),
        c.model.get("remat_first", None),
        c.model.get("remat_first_layers", 0),
    )

    def need(c: ConfigDict) -> int:
        tried[key(c)] = step = TrainingStep(c, vocab_size=vocab_size, devices=devices)
        return step.memory().peak

    chosen = resolve_remat(config, vocab_size=vocab_size, devices=devices, need=need)
    return chosen, tried.get(key(chosen))


def may_unroll(model: ConfigDict) -> bool:
    """Whether remat auto also tries this model's step with the layer stack unrolled: asked
    for (model.auto_unroll), and a loop over layers that one iteration could hold (scanned,
    not unrolled already, no nested remat, no offloaded layer inputs)."""
    return model.get("auto_unroll", False) and model.get("scan_layers", True) and not stack_unrolled(model) and _one_loop(model)


def step_model_config(config: ConfigDict, *, vocab_size: int = GPT2_VOCAB):
    """The model config a TrainingStep builds from `config`, at data.seq_len: model.vocab_size,
    or vocab_size where that is unset (random tokens: no tokenizer to fit)."""
    return model_config(
        config.model, vocab_size=config.model.vocab_size or vocab_size, seq_len=config.data.seq_len
    )


class TrainingStep:
    """One config's training step on random tokens, compiled once, measured on demand.

    vocab_size fills config.model.vocab_size when that is unset (default: GPT-2's). The step
    runs on the mesh config.mesh describes over `devices` (default: all). model.remat_layer
    may be "auto" (choose_remat). Its jit-ed functions (init, step, eval_step) and the
    batch's layout (batch_sharding) are what bpt-train runs when remat auto chose this step:
    a state from init and batches laid out by batch_sharding give the step the trace it was
    compiled for, so it is not traced, lowered or compiled again.
    """

    def __init__(self, config: ConfigDict, *, vocab_size: int = GPT2_VOCAB, devices=None):
        check_config(config)
        if config.model.remat_layer == "auto":
            # The chosen policy's step was compiled to measure it: that TrainingStep is this one.
            config, chosen = choose_remat(config, vocab_size=vocab_size, devices=devices)
            if chosen is not None:
                self.__dict__.update(chosen.__dict__)
                return
        self.config = config
        self.parallel = make_parallelism(config, devices)
        self.model = make_model(step_model_config(config, vocab_size=vocab_size), self.parallel)
        self.shape = (config.train.batch_size, config.data.seq_len)
        self.init, shardings = jit_initializer(config, self.model)  # one state tree for all uses
        self.step, self.eval_step, self.batch_sharding = jit_steps(config, self.model, shardings)
        self._batch = jax.jit(self._random_batch, out_shardings=self.batch_sharding)
        self.state_shapes = jax.eval_shape(self.init, jax.random.PRNGKey(0))
        self._compiled = None

    @property
    def num_devices(self) -> int:
        return 1 if self.parallel is None else self.parallel.mesh.size

    @property
    def tokens_per_step(self) -> int:
        return math.prod(self.shape)

    @property
    def num_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.state_shapes.params))

    def batch(self, rng) -> dict:
        return self._batch(rng)

    def _random_batch(self, rng) -> dict:
        tokens = jax.random.randint(rng, self.shape, 0, self.model.config.vocab_size, jnp.int32)
        return {
            "tokens": tokens,
            "targets": jnp.roll(tokens, -1, axis=1),
            "loss_mask": jnp.ones(self.shape, jnp.float32),
        }

    def compiled(self):
        """The executable, compiled from shapes alone: nothing is allocated on the device."""
        if self._compiled is None:
            batch = jax.eval_shape(self._batch, jax.random.PRNGKey(0))  # laid out as the loop's batches
            key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
            self._compiled = self.step.lower(self.state_shapes, batch, key).compile()
        return self._compiled

    def memory(self) -> StepMemory:
        return StepMemory.of(self.compiled())
