"""Logits of an imported GPT-2 or Llama against transformers' own model (torch), in fp32.

    python scripts/check_hf_parity.py [--size 124m] [--seq_len 1024] [--out results.json]
    python scripts/check_hf_parity.py --size llama-1b [--seq_len 1024]

Builds a GPT2LMHeadModel (GPT-2's shapes) or a LlamaForCausalLM (llama-* sizes: grouped-query
attention, untied head) with random weights, saves it with save_pretrained (safetensors),
imports the folder with bpt.models.hf.load_hf, and compares the logits of the same tokens in
each attention mode. Needs torch and transformers (the GPU machine has both); runs on
whatever device jax and torch find.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np

SIZES = {  # GPT-2's released shapes
    "124m": dict(n_layer=12, n_embd=768, n_head=12),
    "355m": dict(n_layer=24, n_embd=1024, n_head=16),
    "774m": dict(n_layer=36, n_embd=1280, n_head=20),
    "1.5b": dict(n_layer=48, n_embd=1600, n_head=25),
    # Llama shapes: a small one, and TinyLlama-1.1B's (22 layers, GQA 32:4)
    "llama-small": dict(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=2816, vocab_size=32000,
    ),
    "llama-1b": dict(
        hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
        intermediate_size=5632, vocab_size=32000,
    ),
}  # fmt: skip
MODES = ("vanilla", "memory_efficient", "blockwise_parallel")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="124m", choices=sorted(SIZES))
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    import transformers

    from bpt.models.gpt import GPT
    from bpt.models.hf import load_hf

    torch.manual_seed(0)
    if args.size.startswith("llama"):
        config = transformers.LlamaConfig(
            max_position_embeddings=max(2048, args.seq_len), rms_norm_eps=1e-5, **SIZES[args.size]
        )
        model = transformers.LlamaForCausalLM(config).eval()
    else:
        config = transformers.GPT2Config(n_positions=max(1024, args.seq_len), **SIZES[args.size])
        model = transformers.GPT2LMHeadModel(config).eval()
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq_len))
    with torch.no_grad():
        expected = model(torch.as_tensor(tokens)).logits.double().numpy()
    results = {"size": args.size, "seq_len": args.seq_len, "batch": args.batch,
               "transformers": transformers.__version__, "torch": torch.__version__, "jax": jax.__version__,
               "device": jax.devices()[0].device_kind}  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, safe_serialization=True)
        for mode in MODES:
            cfg, params = load_hf(folder, attention_mode=mode, q_chunk_size=256, kv_chunk_size=256,
                                       loss_chunk_size=256, attention_impl="auto" if mode != "vanilla" else "reference")  # fmt: skip
            with jax.default_matmul_precision("highest"):
                logits = GPT(cfg).apply({"params": jax.tree.map(jnp.asarray, params)}, jnp.asarray(tokens))
            got = np.asarray(logits, np.float64)
            rel = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
            worst = float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))
            results[mode] = {"relative_error": rel, "max_abs_error_over_max_logit": worst}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(
        f"{'' if args.size.startswith('llama') else 'GPT-2 '}{args.size} shape, random weights, {args.batch} x {args.seq_len} tokens, fp32, {results['device']}"
    )
    print(f"{'mode':20s} {'rel. error':>12s} {'max |diff| / max |logit|':>26s}")
    for mode in MODES:
        r = results[mode]
        print(f"{mode:20s} {r['relative_error']:12.2e} {r['max_abs_error_over_max_logit']:26.2e}")


if __name__ == "__main__":
    main()
