"""bpt-sample: text from a run's latest checkpoint, decoded with a key/value cache.

    bpt-sample --workdir runs/default --prompt "ROMEO:" --num_tokens 300 --temperature 0.8 --top_p 0.95
    bpt-sample --workdir runs/default --prompt "ROMEO:" --prompt "JULIET:"   # one batch
    bpt-sample --workdir runs/long --prompt_file book.txt --sequence_shards 2  # cache on 2 GPUs
    bpt-sample --workdir runs/long --prompt_file book.txt --cache_dtype int8   # half the memory

One prompt longer than the run's context (data.seq_len) is generated with a sliding window:
the last half of the context is kept and decoding goes on from it. Several prompts (of any
lengths) decode together as one batch, within the context. --sequence_shards N shards the
key/value cache over N devices along its slots (Tree Attention decoding); by default the run's
own mesh.sequence does.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

from absl import flags

from bpt.cli import common

SUPERVISED = True  # run in a watched child process (common.supervise): a crash is still one sentence


def define_flags() -> SimpleNamespace:
    return SimpleNamespace(
        workdir=flags.DEFINE_string(
            "workdir", None, "The run's directory (config.json and checkpoints/).", required=True
        ),
        prompt=flags.DEFINE_multi_string(
            "prompt", None, "Text to continue; several --prompt decode together as a batch."
        ),
        prompt_file=flags.DEFINE_multi_string(
            "prompt_file", None, "A file whose text to continue (with or instead of --prompt)."
        ),
        num_tokens=flags.DEFINE_integer("num_tokens", 200, "Tokens to generate.", lower_bound=1),
        temperature=flags.DEFINE_float(
            "temperature", 0.8, "Softmax temperature; 0 takes the most likely token.", lower_bound=0.0
        ),
        top_k=flags.DEFINE_integer("top_k", 0, "Keep only the k most likely tokens (0: all).", lower_bound=0),
        top_p=flags.DEFINE_float(
            "top_p",
            1.0,
            "Keep the most likely tokens up to this probability mass: in (0, 1]; 1 keeps all.",
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
        cache_dtype=flags.DEFINE_enum(
            "cache_dtype",
            None,
            ["auto", "int8"],
            "The key/value cache's dtype (model.cache_dtype; default: the run's). int8 halves its memory.",
        ),
        sequence_shards=flags.DEFINE_integer(
            "sequence_shards",
            0,
            "Shard the key/value cache over this many devices (0: as the run's mesh.sequence).",
            lower_bound=0,
        ),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    if not 0.0 < f.top_p.value <= 1.0:
        raise ValueError(f"--top_p must be in (0, 1]; got {f.top_p.value}")
    texts = list(f.prompt.value or [])
    for path in f.prompt_file.value or []:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--prompt_file {path}: no such file")
        texts.append(Path(path).read_text(encoding="utf-8"))
    texts = texts or ["\n"]
    common.set_memory_fraction(common.run_memory_fraction(f.workdir.value))  # before jax starts
    import jax

    from bpt.sample import context_window, generate, generate_batch
    from bpt.train.loop import restore_run

    shards = f.sequence_shards.value
    if shards > jax.device_count():
        raise ValueError(f"--sequence_shards={shards} but only {jax.device_count()} devices are here")
    mesh = dict(data=-1, fsdp=1, tensor=1, sequence=shards) if shards else None
    config, dataset, model, state = restore_run(f.workdir.value, mesh=mesh)
    if f.cache_dtype.value:
        model = model.clone(config=dataclasses.replace(model.config, cache_dtype=f.cache_dtype.value))
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
    options = dict(
        num_tokens=f.num_tokens.value,
        max_len=max_len,
        rng=jax.random.PRNGKey(f.seed.value),
        temperature=f.temperature.value,
        top_k=f.top_k.value,
        top_p=f.top_p.value,
        prefill_chunk=f.prefill_chunk.value,
    )
    prompts = [tokenizer.encode(text) for text in texts]
    if len(prompts) == 1:
        if len(prompts[0]) >= max_len:
            print(
                f"note: the prompt's {len(prompts[0])} tokens do not fit the context of {max_len}; "
                f"only its last {context_window(max_len)} tokens are read",
                file=sys.stderr,
            )
        print(texts[0] + tokenizer.decode(generate(model, state.params, prompts[0], **options)))
        return
    for i, (text, new) in enumerate(zip(texts, generate_batch(model, state.params, prompts, **options))):
        if i:
            print()
        print(f"=== sample {i + 1} of {len(texts)} ===")
        print(text + tokenizer.decode(new))


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
