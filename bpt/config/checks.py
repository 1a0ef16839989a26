"""The checks of a config (each error names the setting and what is allowed) and its
translation into the model family's dataclass (model_config).
"""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from bpt.config.schema import DATASETS, RANGES, family_fields
from bpt.models import FAMILIES
from bpt.models.hf import EXTEND_METHODS
from bpt.models.lm import LMConfig, check_positive_int
from bpt.ops.attention import MERGED
from bpt.parallel.mesh import CONTEXT_PARALLEL, LOAD_BALANCE


def model_config(model: ConfigDict, *, vocab_size: int, seq_len: int, **from_data) -> LMConfig:
    """The config of model.family's model (GPTConfig, FLASHConfig or AgenticConfig) from
    config.model; vocab_size, seq_len and from_data (the dataset's model_fields: AT's
    environment shapes) fill the fields left unset. A setting of another family (not None)
    is an error that names it: nothing set is dropped."""
    fields = model.to_dict()
    family = fields.pop("family", "gpt")
    own = family_fields(family)
    for name, value in fields.items():
        if name not in own and value is not None:
            owners = " and ".join(f"'{other}'" for other in FAMILIES if name in family_fields(other))
            raise ValueError(
                f"model.{name}={value!r} is a setting of model.family={owners or 'none'}, which a "
                f"model.family='{family}' model does not read; leave it unset (None). "
                f"bpt.config.set_family(config, '{family}') switches a config's family and unsets the others' settings"
            )
    fields = {name: value for name, value in fields.items() if name in own}
    if fields.get("remat_layer") == "auto":
        # Chosen by memory where a training step is compiled (bpt.train.probe.resolve_remat,
        # which bpt-train runs first); evaluation and sampling do not rematerialize.
        fields["remat_layer"] = "nothing_saveable"
    fields["vocab_size"] = fields["vocab_size"] or vocab_size
    fields["max_seq_len"] = fields["max_seq_len"] or seq_len
    for name, value in from_data.items():
        if name in own and fields.get(name) is None:
            fields[name] = value
    # None left in a field whose default is not None (AT's shapes without data): the default.
    fields = {name: value for name, value in fields.items() if value is not None or own[name].default is None}
    if fields["vocab_size"] < vocab_size:
        raise ValueError(
            f"model.vocab_size={fields['vocab_size']} is smaller than the tokenizer's vocabulary "
            f"({vocab_size} tokens)"
        )
    return FAMILIES[family](**fields)


STATE_DTYPES = ("float32", "bfloat16")  # train.optimizer_state_dtype: AdamW's moments


def check_state_dtype(train: ConfigDict) -> None:
    if train.optimizer_state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"unknown train.optimizer_state_dtype {train.optimizer_state_dtype!r}; "
            f"allowed: {', '.join(STATE_DTYPES)}"
        )


def check_mesh(c: ConfigDict, sizes: dict[str, int]) -> None:
    """Raises ValueError naming the first mesh setting that cannot work with this config on a
    mesh of these sizes (bpt.parallel.make_mesh resolves -1 and checks the device count)."""
    m = c.mesh
    if m.context_parallel not in CONTEXT_PARALLEL:
        raise ValueError(
            f"unknown mesh.context_parallel {m.context_parallel!r}; allowed: {', '.join(CONTEXT_PARALLEL)}"
        )
    if m.load_balance not in LOAD_BALANCE:
        raise ValueError(f"unknown mesh.load_balance {m.load_balance!r}; allowed: {', '.join(LOAD_BALANCE)}")
    groups = m.get("context_head_groups", 0)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
        raise ValueError(
            f"mesh.context_head_groups must be 0 (automatic) or a positive integer; got {groups!r}"
        )
    batch_shards, seq, tensor = sizes["data"] * sizes["fsdp"], sizes["sequence"], sizes["tensor"]
    micro = c.train.batch_size // c.train.grad_accum_steps
    if micro % batch_shards:
        raise ValueError(
            f"train.batch_size / train.grad_accum_steps = {micro} sequences a micro-batch do not split over "
            f"mesh.data x mesh.fsdp = {batch_shards} devices; make it a multiple"
        )
    flash = c.model.family == "flash"
    (_check_flash_mesh if flash else _check_gpt_mesh)(c, seq, tensor, groups)
    if seq > 1:
        layout = "none" if flash else m.load_balance  # FLASH's shards are contiguous (FLASH.sequence_layout)
        pieces = 2 * seq if layout == "zigzag" else seq
        if c.data.seq_len % pieces:
            raise ValueError(
                f"data.seq_len={c.data.seq_len} does not split into the {pieces} pieces of "
                f"mesh.load_balance={layout!r} over mesh.sequence={seq}"
            )
        piece = c.data.seq_len // pieces
        for name in _chunk_settings(c):
            chunk = min(c.model[name], piece)
            if piece % chunk:
                raise ValueError(
                    f"model.{name}={c.model[name]} does not divide the {piece} tokens a device holds per "
                    f"{layout} piece (data.seq_len / mesh.sequence{' / 2' if pieces > seq else ''})"
                )


def _check_flash_mesh(c: ConfigDict, seq: int, tensor: int, groups: int) -> None:
    """FLASH's settings on a mesh of seq sequence and tensor shards."""
    if seq > 1:
        if c.model.attention != "mixed_chunk":
            raise ValueError(
                f"model.attention={c.model.attention!r} (FLASH-Quad) attends over the whole sequence and "
                "does not run with mesh.sequence > 1; use model.attention='mixed_chunk'"
            )
        if c.data.seq_len % (seq * c.model.chunk_size):
            raise ValueError(
                f"FLASH over mesh.sequence={seq} needs data.seq_len={c.data.seq_len} to be a multiple of "
                f"mesh.sequence x model.chunk_size = {seq * c.model.chunk_size}, so that no chunk straddles "
                "two devices"
            )
    if tensor > 1:
        hidden = int(c.model.expansion * c.model.d_model)
        if hidden % tensor:
            raise ValueError(f"mesh.tensor={tensor} must divide FLASH's expansion x d_model = {hidden}")


def _check_gpt_mesh(c: ConfigDict, seq: int, tensor: int, groups: int) -> None:
    """The GPT's (and AT's) settings on a mesh of seq sequence and tensor shards."""
    if seq > 1:
        if c.model.attention_impl not in MERGED:
            raise ValueError(
                f"model.attention_impl={c.model.attention_impl!r} cannot run with mesh.sequence > 1: each "
                f"shard's attention returns its logsumexp for the merge; use {', '.join(MERGED.names)}"
            )
        if c.model.attention_mode == "vanilla":
            raise ValueError(
                "model.attention_mode='vanilla' materializes the [seq, seq] scores and cannot run with "
                "mesh.sequence > 1; use memory_efficient or blockwise_parallel"
            )
        kv_heads = (c.model.num_kv_heads or c.model.num_heads) // tensor
        if groups and kv_heads % groups:
            raise ValueError(
                f"mesh.context_head_groups={groups} must divide the {kv_heads} key/value heads each device "
                "holds (model.num_kv_heads / mesh.tensor)"
            )
    if tensor > 1:
        heads, kv = c.model.num_heads, c.model.num_kv_heads or c.model.num_heads
        if heads % tensor or kv % tensor:
            raise ValueError(
                f"mesh.tensor={tensor} must divide model.num_heads={heads} and model.num_kv_heads={kv}"
            )


def check_config(c: ConfigDict) -> None:
    """Raises ValueError naming the first setting that cannot work."""
    if c.init.extend_positions not in EXTEND_METHODS:
        raise ValueError(
            f"unknown init.extend_positions {c.init.extend_positions!r}; allowed: {', '.join(EXTEND_METHODS)}"
        )
    _check_data(c)
    _positive(c.train, "train", "steps", "batch_size", "grad_accum_steps", "log_every", "keep_checkpoints")
    _check_exorl(c)
    # The family's config (GPTConfig, FLASHConfig, AgenticConfig) checks the model's settings.
    model_config(c.model, vocab_size=1, seq_len=c.data.seq_len)
    if c.train.batch_size % c.train.grad_accum_steps:
        raise ValueError(
            f"train.batch_size={c.train.batch_size} is not divisible by "
            f"train.grad_accum_steps={c.train.grad_accum_steps}"
        )
    _check_chunks(c)
    check_state_dtype(c.train)
    _check_ranges(c)


def _positive(section: ConfigDict, prefix: str, *names: str) -> None:
    for name in names:
        check_positive_int(section[name], f"{prefix}.{name}")


def _check_data(c: ConfigDict) -> None:
    if c.data.name not in DATASETS:
        raise ValueError(f"unknown data.name {c.data.name!r}; allowed: {', '.join(DATASETS)}")
    if c.data.name == "text" and not c.data.path:
        raise ValueError("data.name='text' needs data.path: a .txt file or a folder of them")
    if c.data.name == "prepared" and not c.data.path:
        raise ValueError("data.name='prepared' needs data.path: a folder written by bpt-prepare-data")
    if c.data.val_fraction is not None and not 0.0 < c.data.val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1); got {c.data.val_fraction}")
    _positive(c.data, "data", "seq_len", "copy_symbols")
    if c.data.name == "copy" and c.data.seq_len % 2:
        raise ValueError(f"data.name='copy' needs an even data.seq_len; got {c.data.seq_len}")


def _chunk_settings(c: ConfigDict) -> tuple[str, ...]:
    """The chunk sizes the family reads (ffn_chunk_size where it is set)."""
    if c.model.family == "flash":
        return ("loss_chunk_size",)
    own = ("ffn_chunk_size",) if c.model.get("ffn_chunk_size") else ()
    return ("q_chunk_size", "kv_chunk_size", "loss_chunk_size", *own)


def _check_chunks(c: ConfigDict) -> None:
    """Every chunk size the family reads divides the sequence (or covers it)."""
    for name in _chunk_settings(c):
        chunk = min(c.model[name], c.data.seq_len)
        if c.data.seq_len % chunk:
            raise ValueError(
                f"data.seq_len={c.data.seq_len} is not divisible by model.{name}={c.model[name]}; "
                "choose a chunk size that divides the sequence length"
            )


def _check_ranges(c: ConfigDict) -> None:
    """RANGES: each numeric setting finite and within its bounds."""
    for key, low, high in RANGES:
        section, name = key.split(".")
        value = c[section][name]
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number; got {value!r}")
        low_ok = low is None or (value >= low[0] if low[1] else value > low[0])
        high_ok = high is None or (value <= high[0] if high[1] else value < high[0])
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low_ok and high_ok):
            where = " and ".join(
                part
                for part in (
                    low and f"{'>=' if low[1] else '>'} {low[0]}",
                    high and f"{'<=' if high[1] else '<'} {high[0]}",
                )
                if part
            )
            raise ValueError(f"{key} must be {where}; got {value!r}")


def _check_exorl(c: ConfigDict) -> None:
    """The ExoRL data goes with the Agentic Transformer, and its settings are in range."""
    if (c.data.name == "exorl") != (c.model.family == "agentic"):
        raise ValueError(
            f"data.name='exorl' goes with model.family='agentic' (the Agentic Transformer) and only with it; "
            f"got data.name={c.data.name!r} and model.family={c.model.family!r}"
        )
    if c.data.name == "exorl":
        _positive(c.data, "data", "trajectories", "episode_length")
        if not 0.0 < c.data.best_fraction <= 1.0:
            raise ValueError(f"data.best_fraction must be in (0, 1]; got {c.data.best_fraction}")
        if c.train.eval_by_position:
            raise ValueError(
                "train.eval_by_position measures a language model's loss; set it to 0 for data.name='exorl'"
            )
