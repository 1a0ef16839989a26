"""Hugging Face checkpoints: GPT-2 (import into bpt's GPT, and export back) and Llama-style
models (import).

A Hugging Face GPT-2 folder holds config.json (n_embd, n_layer, n_head, n_positions, n_inner,
vocab_size, layer_norm_epsilon, activation_function) and the weights in model.safetensors
(or shards listed by model.safetensors.index.json). They are read with the safetensors
package into NumPy, without torch. bpt's GPT with learned positions, biases, tanh-GELU and
tied embeddings is GPT-2's architecture, so the import is exact:

    GPT-2 (Conv1D weights are [in, out])          bpt
    wte.weight [V, D]                             embedding
    wpe.weight [P, D]                             position_embedding
    h.i.ln_1.{weight,bias}                        layers.ln1_{scale,bias}[i]
    h.i.attn.c_attn.{weight [D, 3D], bias [3D]}   layers.w{q,k,v} [D, H, hd], b{q,k,v} [H, hd]
    h.i.attn.c_proj.{weight [D, D], bias}         layers.wo [H, hd, D], bo
    h.i.ln_2.{weight,bias}                        layers.ln2_{scale,bias}[i]
    h.i.mlp.c_fc.{weight [D, F], bias}            layers.w1, b1
    h.i.mlp.c_proj.{weight [F, D], bias}          layers.w2, b2
    ln_f.{weight,bias}                            ln_f_{scale,bias}

Keys may carry a "transformer." prefix (GPT2LMHeadModel) or not (GPT2Model); the attention
mask buffers (attn.bias, attn.masked_bias) of older files are skipped.

A Llama folder (model_type "llama": RMSNorm, SwiGLU, rotary positions, grouped-query
attention, no biases unless attention_bias/mlp_bias) maps onto the same GPT with
rms_norm=True, mlp_activation="swiglu", use_bias=False and mlp_hidden=intermediate_size.
Its torch Linear weights are [out, in]; transformers' Llama rotates the two halves of each
head (rotate_half), as bpt's apply_rotary does, so no permutation is needed:

    Llama ("model." prefix or not)                bpt
    embed_tokens.weight [V, D]                    embedding
    layers.i.input_layernorm.weight               layers.ln1_scale[i]
    layers.i.self_attn.{q,k,v}_proj.weight        layers.w{q,k,v} [D, H or KV, hd] (transposed)
    layers.i.self_attn.o_proj.weight [D, H hd]    layers.wo [H, hd, D]
    layers.i.post_attention_layernorm.weight      layers.ln2_scale[i]
    layers.i.mlp.{gate,up,down}_proj.weight       layers.w1, w3, w2 (transposed)
    norm.weight                                   ln_f_scale
    lm_head.weight [V, D]                         lm_head [D, V] (unless tie_word_embeddings)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bpt.models.gpt import GPTConfig
from bpt.models.lm import fit_vocab

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # the tanh approximation bpt's MLP uses
SKIPPED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # buffers, not weights
MODEL_TYPES = ("gpt2", "llama")
# The GPTConfig fields a checkpoint fixes (a run imported from it keeps them).
SHAPE_FIELDS = (
    "vocab_size",
    "num_layers",
    "d_model",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_ratio",
    "mlp_hidden",
    "mlp_activation",
    "use_bias",
    "rms_norm",
    "max_seq_len",
    "position_embedding",
    "rope_theta",
    "tie_embeddings",
    "layer_norm_epsilon",
)


class HFFormatError(ValueError):
    """A folder that is not a GPT-2 checkpoint bpt can read, with what is wrong."""


def read_hf_config(path: str | Path) -> dict:
    path = Path(path)
    file = path / CONFIG_FILE
    if not file.is_file():
        raise HFFormatError(f"{path} has no {CONFIG_FILE}: not a Hugging Face model folder")
    config = json.loads(file.read_text())
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFFormatError(
            f"{file} has model_type={model_type!r}; bpt imports GPT-2 and Llama checkpoints "
            f"(model_type {' or '.join(repr(t) for t in MODEL_TYPES)})"
        )
    if model_type == "llama":
        return _check_llama_config(config, file)
    activation = config.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise HFFormatError(
            f"{file} has activation_function={activation!r}; bpt's MLP is the tanh GELU ({', '.join(ACTIVATIONS)})"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if config.get(flag):
            raise HFFormatError(f"{file} sets {flag}=true, which bpt's GPT does not implement")
    if config.get("scale_attn_weights", True) is False:
        raise HFFormatError(f"{file} sets scale_attn_weights=false, which bpt's GPT does not implement")
    return config


def _rope_theta(config: dict, file) -> float:
    """rope_theta of a Llama config.json: top level (transformers v4) or in rope_parameters
    (v5); only unscaled rotary positions are implemented."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise HFFormatError(
            f"{file} scales its rotary positions (rope type {kind!r}); bpt implements unscaled "
            "rotary positions only (rope_type 'default')"
        )
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _check_llama_config(config: dict, file) -> dict:
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise HFFormatError(f"{file} has hidden_act={activation!r}; bpt's SwiGLU FFN uses 'silu'")
    if bool(config.get("attention_bias", False)) != bool(config.get("mlp_bias", False)):
        raise HFFormatError(
            f"{file} sets attention_bias={config.get('attention_bias')} but mlp_bias={config.get('mlp_bias')}; "
            "bpt's model.use_bias puts biases on both or on neither"
        )
    _rope_theta(config, file)
    return config


def llama_config_from_hf(config: dict, **overrides) -> GPTConfig:
    """The GPTConfig of a Llama config.json; overrides set bpt's own fields."""
    heads = config["num_attention_heads"]
    fields = dict(
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        d_model=config["hidden_size"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        mlp_hidden=config["intermediate_size"],
        mlp_activation="swiglu",
        use_bias=bool(config.get("attention_bias", False)),
        rms_norm=True,
        max_seq_len=config.get("max_position_embeddings", 2048),
        position_embedding="rotary",
        rope_theta=_rope_theta(config, CONFIG_FILE),
        tie_embeddings=config.get("tie_word_embeddings", False),
        layer_norm_epsilon=config.get("rms_norm_eps", 1e-6),
    )
    fields.update(overrides)
    return GPTConfig(**fields)


def hf_positions(config: dict) -> int:
    """The context a checkpoint was made for: n_positions (GPT-2), max_position_embeddings."""
    return config["n_positions"] if config["model_type"] == "gpt2" else config.get("max_position_embeddings", 2048)


def load_hf(path: str | Path, **kwargs) -> tuple[GPTConfig, dict]:
    """(GPTConfig, params) of a GPT-2 or Llama folder (load_hf_gpt2 or load_hf_llama, by its
    model_type); a Llama ignores extend (it has no position table)."""
    if read_hf_config(path)["model_type"] == "llama":
        kwargs.pop("extend", None)
        return load_hf_llama(path, **kwargs)
    return load_hf_gpt2(path, **kwargs)


def gpt_config_from_hf(config: dict, **overrides) -> GPTConfig:
    """The GPTConfig of a GPT-2 config.json; overrides set bpt's own fields (attention_mode,
    chunk sizes, dtype, a longer max_seq_len, ...)."""
    d = config["n_embd"]
    inner = config.get("n_inner") or 4 * d
    fields = dict(
        vocab_size=config["vocab_size"],
        num_layers=config["n_layer"],
        d_model=d,
        num_heads=config["n_head"],
        mlp_ratio=inner / d,
        max_seq_len=config["n_positions"],
        position_embedding="learned",
        tie_embeddings=config.get("tie_word_embeddings", True),
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
    )
    fields.update(overrides)
    cfg = GPTConfig(**fields)
    if cfg.mlp_dim != inner:
        raise HFFormatError(
            f"n_inner={inner} is not a whole multiple bpt's mlp_ratio can express for n_embd={d}"
        )
    return cfg


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's model.safetensors, or of the shards its index lists."""
    from safetensors.numpy import load_file

    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        return load_file(path / WEIGHTS_FILE)
    if (path / INDEX_FILE).is_file():
        index = json.loads((path / INDEX_FILE).read_text())
        tensors = {}
        for shard in sorted(set(index["weight_map"].values())):
            if not (path / shard).is_file():
                raise HFFormatError(f"{path / INDEX_FILE} lists {shard}, which is missing")
            tensors.update(load_file(path / shard))
        return tensors
    raise HFFormatError(f"{path} has neither {WEIGHTS_FILE} nor {INDEX_FILE} (bpt reads safetensors only)")


def _strip_prefix(tensors: dict[str, np.ndarray], prefix: str = "transformer.") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tensors.items():
        if key.endswith(SKIPPED_SUFFIXES):
            continue
        out[key.removeprefix(prefix)] = value
    return out


def _taker(path: Path, tensors: dict[str, np.ndarray], prefix: str):
    """take(key, shape): the float32 tensor `key` of the folder, checked against shape."""

    def take(key: str, shape: tuple[int, ...]) -> np.ndarray:
        if key not in tensors:
            raise HFFormatError(f"{path} has no tensor {key!r} (nor '{prefix}{key}')")
        value = tensors[key]
        if tuple(value.shape) != shape:
            raise HFFormatError(
                f"tensor {key!r} of {path} has shape {tuple(value.shape)}; its config.json implies {shape}"
            )
        return np.asarray(value, np.float32)

    return take


def load_hf_gpt2(
    path: str | Path, *, dtype=np.float32, extend: str = "interpolate", **overrides
) -> tuple[GPTConfig, dict]:
    """(GPTConfig, params) of a Hugging Face GPT-2 folder, params in bpt's tree (layers
    stacked for model.scan_layers=True) as NumPy arrays of dtype. overrides set GPTConfig
    fields (gpt_config_from_hf); a max_seq_len beyond the checkpoint's n_positions grows the
    position table by `extend` (extend_positions), a shorter one keeps its first rows."""
    path = Path(path)
    hf = read_hf_config(path)
    if hf["model_type"] != "gpt2":
        raise HFFormatError(f"{path} holds a {hf['model_type']!r} model, not GPT-2: use load_hf or load_hf_llama")
    cfg = gpt_config_from_hf(hf, **overrides)
    tensors = _strip_prefix(read_safetensors(path))
    d, h, hd, f, v = cfg.d_model, cfg.num_heads, cfg.dim_per_head, cfg.mlp_dim, cfg.vocab_size
    take = _taker(path, tensors, "transformer.")

    layers = []
    for i in range(cfg.num_layers):
        t = lambda name, shape: take(f"h.{i}.{name}", shape)  # noqa: E731
        qkv_w, qkv_b = t("attn.c_attn.weight", (d, 3 * d)), t("attn.c_attn.bias", (3 * d,))
        wq, wk, wv = (qkv_w[:, j * d : (j + 1) * d].reshape(d, h, hd) for j in range(3))
        bq, bk, bv = (qkv_b[j * d : (j + 1) * d].reshape(h, hd) for j in range(3))
        layers.append(
            {
                "ln1_scale": t("ln_1.weight", (d,)),
                "ln1_bias": t("ln_1.bias", (d,)),
                "wq": wq,
                "wk": wk,
                "wv": wv,
                "bq": bq,
                "bk": bk,
                "bv": bv,
                "wo": t("attn.c_proj.weight", (d, d)).reshape(h, hd, d),
                "bo": t("attn.c_proj.bias", (d,)),
                "ln2_scale": t("ln_2.weight", (d,)),
                "ln2_bias": t("ln_2.bias", (d,)),
                "w1": t("mlp.c_fc.weight", (d, f)),
                "b1": t("mlp.c_fc.bias", (f,)),
                "w2": t("mlp.c_proj.weight", (f, d)),
                "b2": t("mlp.c_proj.bias", (d,)),
            }
        )
    positions = take("wpe.weight", (hf["n_positions"], d))
    params = {
        "embedding": take("wte.weight", (v, d)),
        "position_embedding": extend_positions(positions, cfg.max_seq_len, extend),
        "ln_f_scale": take("ln_f.weight", (d,)),
        "ln_f_bias": take("ln_f.bias", (d,)),
        **stack_layers(layers, cfg.scan_layers),
    }
    if not cfg.tie_embeddings:
        if "lm_head.weight" not in tensors:
            raise HFFormatError(f"{path} sets tie_word_embeddings=false but has no tensor 'lm_head.weight'")
        params["lm_head"] = take("lm_head.weight", (v, d)).T
    return cfg, _cast(fit_vocab(params, cfg.padded_vocab), dtype)


def load_hf_llama(path: str | Path, *, dtype=np.float32, **overrides) -> tuple[GPTConfig, dict]:
    """(GPTConfig, params) of a Hugging Face Llama folder (LlamaForCausalLM or LlamaModel
    keys), params in bpt's tree as NumPy arrays of dtype; overrides set GPTConfig fields."""
    path = Path(path)
    hf = read_hf_config(path)
    if hf["model_type"] != "llama":
        raise HFFormatError(f"{path} holds a {hf['model_type']!r} model, not Llama: use load_hf or load_hf_gpt2")
    cfg = llama_config_from_hf(hf, **overrides)
    tensors = _strip_prefix(read_safetensors(path), "model.")
    d, h, kv, hd, f, v = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head, cfg.mlp_dim, cfg.vocab_size
    take = _taker(path, tensors, "model.")

    layers = []
    for i in range(cfg.num_layers):
        t = lambda name, shape: take(f"layers.{i}.{name}", shape)  # noqa: E731
        layer = {
            "ln1_scale": t("input_layernorm.weight", (d,)),
            "wq": t("self_attn.q_proj.weight", (h * hd, d)).T.reshape(d, h, hd),
            "wk": t("self_attn.k_proj.weight", (kv * hd, d)).T.reshape(d, kv, hd),
            "wv": t("self_attn.v_proj.weight", (kv * hd, d)).T.reshape(d, kv, hd),
            "wo": t("self_attn.o_proj.weight", (d, h * hd)).T.reshape(h, hd, d),
            "ln2_scale": t("post_attention_layernorm.weight", (d,)),
            "w1": t("mlp.gate_proj.weight", (f, d)).T,
            "w3": t("mlp.up_proj.weight", (f, d)).T,
            "w2": t("mlp.down_proj.weight", (d, f)).T,
        }
        if cfg.use_bias:
            layer.update(
                bq=t("self_attn.q_proj.bias", (h * hd,)).reshape(h, hd),
                bk=t("self_attn.k_proj.bias", (kv * hd,)).reshape(kv, hd),
                bv=t("self_attn.v_proj.bias", (kv * hd,)).reshape(kv, hd),
                bo=t("self_attn.o_proj.bias", (d,)),
                b1=t("mlp.gate_proj.bias", (f,)),
                b3=t("mlp.up_proj.bias", (f,)),
                b2=t("mlp.down_proj.bias", (d,)),
            )
        layers.append(layer)
    params = {
        "embedding": take("embed_tokens.weight", (v, d)),
        "ln_f_scale": take("norm.weight", (d,)),
        **stack_layers(layers, cfg.scan_layers),
    }
    if not cfg.tie_embeddings:
        if "lm_head.weight" not in tensors:
            raise HFFormatError(f"{path} sets tie_word_embeddings=false but has no tensor 'lm_head.weight'")
        params["lm_head"] = take("lm_head.weight", (v, d)).T
    return cfg, _cast(fit_vocab(params, cfg.padded_vocab), dtype)


EXTEND_METHODS = ("interpolate", "tile")


def extend_positions(table: np.ndarray, length: int, method: str = "interpolate") -> np.ndarray:
    """A learned position table [P, D] for `length` positions. Shorter: its first rows.
    Longer: "interpolate" stretches the P rows linearly over the new length (row i of the
    new table lies at i * (P - 1) / (length - 1) of the old one); "tile" repeats the table
    (position i takes row i mod P), keeping every row a trained one."""
    table = np.asarray(table)
    old = table.shape[0]
    if length <= old:
        return table[:length]
    if method == "tile":
        return table[np.arange(length) % old]
    if method != "interpolate":
        raise ValueError(f"unknown init.extend_positions {method!r}; allowed: {', '.join(EXTEND_METHODS)}")
    where = np.arange(length) * (old - 1) / (length - 1)
    low = np.floor(where).astype(np.int64)
    high = np.minimum(low + 1, old - 1)
    frac = (where - low)[:, None].astype(np.float32)
    return (table[low] * (1 - frac) + table[high] * frac).astype(table.dtype)


def stack_layers(layers: list[dict], scan_layers: bool) -> dict:
    """Per-layer dicts as bpt's tree: one "layers" dict of stacked arrays (scan_layers) or
    "layer_0", "layer_1", ..."""
    if scan_layers:
        return {"layers": {name: np.stack([layer[name] for layer in layers]) for name in layers[0]}}
    return {f"layer_{i}": layer for i, layer in enumerate(layers)}


def unstack_layers(params: dict, num_layers: int) -> list[dict]:
    if "layers" in params:
        return [{name: np.asarray(x[i]) for name, x in params["layers"].items()} for i in range(num_layers)]
    return [{name: np.asarray(x) for name, x in params[f"layer_{i}"].items()} for i in range(num_layers)]


def _cast(tree, dtype):
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    return np.asarray(tree, dtype)


def check_gpt2_shaped(cfg: GPTConfig) -> None:
    """Raises ValueError naming the first setting a GPT-2 checkpoint cannot hold."""
    problems = []
    if cfg.position_embedding != "learned":
        problems.append(f"model.position_embedding={cfg.position_embedding!r} (GPT-2 has learned positions)")
    if cfg.kv_heads != cfg.num_heads:
        problems.append(
            f"model.num_kv_heads={cfg.num_kv_heads} (GPT-2 has one key/value head per query head)"
        )
    if cfg.num_heads * cfg.dim_per_head != cfg.d_model:
        problems.append(f"model.head_dim={cfg.head_dim} (GPT-2's heads split d_model)")
    if cfg.rms_norm:
        problems.append("model.rms_norm=True (GPT-2 has LayerNorm)")
    if cfg.mlp_activation != "gelu":
        problems.append(f"model.mlp_activation={cfg.mlp_activation!r} (GPT-2's FFN is 'gelu')")
    if not cfg.use_bias:
        problems.append("model.use_bias=False (GPT-2 has biases)")
    if problems:
        raise ValueError(f"the run is not GPT-2 shaped: {'; '.join(problems)}")


def hf_config(cfg: GPTConfig, eot_id: int | None = None) -> dict:
    """config.json of a GPT2LMHeadModel with cfg's shape."""
    check_gpt2_shaped(cfg)
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": cfg.mlp_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }
    if eot_id is not None:
        config["bos_token_id"] = config["eos_token_id"] = eot_id
    return config


def save_hf_gpt2(cfg: GPTConfig, params: dict, out: str | Path, *, eot_id: int | None = None) -> Path:
    """Writes cfg and params (bpt's tree) as a Hugging Face GPT-2 folder: config.json and
    model.safetensors in GPT2LMHeadModel's key layout, float32. load_hf_gpt2 reads it back
    to the same arrays."""
    from safetensors.numpy import save_file

    out = Path(out)
    config = hf_config(cfg, eot_id)
    d = cfg.d_model
    params = fit_vocab(params, cfg.vocab_size)  # the padded rows stay behind
    tensors = {
        "transformer.wte.weight": params["embedding"],
        "transformer.wpe.weight": params["position_embedding"],
        "transformer.ln_f.weight": params["ln_f_scale"],
        "transformer.ln_f.bias": params["ln_f_bias"],
    }
    for i, layer in enumerate(unstack_layers(params, cfg.num_layers)):
        prefix = f"transformer.h.{i}."
        tensors.update(
            {
                prefix + "ln_1.weight": layer["ln1_scale"],
                prefix + "ln_1.bias": layer["ln1_bias"],
                prefix + "attn.c_attn.weight": np.concatenate(
                    [layer[w].reshape(d, d) for w in ("wq", "wk", "wv")], axis=1
                ),
                prefix + "attn.c_attn.bias": np.concatenate(
                    [layer[b].reshape(d) for b in ("bq", "bk", "bv")]
                ),
                prefix + "attn.c_proj.weight": layer["wo"].reshape(d, d),
                prefix + "attn.c_proj.bias": layer["bo"],
                prefix + "ln_2.weight": layer["ln2_scale"],
                prefix + "ln_2.bias": layer["ln2_bias"],
                prefix + "mlp.c_fc.weight": layer["w1"],
                prefix + "mlp.c_fc.bias": layer["b1"],
                prefix + "mlp.c_proj.weight": layer["w2"],
                prefix + "mlp.c_proj.bias": layer["b2"],
            }
        )
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = np.asarray(params["lm_head"]).T
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})  # "pt": what transformers expects
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out
