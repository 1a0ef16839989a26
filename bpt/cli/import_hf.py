"""bpt-import-hf: a Hugging Face GPT-2 or Llama folder as a bpt run (config.json, a step-0
checkpoint, the folder's tokenizer), ready for bpt-sample, bpt-eval and
--config.init.params_from.

    bpt-import-hf path/to/gpt2 --workdir runs/gpt2
    bpt-import-hf path/to/gpt2 --workdir runs/gpt2-8k --seq_len 8192 --extend_positions interpolate \\
        --config.data.name=text --config.data.path=books/

The run's other settings (data, training, attention mode) come from --config (default: bpt's
default config) and its --config.<section>.<name>=value overrides; the model's shape comes
from the checkpoint. A --seq_len beyond a GPT-2's n_positions grows its learned position
table (--extend_positions); a Llama's rotary positions need nothing.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from absl import flags

from bpt.cli import common

ARGUMENTS = ("PATH",)  # the Hugging Face folder


def define_flags() -> SimpleNamespace:
    return SimpleNamespace(
        config=common.define_config_flag("Config file for the run's data and training settings."),
        workdir=flags.DEFINE_string("workdir", None, "The run folder to write.", required=True),
        seq_len=flags.DEFINE_integer(
            "seq_len", 0, "The run's context, data.seq_len (0: the checkpoint's n_positions or max_position_embeddings).", lower_bound=0
        ),
        extend=flags.DEFINE_enum(
            "extend_positions", "interpolate", ["interpolate", "tile"], "How a longer position table is made."
        ),
        overwrite=flags.DEFINE_bool("overwrite", False, "Replace a run already at --workdir."),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    from bpt.train.hf_runs import import_run

    workdir = import_run(
        argv[1],
        f.workdir.value,
        common.flag_config(f.config),
        seq_len=f.seq_len.value,
        extend=f.extend.value,
        overwrite=f.overwrite.value,
    )
    print(f"wrote {workdir}: bpt-sample --workdir {workdir}, bpt-eval --workdir {workdir}, "
          f"or fine-tune with --config.init.params_from={workdir}")  # fmt: skip


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
