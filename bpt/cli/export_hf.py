"""bpt-export-hf: a GPT-2-shaped bpt run's latest checkpoint as a Hugging Face GPT-2 folder.

    bpt-export-hf --workdir runs/gpt2-8k --out exported/gpt2-8k

Writes config.json and model.safetensors (GPT2LMHeadModel's layout, float32) and, when the
run's tokenizer is a Hugging Face one, its files; bpt-import-hf of the result gives back the
same arrays.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from absl import flags

from bpt.cli import common


def define_flags() -> SimpleNamespace:
    return SimpleNamespace(
        workdir=flags.DEFINE_string("workdir", None, "The run to export.", required=True),
        out=flags.DEFINE_string("out", None, "The Hugging Face folder to write.", required=True),
        overwrite=flags.DEFINE_bool(
            "overwrite", False, "Replace the files of a Hugging Face folder already at --out (never a bpt run's)."
        ),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    from bpt.train.hf_runs import export_run

    out = export_run(f.workdir.value, f.out.value, overwrite=f.overwrite.value)
    print(f"wrote {out}")


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
