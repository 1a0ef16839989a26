"""bpt-sample: text from a run's latest checkpoint, decoded with a key/value cache.

bpt-sample --workdir runs/default --prompt "ROMEO:" --num_tokens 300 --temperature 0.8 --top_p 0.95
"""

from __future__ import annotations

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "The run's directory (config.json and checkpoints/).", required=True
)
_PROMPT = flags.DEFINE_string("prompt", "\n", "Text to continue.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 200, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 takes the most likely token.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep only the k most likely tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Keep the most likely tokens up to this probability mass.")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "Cache length: prompt plus new tokens (0: the run's seq_len).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    import jax

    from bpt.sample import generate
    from bpt.train.loop import restore_run

    config, dataset, model, state = restore_run(_WORKDIR.value)
    tokenizer = getattr(dataset, "tokenizer", None)
    if tokenizer is None:
        raise app.UsageError(
            f"the run's data ({config.data.name!r}) has no tokenizer to turn text into tokens"
        )
    new = generate(
        model,
        state.params,
        tokenizer.encode(_PROMPT.value),
        num_tokens=_NUM_TOKENS.value,
        max_len=_MAX_LEN.value or config.data.seq_len,
        rng=jax.random.PRNGKey(_SEED.value),
        temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value,
        top_p=_TOP_P.value,
    )
    print(_PROMPT.value + tokenizer.decode(new))


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
