"""GPT-2 medium, large and xl at long context: import, then real fine-tuning steps with BPT.

    python scripts/bench_gpt2_long.py [--sizes 355m,774m,1.5b] [--seq_lens 65536] [--steps 3]
        [--workdir runs/gpt2_long_steps] [--out results.json]

For each of GPT-2's released shapes: a Hugging Face GPT-2 folder with random weights (written
by transformers' GPT2LMHeadModel.save_pretrained when transformers is installed, otherwise by
bpt-export-hf's writer), `bpt-import-hf` of that folder, then `bpt-train` with the long-context
recipe (configs/finetune_gpt2_long.py: the 1,024-position table interpolated to the context,
bf16, BPT) for a few real steps of one sequence on the copy task, each in its own process.
Prints a markdown table (time per step, tokens/s, MFU, peak memory) and writes the rows to
--out. The weights are random: this measures that the imported shapes train at the context,
not what they learn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "finetune_gpt2_long.py"
SIZES = {  # GPT-2's released shapes (n_layer, n_embd, n_head)
    "124m": (12, 768, 12),
    "355m": (24, 1024, 16),
    "774m": (36, 1280, 20),
    "1.5b": (48, 1600, 25),
    "tiny": (2, 64, 4),  # for a quick check on a CPU
}
VOCAB, POSITIONS = 50257, 1024


def write_random_gpt2(folder: Path, size: str) -> Path:
    """A GPT-2 folder of the given shape with random weights (config.json, model.safetensors)."""
    layers, width, heads = SIZES[size]
    if (folder / "config.json").is_file():
        return folder
    try:
        import torch
        import transformers
    except ImportError:
        torch = None
    if torch is not None:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, n_positions=POSITIONS, vocab_size=VOCAB
        )
        transformers.GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
        return folder
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from bpt.models.gpt import GPT, GPTConfig
    from bpt.models.hf import save_hf_gpt2

    cfg = GPTConfig(
        vocab_size=VOCAB,
        num_layers=layers,
        d_model=width,
        num_heads=heads,
        max_seq_len=POSITIONS,
        position_embedding="learned",
    )
    params = GPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    return save_hf_gpt2(cfg, jax.device_get(nn.meta.unbox(params)), folder)


def run(argv: list[str], log: Path) -> float:
    """Runs a bpt command in its own process; its output goes to log. Returns the seconds."""
    start = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", *argv], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(argv[:2])} failed (exit {done.returncode}): " + " | ".join(tail))
    return time.perf_counter() - start


def measure(size: str, seq_len: int, steps: int, workdir: Path) -> dict:
    folder = write_random_gpt2(workdir / f"hf_{size}", size)
    imported = workdir / f"import_{size}"
    if not (imported / "config.json").is_file():
        run(["bpt.cli.import_hf", str(folder), "--workdir", str(imported), "--config", str(RECIPE),
             "--config.data.name=copy"], workdir / f"import_{size}.log")  # fmt: skip
    run_dir = workdir / f"{size}_{seq_len}"
    seconds = run(
        [
            "bpt.cli.train",
            "--config", f"{RECIPE}:{imported}",
            "--workdir", str(run_dir),
            "--config.data.name=copy",
            f"--config.data.seq_len={seq_len}",
            "--config.train.batch_size=1",
            f"--config.train.steps={steps}",
            "--config.train.log_every=1",
            "--config.train.eval_batches=0",
            "--config.train.sample_tokens=0",
        ],
        workdir / f"{size}_{seq_len}.log",
    )  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r["step_seconds"] for r in rows if r.get("step_seconds")]
    last = rows[-1]
    return {
        "size": size,
        "seq_len": seq_len,
        "steps": len(rows),
        "losses": [r["loss"] for r in rows],
        "step_seconds": min(timed) if timed else None,
        "tokens_per_sec": max(r["tokens_per_sec"] or 0 for r in rows),
        "mfu": max(r.get("mfu") or 0 for r in rows) or None,
        "peak_memory_gib": last.get("peak_memory_gib"),
        "flops_per_token": last["flops_per_token"],
        "run_seconds": seconds,
    }


def main() -> None:
    from benchlib import script_parser, write_results

    parser = script_parser(__doc__)
    parser.add_argument("--sizes", default="355m,774m,1.5b")
    parser.add_argument("--seq_lens", default="65536")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workdir", default="runs/gpt2_long_steps")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    for size in sizes:
        if size not in SIZES:
            parser.error(f"--sizes: unknown size {size!r}; allowed: {', '.join(SIZES)}")
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    workdir = Path(args.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    results = []
    for size in sizes:
        for seq_len in seq_lens:
            try:
                row = measure(size, seq_len, args.steps, workdir)
            except RuntimeError as error:
                row = {"size": size, "seq_len": seq_len, "error": str(error)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        write_results(args.out, results)

    print(f"\nGPT-2 shapes imported from Hugging Face folders, fine-tuned at long context ({args.steps} steps, batch 1)\n")
    print("| shape | context | step (s) | tokens/s | MFU | peak GiB | losses |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        context = f"{r['seq_len'] // 1024}K" if r["seq_len"] >= 1024 else str(r["seq_len"])
        if "error" in r:
            print(f"| {r['size']} | {context} | failed: {r['error'][:80]} | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else ""
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] else ""
        losses = ", ".join(f"{x:.3f}" for x in r["losses"])
        print(
            f"| {r['size']} | {context} | {r['step_seconds']:.2f} | {r['tokens_per_sec']:,.0f} | {mfu} | {peak} | {losses} |"
        )


if __name__ == "__main__":
    main()
