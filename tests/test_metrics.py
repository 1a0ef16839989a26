"""Model FLOPs, MFU, the metrics writers and the plot command."""

import json
import types

import pytest
from test_train import copy_config

from bpt.cli.plot import plot_runs, read_metrics
from bpt.models.gpt import GPTConfig
from bpt.train.loop import train
from bpt.train.metrics import MetricsWriter, peak_flops_per_device, train_flops_per_token


def test_flops_per_token_counts_matmuls_and_causal_attention():
    cfg = GPTConfig(vocab_size=1000, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_ratio=4.0)
    # Per layer: q and out projections 2*64*64, k and v 2*64*32, FFN 2*64*256; plus the LM head.
    matmul_params = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 256) + 64 * 1000
    attention = 12 * 2 * 4 * 16 * 512
    assert train_flops_per_token(cfg, 512, causal=False) == 6 * matmul_params + attention
    assert train_flops_per_token(cfg, 512) == 6 * matmul_params + attention / 2


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
