"""GPT-2 checkpoints in the Hugging Face layout: import parity against a NumPy GPT-2, both key
layouts, sharded files, the export round trip, position extension, and bad folders."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, rel_err

from bpt.models.gpt import GPT
from bpt.models.hf import HFFormatError, extend_positions, load_hf_gpt2, save_hf_gpt2

TINY = dict(vocab_size=61, n_positions=48, n_embd=32, n_layer=2, n_head=4)


def write_gpt2_folder(folder, *, seed=0, prefix="transformer.", sharded=False, **config):
    """A random GPT-2 checkpoint as save_pretrained writes it (no torch needed)."""
    from safetensors.numpy import save_file

    cfg = {**TINY, **config}
    d, v, p, f = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"], cfg.get("n_inner") or 4 * cfg["n_embd"]
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    tensors = {
        "wte.weight": normal(v, d),
        "wpe.weight": normal(p, d),
        "ln_f.weight": 1 + normal(d),
        "ln_f.bias": normal(d),
    }
    for i in range(cfg["n_layer"]):
        h = f"h.{i}."
        tensors.update({
            h + "ln_1.weight": 1 + normal(d), h + "ln_1.bias": normal(d),
            h + "attn.c_attn.weight": normal(d, 3 * d), h + "attn.c_attn.bias": normal(3 * d),
            h + "attn.c_proj.weight": normal(d, d), h + "attn.c_proj.bias": normal(d),
            h + "ln_2.weight": 1 + normal(d), h + "ln_2.bias": normal(d),
            h + "mlp.c_fc.weight": normal(d, f), h + "mlp.c_fc.bias": normal(f),
            h + "mlp.c_proj.weight": normal(f, d), h + "mlp.c_proj.bias": normal(d),
            h + "attn.bias": np.tril(np.ones((1, 1, p, p), np.float32)),  # an old mask buffer
        })  # fmt: skip
    tensors = {prefix + k: x for k, x in tensors.items()}
    folder.mkdir(parents=True, exist_ok=True)
    if sharded:
        keys = sorted(tensors)
        halves = {
            "model-00001-of-00002.safetensors": keys[::2],
            "model-00002-of-00002.safetensors": keys[1::2],
        }
        for name, part in halves.items():
            save_file({k: tensors[k] for k in part}, folder / name, metadata={"format": "pt"})
        weight_map = {k: name for name, part in halves.items() for k in part}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "activation_function": "gelu_new", **cfg})
    )
    return {k.removeprefix(prefix): x for k, x in tensors.items()}, cfg


def numpy_gpt2_logits(t, cfg, tokens):
    """GPT-2's forward pass, written from its definition: the parity reference."""
    d, heads, eps = cfg["n_embd"], cfg["n_head"], 1e-5
    hd = d // heads

    def ln(x, w, b):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w + b

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    x = t["wte.weight"][tokens].astype(np.float64) + t["wpe.weight"][np.arange(len(tokens))]
    n = len(tokens)
    mask = np.tril(np.ones((n, n), bool))
    for i in range(cfg["n_layer"]):
        p = lambda k: t[f"h.{i}.{k}"].astype(np.float64)  # noqa: E731
        qkv = ln(x, p("ln_1.weight"), p("ln_1.bias")) @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
        q, k, v = (qkv[:, j * d : (j + 1) * d].reshape(n, heads, hd).transpose(1, 0, 2) for j in range(3))
        scores = np.where(mask, q @ k.transpose(0, 2, 1) / np.sqrt(hd), -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attn = (weights @ v).transpose(1, 0, 2).reshape(n, d)
        x = x + attn @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        hidden = gelu(ln(x, p("ln_2.weight"), p("ln_2.bias")) @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
        x = x + hidden @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    return ln(x, t["ln_f.weight"], t["ln_f.bias"]) @ t["wte.weight"].T.astype(np.float64)


@pytest.mark.parametrize("mode", ["vanilla", "memory_efficient", "blockwise_parallel"])
def test_imported_gpt2_gives_gpt2s_logits_in_every_attention_mode(tmp_path, mode):
    tensors, cfg = write_gpt2_folder(tmp_path / "gpt2", seed=np.random.SeedSequence().entropy % 2**31)
    config, params = load_hf_gpt2(
        tmp_path / "gpt2", attention_mode=mode, q_chunk_size=8, kv_chunk_size=8, loss_chunk_size=8
    )
    tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], 40)
    logits = GPT(config).apply({"params": jax.tree.map(jnp.asarray, params)}, jnp.asarray(tokens)[None])[0]
    assert rel_err(logits, numpy_gpt2_logits(tensors, cfg, tokens)) < 1e-5


@pytest.mark.parametrize("layout", ["plain", "sharded"])
def test_both_key_layouts_and_sharded_files_load_the_same_weights(tmp_path, layout):
    write_gpt2_folder(tmp_path / "a", prefix="transformer.")
    write_gpt2_folder(tmp_path / "b", prefix="", sharded=layout == "sharded")
    (_, a), (_, b) = load_hf_gpt2(tmp_path / "a"), load_hf_gpt2(tmp_path / "b")
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_export_then_import_gives_back_the_same_arrays(tmp_path):
    write_gpt2_folder(tmp_path / "gpt2")
    for scan in (True, False):
        config, params = load_hf_gpt2(tmp_path / "gpt2", scan_layers=scan)
        save_hf_gpt2(config, params, tmp_path / f"out{scan}")
        again_config, again = load_hf_gpt2(tmp_path / f"out{scan}", scan_layers=scan)
        assert again_config == config
        jax.tree.map(np.testing.assert_array_equal, again, params)
    # bpt's own initialization has the tree the import makes.
    init = nn.meta.unbox(GPT(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
    assert jax.tree.map(np.shape, init) == jax.tree.map(np.shape, params)


def test_position_tables_grow_by_interpolation_or_tiling(tmp_path):
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(extend_positions(table, 8, "tile"), np.concatenate([table, table]))
    grown = extend_positions(table, 7, "interpolate")
    np.testing.assert_allclose(grown[::2], table)  # 7 rows over 4: every other one is an old row
    np.testing.assert_allclose(grown[1], (table[0] + table[1]) / 2)
    np.testing.assert_array_equal(extend_positions(table, 2), table[:2])
    with pytest.raises(ValueError, match="unknown init.extend_positions 'cubic'"):
        extend_positions(table, 8, "cubic")
    write_gpt2_folder(tmp_path / "gpt2")
    config, params = load_hf_gpt2(tmp_path / "gpt2", max_seq_len=96, extend="tile")
    assert config.max_seq_len == 96 and params["position_embedding"].shape == (96, 32)


def test_bad_folders_are_clear_errors(tmp_path):
    with pytest.raises(HFFormatError, match="has no config.json"):
        load_hf_gpt2(tmp_path)
    write_gpt2_folder(tmp_path / "llama")
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(HFFormatError, match="holds a 'llama' model, not GPT-2: use load_hf"):
        load_hf_gpt2(tmp_path / "llama")
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    with pytest.raises(HFFormatError, match="model_type='bert'; bpt imports GPT-2 and Llama"):
        load_hf_gpt2(tmp_path / "llama")

    from safetensors.numpy import load_file, save_file

    write_gpt2_folder(tmp_path / "missing")
    tensors = load_file(tmp_path / "missing" / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, tmp_path / "missing" / "model.safetensors")
    with pytest.raises(HFFormatError, match="no tensor 'h.1.mlp.c_fc.bias'"):
        load_hf_gpt2(tmp_path / "missing")

    write_gpt2_folder(tmp_path / "shape")
    (tmp_path / "shape" / "config.json").write_text(json.dumps({**cfg, "n_positions": 64}))
    with pytest.raises(
        HFFormatError, match=r"'wpe.weight' .* shape \(48, 32\); its config.json implies \(64, 32\)"
    ):
        load_hf_gpt2(tmp_path / "shape")


def test_import_sample_eval_finetune_at_a_longer_context_and_export(tmp_path):
    import subprocess
    import sys

    from test_data import text_config, write_corpus

    from bpt.config import load_config_file
    from bpt.data.tokenizers import train_bpe_tokenizer
    from bpt.train.loop import train

    corpus = write_corpus(tmp_path / "corpus", ["Friends, Romans, countrymen, lend me your ears. " * 60])
    tokenizer = train_bpe_tokenizer(iter([(corpus / "doc0.txt").read_text()]), 300, tmp_path / "gpt2")
    tensors, cfg = write_gpt2_folder(tmp_path / "gpt2", vocab_size=tokenizer.vocab_size, n_positions=32)
    data = text_config(corpus, tmp_path)

    def command(name, *args):
        result = subprocess.run(
            [sys.executable, "-m", f"bpt.cli.{name}", *args], capture_output=True, text=True, cwd=tmp_path
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    run = tmp_path / "run"
    data_flags = ["--config.data.name=text", f"--config.data.path={corpus}", f"--config.data.cache_dir={data.data.cache_dir}",
                  "--config.model.q_chunk_size=8", "--config.model.kv_chunk_size=8", "--config.model.loss_chunk_size=8"]  # fmt: skip
    command("import_hf", str(tmp_path / "gpt2"), "--workdir", str(run), *data_flags)
    assert "Friends" in command("sample", "--workdir", str(run), "--prompt", "Friends", "--num_tokens", "40")
    evaluated = json.loads(
        command(
            "eval",
            "--workdir",
            str(run),
            "--eval_batches",
            "1",
            "--batch_size",
            "2",
            "--by_position",
            "--first_bucket",
            "8",
        )
    )
    assert evaluated["step"] == 0 and np.isfinite(evaluated["eval_loss"])
    rows = evaluated["by_position"]  # [0, 8), [8, 16), [16, 32): every position counted once
    assert [(r["start"], r["end"]) for r in rows] == [(0, 8), (8, 16), (16, 32)]
    assert sum(r["tokens"] for r in rows) == 2 * 32
    mean = sum(r["loss"] * r["tokens"] for r in rows) / 64
    np.testing.assert_allclose(mean, evaluated["eval_loss"], rtol=1e-5)
    assert (run / "loss_by_position.png").stat().st_size > 0

    # Fine-tuning at twice the checkpoint's 32 positions with the recipe's config: the table
    # grows by tiling.
    c = load_config_file(f"{REPO}/configs/finetune_gpt2_long.py:{run}")
    assert c.model.d_model == cfg["n_embd"] and c.data.tokenizer == str(run / "tokenizer")
    c.data.update(name="text", path=str(corpus), cache_dir=data.data.cache_dir, seq_len=64, val_documents=0)
    c.data.val_fraction = 0.3  # the validation text must fill a 64-token window
    c.model.update(dtype="float32", q_chunk_size=8, kv_chunk_size=8, loss_chunk_size=8, dropout=0.0)
    c.init.extend_positions = "tile"
    c.train.update(steps=2, log_every=2, batch_size=2, sample_tokens=0, eval_every=0, eval_batches=1)
    c.train.learning_rate = 1e-9  # the parameters stay where the import put them
    train(c, tmp_path / "long")
    _, long_params = load_hf_gpt2(tmp_path / "gpt2", max_seq_len=64, extend="tile")
    command("export_hf", "--workdir", str(tmp_path / "long"), "--out", str(tmp_path / "exported"))
    exported_cfg, exported = load_hf_gpt2(tmp_path / "exported")
    assert exported_cfg.max_seq_len == 64 and (tmp_path / "exported" / "tokenizer.json").is_file()
    np.testing.assert_allclose(exported["position_embedding"], long_params["position_embedding"], atol=1e-6)

    # import(export(x)) == x exactly, through the commands.
    command("export_hf", "--workdir", str(run), "--out", str(tmp_path / "back"))
    jax.tree.map(
        np.testing.assert_array_equal, load_hf_gpt2(tmp_path / "back")[1], load_hf_gpt2(tmp_path / "gpt2")[1]
    )

    # A run's folder is self-contained: moved, it samples with its own tokenizer.
    moved = tmp_path / "moved"
    run.rename(moved)
    assert "Friends" in command("sample", "--workdir", str(moved), "--prompt", "Friends", "--num_tokens", "8")
    # Export never writes over a bpt run, and over another folder only with --overwrite.
    for out, sentence in ((moved, "holds a bpt run"), (tmp_path / "long", "holds a bpt run"),
                          (tmp_path / "back", "already exists; choose another --out or pass --overwrite")):  # fmt: skip
        before = sorted(p.name for p in out.iterdir())
        refused = subprocess.run(
            [sys.executable, "-m", "bpt.cli.export_hf", "--workdir", str(moved), "--out", str(out)],
            capture_output=True, text=True, cwd=tmp_path,
        )  # fmt: skip
        assert refused.returncode == 1 and sentence in refused.stderr, refused.stderr
        assert sorted(p.name for p in out.iterdir()) == before
    command("export_hf", "--workdir", str(moved), "--out", str(tmp_path / "back"), "--overwrite")


def test_a_folder_without_a_tokenizer_imports_only_with_one_of_its_size(tmp_path):
    """No tokenizer files: data.tokenizer must have the model's vocabulary (the default,
    bytes, has 257 tokens), or samples would drop the ids it cannot decode."""
    from bpt.config import base_config
    from bpt.train.hf_runs import import_run

    write_gpt2_folder(tmp_path / "g50", vocab_size=50, n_positions=16)
    with pytest.raises(ValueError, match="has no tokenizer files and its model has 50 tokens, but data.tokenizer='byte' has 257"):
        import_run(tmp_path / "g50", tmp_path / "run50", base_config())
    assert not (tmp_path / "run50").exists()
    write_gpt2_folder(tmp_path / "g257", vocab_size=257, n_positions=16)
    import_run(tmp_path / "g257", tmp_path / "run257", base_config())
    assert (tmp_path / "run257" / "config.json").is_file()


def test_exporting_a_flash_run_says_what_export_writes(tmp_path):
    from bpt.train.hf_runs import export_run

    run = tmp_path / "flash"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"family": "flash"}, "data": {}, "train": {}}))
    with pytest.raises(ValueError, match="writes GPT-2 folders, from runs of model.family='gpt'; .* model.family='flash' run"):
        export_run(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
