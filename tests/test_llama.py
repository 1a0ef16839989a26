"""Llama checkpoints in the Hugging Face layout: import parity against a NumPy Llama (RMSNorm,
SwiGLU, rotary, grouped-query attention), both config layouts of rope_theta, the imported run
fine-tuning through the long-context recipe, and folders bpt cannot read."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, rel_err

from bpt.config import load_config_file, model_config
from bpt.models.gpt import GPT, GPTConfig
from bpt.models.hf import HFFormatError, check_gpt2_shaped, load_hf, load_hf_llama
from bpt.train.hf_runs import import_run
from bpt.train.loop import restore_run, train

TINY = dict(
    vocab_size=67,
    hidden_size=32,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def write_llama_folder(folder, *, seed=0, prefix="model.", bias=False, **config):
    """A random Llama checkpoint in LlamaForCausalLM's key layout (no torch needed)."""
    from safetensors.numpy import save_file

    cfg = {**TINY, "attention_bias": bias, "mlp_bias": bias, **config}
    d, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // h
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    tensors = {"embed_tokens.weight": normal(v, d), "norm.weight": 1 + normal(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + normal(d),
            p + "self_attn.q_proj.weight": normal(h * hd, d),
            p + "self_attn.k_proj.weight": normal(kv * hd, d),
            p + "self_attn.v_proj.weight": normal(kv * hd, d),
            p + "self_attn.o_proj.weight": normal(d, h * hd),
            p + "post_attention_layernorm.weight": 1 + normal(d),
            p + "mlp.gate_proj.weight": normal(f, d),
            p + "mlp.up_proj.weight": normal(f, d),
            p + "mlp.down_proj.weight": normal(d, f),
            p + "self_attn.rotary_emb.inv_freq": normal(hd // 2),  # an old buffer, skipped
        })  # fmt: skip
        if bias:
            tensors.update({
                p + "self_attn.q_proj.bias": normal(h * hd), p + "self_attn.k_proj.bias": normal(kv * hd),
                p + "self_attn.v_proj.bias": normal(kv * hd), p + "self_attn.o_proj.bias": normal(d),
                p + "mlp.gate_proj.bias": normal(f), p + "mlp.up_proj.bias": normal(f),
                p + "mlp.down_proj.bias": normal(d),
            })  # fmt: skip
    tensors = {prefix + k: x for k, x in tensors.items()}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(v, d)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_act": "silu", **cfg}))
    plain = {k.removeprefix(prefix): x for k, x in tensors.items()}
    return plain, cfg


def numpy_llama_logits(t, cfg, tokens):
    """Llama's forward pass, written from its definition: the parity reference."""
    d, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // h
    eps, n = cfg["rms_norm_eps"], len(tokens)
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    w = lambda k: t[k].astype(np.float64)  # noqa: E731
    b = lambda k: t[k].astype(np.float64) if k in t else 0.0  # noqa: E731

    def rms(x, scale):
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * scale

    angles = np.arange(n)[:, None] * (1.0 / theta ** (np.arange(0, hd, 2) / hd))
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))

    def rotate(x):  # [n, heads, hd]: x cos + rotate_half(x) sin
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]

    x = w("embed_tokens.weight")[tokens]
    mask = np.tril(np.ones((n, n), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        a = rms(x, w(p + "input_layernorm.weight"))
        q = (a @ w(p + "self_attn.q_proj.weight").T + b(p + "self_attn.q_proj.bias")).reshape(n, h, hd)
        k = (a @ w(p + "self_attn.k_proj.weight").T + b(p + "self_attn.k_proj.bias")).reshape(n, kv, hd)
        v = (a @ w(p + "self_attn.v_proj.weight").T + b(p + "self_attn.v_proj.bias")).reshape(n, kv, hd)
        q, k = rotate(q), rotate(k)
        group = h // kv
        out = np.zeros((n, h, hd))
        for j in range(h):  # query head j reads key/value head j // group
            scores = np.where(mask, q[:, j] @ k[:, j // group].T / np.sqrt(hd), -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, j] = (weights / weights.sum(-1, keepdims=True)) @ v[:, j // group]
        x = x + out.reshape(n, h * hd) @ w(p + "self_attn.o_proj.weight").T + b(p + "self_attn.o_proj.bias")
        m = rms(x, w(p + "post_attention_layernorm.weight"))
        gate = m @ w(p + "mlp.gate_proj.weight").T + b(p + "mlp.gate_proj.bias")
        up = m @ w(p + "mlp.up_proj.weight").T + b(p + "mlp.up_proj.bias")
        silu = gate / (1 + np.exp(-gate))
        x = x + (silu * up) @ w(p + "mlp.down_proj.weight").T + b(p + "mlp.down_proj.bias")
    head = w("embed_tokens.weight") if cfg["tie_word_embeddings"] else w("lm_head.weight")
    return rms(x, w("norm.weight")) @ head.T


@pytest.mark.parametrize("mode", ["vanilla", "memory_efficient", "blockwise_parallel"])
def test_imported_llama_gives_llamas_logits_in_every_attention_mode(tmp_path, mode):
    tensors, cfg = write_llama_folder(tmp_path / "llama", seed=np.random.SeedSequence().entropy % 2**31)
    config, params = load_hf_llama(
        tmp_path / "llama", attention_mode=mode, q_chunk_size=8, kv_chunk_size=8, loss_chunk_size=8
    )
    assert (config.kv_heads, config.mlp_dim, config.rms_norm, config.use_bias) == (2, 88, True, False)
    tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], 40)
    logits = GPT(config).apply({"params": jax.tree.map(jnp.asarray, params)}, jnp.asarray(tokens)[None])[0]
    assert rel_err(logits, numpy_llama_logits(tensors, cfg, tokens)) < 1e-5


def test_llama_variants_biases_head_dim_tied_head_and_the_v5_config_layout(tmp_path):
    # Biases on every projection, heads wider than hidden_size / heads, a tied head, MQA, and
    # rope_theta where transformers v5 writes it (rope_parameters), keys without "model.".
    config = dict(head_dim=16, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    tensors, cfg = write_llama_folder(tmp_path / "llama", prefix="", bias=True, **config)
    config, params = load_hf(tmp_path / "llama", extend="tile", q_chunk_size=8, kv_chunk_size=8, loss_chunk_size=8)
    assert (config.dim_per_head, config.kv_heads, config.rope_theta, config.tie_embeddings) == (16, 1, 1e4, True)
    tokens = np.random.default_rng(2).integers(0, cfg["vocab_size"], 24)
    logits = GPT(config).apply({"params": jax.tree.map(jnp.asarray, params)}, jnp.asarray(tokens)[None])[0]
    assert rel_err(logits, numpy_llama_logits(tensors, cfg, tokens)) < 1e-5


def test_bpts_own_llama_shaped_init_has_the_imported_tree_and_counted_parameters(tmp_path):
    for bias in (False, True):
        write_llama_folder(tmp_path / f"llama{bias}", bias=bias)
        config, params = load_hf_llama(tmp_path / f"llama{bias}")
        init = nn.meta.unbox(GPT(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
        assert jax.tree.map(np.shape, init) == jax.tree.map(np.shape, params)
        held = config.num_params() + config.vocab_padding_params  # padding rows: held, not counted
        assert held == sum(x.size for x in jax.tree.leaves(params))
        with pytest.raises(ValueError, match="model.rms_norm=True.*mlp_activation='swiglu'"):
            check_gpt2_shaped(config)  # bpt-export-hf writes GPT-2 folders only


def test_an_imported_llama_run_fine_tunes_with_the_long_context_recipe(tmp_path):
    tensors, cfg = write_llama_folder(tmp_path / "llama")
    recipe = load_config_file(f"{REPO}/configs/finetune_gpt2_long.py")
    recipe.data.update(name="copy", copy_symbols=8)  # the folder has no tokenizer
    run = import_run(tmp_path / "llama", tmp_path / "run", recipe, seq_len=32)
    saved, _, model, state = restore_run(run)
    assert saved.model.position_embedding == "rotary" and saved.model.mlp_hidden == 88
    tokens = np.random.default_rng(3).integers(0, cfg["vocab_size"], 32)
    logits = model.apply({"params": state.params}, jnp.asarray(tokens)[None])[0]
    assert rel_err(logits, numpy_llama_logits(tensors, cfg, tokens)) < 2e-2  # the run computes in bf16

    c = load_config_file(f"{REPO}/configs/finetune_gpt2_long.py:{run}")
    assert (c.model.rms_norm, c.model.mlp_activation, c.model.num_kv_heads) == (True, "swiglu", 2)
    c.data.update(name="copy", seq_len=32, copy_symbols=8)
    c.model.update(dtype="float32", q_chunk_size=8, kv_chunk_size=8, loss_chunk_size=8, dropout=0.0)
    c.train.update(steps=2, log_every=1, batch_size=2, sample_tokens=0, eval_every=0, eval_batches=1)
    c.train.eval_by_position = 0
    last = train(c, tmp_path / "ft")
    assert np.isfinite(last["loss"]) and np.isfinite(last["eval_loss"])
    assert model_config(c.model, vocab_size=9, seq_len=32).mlp_activation == "swiglu"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'; bpt's SwiGLU FFN uses 'silu'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope type 'yarn'"),
        ({"attention_bias": True}, "attention_bias=True but mlp_bias=False"),
        ({"model_type": "mistral"}, "model_type='mistral'; bpt imports GPT-2 and Llama"),
    ],
)
def test_llama_configs_bpt_cannot_run_are_clear_errors(tmp_path, change, message):
    write_llama_folder(tmp_path / "llama")
    path = tmp_path / "llama" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(HFFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_hf(tmp_path / "llama")


def test_a_missing_or_misshapen_llama_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_llama_folder(tmp_path / "llama")
    weights = tmp_path / "llama" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(HFFormatError, match=r"no tensor 'layers.1.mlp.up_proj.weight' \(nor 'model."):
        load_hf_llama(tmp_path / "llama")
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((88, 31), np.float32)
    save_file(tensors, weights)
    with pytest.raises(HFFormatError, match=r"'layers.1.mlp.up_proj.weight'.*\(88, 31\).*\(88, 32\)"):
        load_hf_llama(tmp_path / "llama")


def test_swiglu_rmsnorm_without_biases_is_a_config_choice_for_training_from_scratch():
    cfg = GPTConfig(
        vocab_size=11, num_layers=1, d_model=16, num_heads=2, mlp_hidden=40, mlp_activation="swiglu",
        use_bias=False, rms_norm=True, q_chunk_size=4, kv_chunk_size=4, loss_chunk_size=4,
    )  # fmt: skip
    params = nn.meta.unbox(GPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    assert sorted(params["layers"]) == ["ln1_scale", "ln2_scale", "w1", "w2", "w3", "wk", "wo", "wq", "wv"]
    assert "ln_f_bias" not in params and params["layers"]["w3"].shape == (1, 16, 40)
    with pytest.raises(ValueError, match="unknown model.mlp_activation 'tanh'; allowed: gelu, swiglu, relu"):
        GPTConfig(vocab_size=11, num_layers=1, d_model=16, num_heads=2, mlp_activation="tanh")
