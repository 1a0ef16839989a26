"""bpt-sample: text from a run's latest checkpoint, decoded with a key/value cache.

    bpt-sample --workdir runs/default --prompt "ROMEO:" --num_tokens 300 --temperature 0.8 --top_p 0.95

Text longer than the run's context (data.seq_len) is generated with a sliding window: the
last half of the context is kept and decoding goes on from it.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from absl import flags

from bpt.cli import common


def define_flags() -> SimpleNamespace:
    return SimpleNamespace(
        workdir=flags.DEFINE_string(
            "workdir", None, "The run's directory (config.json and checkpoints/).", required=True
        ),
        prompt=flags.DEFINE_string("prompt", "\n", "Text to continue."),
        num_tokens=flags.DEFINE_integer("num_tokens", 200, "Tokens to generate.", lower_bound=1),
        temperature=flags.DEFINE_float(
            "temperature", 0.8, "Softmax temperature; 0 takes the most likely token.", lower_bound=0.0
        ),
        top_k=flags.DEFINE_integer("top_k", 0, "Keep only the k most likely tokens (0: all).", lower_bound=0),
        top_p=flags.DEFINE_float(
            "top_p",
            1.0,
            "Keep the most likely tokens up to this probability mass (0, 1].",
            lower_bound=0.0,
            upper_bound=1.0,
        ),
        max_len=flags.DEFINE_integer(
            "max_len", 0, "Context of one decoding window (0: the run's data.seq_len).", lower_bound=0
        ),
        prefill_chunk=flags.DEFINE_integer(
            "prefill_chunk",
            4096,
            "A prompt longer than this is read in chunks of this many tokens, each attending to the cache.",
            lower_bound=1,
        ),
        seed=flags.DEFINE_integer("seed", 0, "Sampling seed."),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    if f.top_p.value <= 0.0:
        raise ValueError(f"--top_p must be in (0, 1]; got {f.top_p.value}")
    common.set_memory_fraction(common.run_memory_fraction(f.workdir.value))  # before jax starts
    import jax

    from bpt.sample import context_window, generate
    from bpt.train.loop import restore_run

    config, dataset, model, state = restore_run(f.workdir.value)
    tokenizer = getattr(dataset, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            f"the run's data (data.name={config.data.name!r}) has no tokenizer to turn text into tokens"
        )
    max_len = f.max_len.value or config.data.seq_len
    if max_len > model.config.max_seq_len and model.config.position_embedding == "learned":
        raise ValueError(
            f"--max_len={max_len} is longer than the model's learned positions (model.max_seq_len="
            f"{model.config.max_seq_len}); use --max_len={model.config.max_seq_len} or less"
        )
    prompt = tokenizer.encode(f.prompt.value)
    if len(prompt) >= max_len:
        print(
            f"note: the prompt's {len(prompt)} tokens do not fit the context of {max_len}; "
            f"only its last {context_window(max_len)} tokens are read",
            file=sys.stderr,
        )
    new = generate(
        model,
        state.params,
        prompt,
        num_tokens=f.num_tokens.value,
        max_len=max_len,
        rng=jax.random.PRNGKey(f.seed.value),
        temperature=f.temperature.value,
        top_k=f.top_k.value,
        top_p=f.top_p.value,
        prefill_chunk=f.prefill_chunk.value,
    )
    print(f.prompt.value + tokenizer.decode(new))


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
