"""What a step costs: model FLOPs per token, MFU, peak device memory; and where metrics go.

Model FLOPs count the matrix multiplications a forward and backward pass need (three times
the forward's), never what rematerialization recomputes: 6 * N_matmul per token for the
dense layers and the LM head, plus 6 * layers * heads * head_dim * seq for causal
attention (12 * ... without the causal mask, halved because a query sees half the keys on
average). With packed documents (data.segment_ids) a query sees only its own document's
keys (and bpt's kernels skip the rest): the attention term then counts the mean number of
keys a query sees in the step's batch (keys_seen), not the window's.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bpt.models import FLASHConfig, GPTConfig

# Dense bf16 tensor-core peak per device, FLOP/s, by a part of the device's name; the first
# part found wins, so the PCIe and NVL boards (lower clocks and power) come before the SXM
# default of their name ("NVIDIA H100 80GB HBM3" is the SXM board).
PEAK_BF16_FLOPS = {
    "H100 PCIE": 756e12,
    "H100 NVL": 835e12,
    "H200 NVL": 835e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
}


def train_flops_per_token(
    cfg: GPTConfig | FLASHConfig, seq_len: int, *, causal: bool = True, keys_seen: float | None = None
) -> float:
    """Model FLOPs of a training step per token, as the model's family counts them; keys_seen:
    the mean number of keys a query sees (packed documents, keys_seen()), else half of seq_len
    (causal) or all of it."""
    return cfg.train_flops_per_token(seq_len, causal=causal, keys_seen=keys_seen)


def keys_seen(segment_ids):
    """The mean number of keys a query sees under a causal mask inside its document ([batch,
    seq] ids, documents as runs of equal ids): sum over documents of length^2 / 2, over the
    tokens (seq / 2 for one document a row, as train_flops_per_token counts it)."""
    seq = segment_ids.shape[1]
    position = jnp.arange(seq, dtype=jnp.int32)
    opens = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start = lax.cummax(jnp.where(opens, position, 0), axis=1)  # where each token's document opens
    return jnp.mean((position - start).astype(jnp.float32) + 0.5)


def peak_flops_per_device(device: jax.Device, override: float = 0.0) -> float | None:
    """The device's bf16 peak (override wins); None where it is not known (a CPU, say)."""
    if override:
        return override
    kind = device.device_kind.upper()
    return next((peak for name, peak in PEAK_BF16_FLOPS.items() if name in kind), None)


def peak_memory_bytes(device: jax.Device) -> int | None:
    """Peak bytes in use on the device since the process started; on a CPU, whose backend
    keeps no such count, the process's peak resident memory (the arrays live there)."""
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"]
    if device.platform == "cpu":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return None


def strict_json(record: dict) -> str:
    """record as one line of standard JSON: NaN and infinities (which json.dumps would write
    as the non-standard NaN / Infinity) become null."""
    clean = {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


class MetricsWriter:
    """One JSON object per logged step in <workdir>/metrics.jsonl, and TensorBoard scalars.

    held=True keeps the records in memory until release() (a starting run writes nothing
    to its folder before its first checkpoint: bpt.train.run_files); the TensorBoard writer,
    which creates its event file at once, is made at the first real write."""

    def __init__(self, workdir: Path, *, held: bool = False):
        self.workdir = Path(workdir)
        self.path = self.workdir / "metrics.jsonl"
        self.tensorboard = None
        self.held = [] if held else None

    def write(self, record: dict) -> None:
        record = {k: _plain(v) for k, v in record.items()}
        if self.held is not None:
            self.held.append(record)
            return
        if self.tensorboard is None:
            from tensorboardX import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.workdir / "tensorboard"))
        with open(self.path, "a") as f:
            f.write(strict_json(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and np.isfinite(value):
                self.tensorboard.add_scalar(key, value, record["step"])
        self.tensorboard.flush()

    def release(self) -> None:
        """Writes the held records and every later one straight through."""
        held, self.held = self.held or [], None
        for record in held:
            self.write(record)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def _plain(value):
    if isinstance(value, (np.generic, jax.Array)):
        return np.asarray(value).item()
    return value
