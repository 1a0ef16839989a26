"""The training step on packed documents, through `bpt-train` itself: the same model, data and
context with `data.segment_ids` off (attention over the whole window) and on (each query
inside its document; bpt's kernels and the blockwise scan skip the blocks between documents),
tokens/s, MFU and the mean number of keys a query sees (keys_seen), one row a run.

The corpus is real text every machine has: this interpreter's Python sources
(scripts/python_corpus.py, files up to --max_file_bytes, as documents), tokenized as bytes by
`bpt-prepare-data`, both made once under --out and reused. For example, on one GPU:

    python scripts/bench_packed.py --config configs/gpt_1b.py --seq_lens 32768 --steps 6 \\
        --out results/packed --set train.grad_accum_steps=2

MFU counts attention over the keys each query sees (so the two rows of a context count
different work a token); tokens/s compares them. `--attention_options
"hopper_sort_window=0;hopper_query_order=descending"` adds a packed run for each set of
`model.attention_options` (bpt's attention kernels' settings), after the default one: a
kernel option measured on the whole step, paired. The table goes to --out/table.md, every
run's metrics and command to --out/results.json, each run's output to --out/runs/.
"""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
import python_corpus  # noqa: E402
from check_gpus import device_name, jax_version, read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def prepared_corpus(out: Path, max_bytes: float, max_file_bytes: float) -> Path:
    """The byte-tokenized corpus under out/data (made once: reused when it is there)."""
    data = out / "data"
    if (data / "manifest.json").is_file():
        return data
    source = out / "corpus"
    if not source.is_dir() or not any(source.iterdir()):
        limits = ["--max_bytes", str(max_bytes), "--max_file_bytes", str(max_file_bytes)]
        python_corpus.main([str(source), *limits])
    argv = [*benchlib.console_script("bpt-prepare-data"), "--source", str(source), "--tokenizer", "byte"]
    argv += ["--val_documents", "20", "--out", str(data)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bpt-prepare-data failed:\n{(done.stderr or done.stdout)[-2000:]}")
    return data


def train_argv(config: str, workdir: Path, data: Path, seq_len: int, packed: bool, steps: int, sets: list):
    """The bpt-train command of one run: a few steps, logged twice (the last row is timed after
    the first steps), no evaluation, checkpoint or sample."""
    argv = [*benchlib.console_script("bpt-train"), "--config", config, "--workdir", str(workdir)]
    settings = {
        "data.name": "prepared",
        "data.path": str(data),
        "data.seq_len": seq_len,
        "data.segment_ids": packed,
        "train.steps": steps,
        "train.log_every": max(1, steps // 2),
        "train.eval_every": 0,
        "train.checkpoint_every": 0,
        "train.sample_tokens": 0,
    }
    argv += [f"--config.{k}={v}" for k, v in settings.items()]
    return argv + [f"--config.{s}" for s in sets]


def run(argv: list[str], workdir: Path, timeout: int) -> dict:
    """One bpt-train run's last logged row (tokens_per_sec, mfu, keys_seen, ...), or its error."""
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output, code = f"timed out after {expired.timeout} s", None
    workdir.parent.mkdir(parents=True, exist_ok=True)
    (workdir.parent / f"{workdir.name}.log").write_text(output)
    rows = read_metrics(workdir / "metrics.jsonl")
    if code != 0 or not rows:
        errors = [line for line in output.splitlines() if "error" in line.lower()] or output.splitlines()[-3:]
        return {"ok": False, "error": " | ".join(errors)[-300:]}
    return {"ok": True, **rows[-1]}


def table(results: list[dict]) -> str:
    """One line a run; packed runs also against the unpacked run at their context; a last
    column of the runs' attention options where any run has some."""
    options = any(r.get("attention_options") for r in results)
    lines = [
        "| context | segment ids | tokens/s | MFU | keys a query sees | tokens/s against unpacked |"
        + (" attention options |" if options else ""),
        "|---|---|---|---|---|---|" + ("---|" if options else ""),
    ]
    unpacked = {r["seq_len"]: r for r in results if not r["packed"] and r["ok"]}
    for r in results:
        name = benchlib.human_tokens(r["seq_len"])
        extra = [r.get("attention_options") or "defaults"] if options else []
        if not r["ok"]:
            cells = [name, "on" if r["packed"] else "off", f"failed: {r['error']}", "", "", "", *extra]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        tps, mfu = r.get("tokens_per_sec"), r.get("mfu")
        base = unpacked.get(r["seq_len"])
        ratio = f"{tps / base['tokens_per_sec']:.2f}x" if r["packed"] and base and tps else ""
        keys = r.get("keys_seen", r["seq_len"] / 2)
        cells = [
            name,
            "on" if r["packed"] else "off",
            f"{tps:,.0f}" if tps else "–",
            f"{mfu:.1%}" if mfu else "–",
            f"{keys:,.0f} of {r['seq_len'] // 2:,}",
            ratio,
            *extra,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = benchlib.script_parser(__doc__, out="results/packed", settings=True)
    parser.add_argument("--config", default="configs/gpt_1b.py")
    parser.add_argument("--seq_lens", default="32768", help="contexts, comma-separated")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max_bytes", type=float, default=200e6, help="the corpus's size at most")
    parser.add_argument("--max_file_bytes", type=float, default=16e3, help="longer sources are left out")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a run may take")
    parser.add_argument(
        "--attention_options",
        default="",
        help="semicolon-separated sets of model.attention_options, a packed run each after the default one",
    )
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.attention_options.split(";") if v.strip()]
    seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
    if not seq_lens or min(seq_lens) <= 0 or args.steps < 2:
        parser.error("--seq_lens needs positive contexts and --steps at least 2 (the last row is timed)")
    out = Path(args.out)
    data = prepared_corpus(out, args.max_bytes, args.max_file_bytes)
    results = []
    for seq_len in seq_lens:
        runs = [(False, ""), (True, ""), *((True, options) for options in variants)]
        for i, (packed, options) in enumerate(runs):
            name = f"{seq_len}_{'packed' if packed else 'window'}" + (f"_{i - 1}" if options else "")
            workdir = out / "runs" / name
            shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not a resumed one
            sets = [*args.set, *([f"model.attention_options={options}"] if options else [])]
            command = train_argv(args.config, workdir, data, seq_len, packed, args.steps, sets)
            result = run(command, workdir, args.timeout) | dict(seq_len=seq_len, packed=packed)
            result["attention_options"] = options
            result["command"] = " ".join(["bpt-train", *command[len(benchlib.console_script("bpt-train")) :]])
            results.append(result)
            shown = {k: result.get(k) for k in ("ok", "tokens_per_sec", "mfu", "keys_seen", "error")}
            label = f"segment_ids={packed}" + (f" attention_options={options}" if options else "")
            print(f"{seq_len} {label}: {json.dumps(shown)}", flush=True)
    text = table(results)
    meta = dict(
        date=datetime.date.today().isoformat(),
        device=device_name(shutil.which("nvidia-smi") is not None),  # this process leaves the GPUs alone
        jax=jax_version(),
        command="python " + " ".join(sys.argv),
    )
    benchlib.write_results(out, dict(meta=meta, results=results), table=text)
    print(text)


if __name__ == "__main__":
    main()
