"""Model FLOPs, MFU, the metrics writers and the plot command."""

import json
import shutil
import types

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_script
from test_train import copy_config

from bpt.cli.plot import plot_runs, read_metrics
from bpt.config import model_config
from bpt.models.gpt import GPTConfig
from bpt.train.loop import train
from bpt.train.metrics import MetricsWriter, keys_seen, peak_flops_per_device, train_flops_per_token


def test_flops_per_token_counts_matmuls_and_causal_attention():
    cfg = GPTConfig(vocab_size=1000, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_ratio=4.0)
    # Per layer: q and out projections 2*64*64, k and v 2*64*32, FFN 2*64*256; plus the LM head.
    matmul_params = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 256) + 64 * 1000
    attention = 12 * 2 * 4 * 16 * 512
    assert train_flops_per_token(cfg, 512, causal=False) == 6 * matmul_params + attention
    assert train_flops_per_token(cfg, 512) == 6 * matmul_params + attention / 2
    # packed documents: attention over the keys a query sees, keys_seen of the batch's ids
    assert train_flops_per_token(cfg, 512, keys_seen=100.0) == 6 * matmul_params + 12 * 2 * 4 * 16 * 100
    ids = jnp.array([[0, 0, 0, 0, 1, 1, 2, 2], [5] * 8], jnp.int32)  # documents of 4, 2, 2; one of 8
    assert float(keys_seen(ids[:1])) == pytest.approx((16 + 4 + 4) / 2 / 8)
    assert float(keys_seen(ids[1:])) == pytest.approx(8 / 2)  # one document: the causal count's seq / 2
    assert float(keys_seen(ids)) == pytest.approx((1.5 + 4) / 2)


def test_mfu_of_packed_documents_counts_the_keys_their_queries_see(tmp_path):
    """With data.segment_ids each logged row counts attention over the keys a query sees in
    its document (keys_seen, the mean of the row's steps), not the whole window's."""
    rng = np.random.default_rng(0)
    words = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do", "shake"]
    docs = [" ".join(rng.choice(words, size=rng.integers(3, 12))) for _ in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    c = copy_config(steps=4)
    c.train.log_every, c.train.peak_flops = 2, 1e12
    c.data.update(
        name="hf", path=str(tmp_path / "docs.jsonl"), seq_len=64, segment_ids=True, val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    train(c, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert 1.0 < r["keys_seen"] < 64 / 2  # documents of tens of bytes in windows of 64
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_sec"] / 1e12)
    # the FLOPs grow by attention's per key for every key seen (the matmuls' part is the rest)
    cfg = model_config(c.model, vocab_size=9, seq_len=64)
    per_key = train_flops_per_token(cfg, 64, keys_seen=1.0) - train_flops_per_token(cfg, 64, keys_seen=0.0)
    (f1, k1), (f2, k2) = ((r["flops_per_token"], r["keys_seen"]) for r in records)
    assert k1 != k2 and (f1 - f2) / (k1 - k2) == pytest.approx(per_key)
    assert per_key == 12 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head


def test_peak_flops_by_device_kind():
    device = lambda kind: types.SimpleNamespace(device_kind=kind)
    assert peak_flops_per_device(device("NVIDIA H100 80GB HBM3")) == 989e12
    assert peak_flops_per_device(device("NVIDIA A100-SXM4-80GB")) == 312e12
    assert peak_flops_per_device(device("NVIDIA H100 PCIe")) == 756e12  # not the SXM board's peak
    assert peak_flops_per_device(device("NVIDIA H100 NVL")) == 835e12
    assert peak_flops_per_device(device("NVIDIA H200")) == 989e12
    assert peak_flops_per_device(device("cpu")) is None
    assert peak_flops_per_device(device("cpu"), override=5e11) == 5e11


def test_mfu_and_tensorboard_are_written(tmp_path):
    c = copy_config(steps=10)
    c.train.peak_flops = 1e12
    train(c, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in records[1:]:  # the first interval holds only one timed step at most
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_sec"] / 1e12)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and b"loss" in events[0].read_bytes() and b"mfu" in events[0].read_bytes()


def write_run(path, records):
    path.mkdir(parents=True)
    writer = MetricsWriter(path)
    for r in records:
        writer.write(r)
    writer.close()
    return path


def test_plot_of_two_runs(tmp_path):
    a = write_run(
        tmp_path / "a", [{"step": s, "loss": 3.0 / s, "tokens_per_sec": 1000.0 + s} for s in (1, 2, 3)]
    )
    # A resumed run logs step 2 again: the last line wins.
    b = write_run(
        tmp_path / "b",
        [
            {"step": 1, "loss": 2.0, "tokens_per_sec": 900.0, "mfu": 0.3},
            {"step": 2, "loss": 9.0, "tokens_per_sec": 900.0},
            {"step": 2, "loss": 1.5, "tokens_per_sec": 950.0, "eval_loss": 1.7, "mfu": 0.31},
        ],
    )
    assert [r["loss"] for r in read_metrics(b)] == [2.0, 1.5]
    out = plot_runs([a, b], tmp_path / "plots" / "curves.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(FileNotFoundError, match="must be a bpt-train workdir"):
        read_metrics(tmp_path / "nothing")


def test_bench_packed_runs_bpt_train_with_and_without_segment_ids(tmp_path):
    """scripts/bench_packed.py: a corpus of Python sources, prepared once as bytes, trained by
    bpt-train itself with data.segment_ids off and on, and on again with other attention
    kernel options (model.attention_options); the table puts them on one context, the packed
    runs' queries seeing fewer keys than the window's half."""
    bench = load_script("bench_packed")
    argv = ["--config", "configs/tiny.py", "--seq_lens", "512", "--steps", "2", "--max_bytes", "2e5"]
    argv += ["--max_file_bytes", "1e3", "--out", str(tmp_path), "--set", "train.batch_size=4"]
    bench.main([*argv, "--attention_options", "block_q=16,block_k=16"])
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    window, packed, tuned = results
    assert window["ok"] and packed["ok"] and not window["packed"] and packed["packed"], results
    assert "keys_seen" not in window and 1 < packed["keys_seen"] < 256
    assert packed["command"].startswith("bpt-train --config configs/tiny.py")
    assert "--config.data.segment_ids=True" in packed["command"]
    assert tuned["ok"] and tuned["command"].endswith("--config.model.attention_options=block_q=16,block_k=16")
    lines = (tmp_path / "table.md").read_text().splitlines()
    assert lines[0].startswith("| context | segment ids | tokens/s |") and len(lines) == 5
    assert lines[3].startswith("| 512 | on |") and lines[3].endswith("x | defaults |")
    assert lines[4].endswith("x | block_q=16,block_k=16 |")
    # a second call reuses the prepared data (a corpus of one byte could not be prepared)
    shutil.rmtree(tmp_path / "corpus")
    assert bench.prepared_corpus(tmp_path, max_bytes=1, max_file_bytes=1) == tmp_path / "data"
