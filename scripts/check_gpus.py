"""A check campaign over every GPU of this host, through `bpt-train` itself.

    python scripts/check_gpus.py --out results/check_gpus                # every row; resumes
    python scripts/check_gpus.py --out results/check_gpus --rows losses  # rows whose name has 'losses'
    python scripts/check_gpus.py --out results/check_gpus --budget_minutes 8
    python scripts/check_gpus.py --out results/check_gpus --report       # the table from what is there
    python scripts/check_gpus.py --list                                  # the rows for this host
    python scripts/check_gpus.py --out results/check_overlap --rows 1B --set train.xla_flags=overlap

Each row is one real `bpt-train` run (the console script, in a process of its own, with the
settings a user would type) on all N GPUs, a few steps long, checkpoints off:

- losses: configs/tiny.py in float32 on the copy task, on one GPU and then over each mesh
  (data, fsdp, tensor, sequence with the ring, zigzag and striped, and all_gather, fsdp x
  sequence, tensor x sequence). The data and the initial parameters do not depend on the mesh,
  so every run's losses must equal the one-GPU run's (relative 1e-4; matmuls at full float32
  precision). Tensor parallelism splits the byte vocabulary padded to model.vocab_multiple.
- processes: the multi-host command on this one host, a bpt-train process a GPU joined by
  jax.distributed on localhost (each taking its GPU with --local_device_ids, then each seeing
  only its own through CUDA_VISIBLE_DEVICES), against one process over all GPUs: GPT-125M at
  8K, data parallel. Equal losses (relative 1e-3, bf16) and a clean exit pass; the table adds
  the speed and peak memory against the one process's.
- GPT-1B (configs/gpt_1b.py, bf16) over data, fsdp, tensor, the ring (zigzag, striped) and
  all_gather at 128K, the ring and all_gather at 512K, fsdp x sequence and tensor x sequence
  at 512K, and the longest context the mesh holds, ring and all_gather (searched by compiled
  memory with scripts/bench_max_context.py, then trained).
- norm kernels: a losses row (fsdp, and x the ring on 4 GPUs or more) and GPT-7B with fsdp at 32K again with
  `model.norm_impl=pallas` (bpt's LayerNorm kernels on each device's rows; auto keeps XLA's
  norms on a mesh until these rows have measured them).
- GPT-7B (configs/gpt_7b.py) with fsdp at 32K, fsdp x sequence (sequence alone on 2 GPUs) at
  128K, and at its longest.

A row passes when the run exits 0 without the coordination service's errors and, for losses
(processes) rows, its losses equal the one-GPU (one-process) run's.
Results go to --out: results.json (every row), report.md (the table printed last: a row's
compile seconds are remat auto's choice plus the train step's, each in brackets where auto
compiled candidates, "step cached" where the step came from bpt-train's compile cache) and
check_gpus.png (tokens/s per GPU and peak memory of each row). A finished row is not run
again (--rerun_failed retries failed ones), so a campaign spans several calls; a "longest"
row's search keeps every compile it finishes, also when --timeout stops it, and its rerun
goes on from them;
--budget_minutes stops starting rows once that much time has passed. --set section.name=value
(repeatable) gives every row's run that setting too (a campaign folder keeps its settings:
another set of them wants another --out). Without GPUs the rows
run on --cpu_devices simulated CPU devices, with the model sizes cut down (for tests).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_scaleout import gpu_count, gpu_names
from benchlib import compile_records, console_script, human_tokens, script_parser

from bpt.train.loop import STEP_REUSED
from bpt.train.probe import CHOICE_NOTES

ROOT = Path(__file__).resolve().parent.parent
LOSS_RTOL = 1e-4
PROCESS_RTOL = 1e-3  # a process a GPU against one process: the same bf16 step, summed in another order
# what a run that exits 0 must not say (the coordination service's errors at exit)
# What the coordination service's end says when a run of several processes exits untidily
# (every line of it: XLA's warning spans several; scripts/repro_exit_warning.py counts them too)
EXIT_COMPLAINTS = ("WatchTasksAsync", "Connection refused", "coordination_service", "Coordination service")
# bpt's LayerNorm kernels on each device's rows (auto keeps XLA's norms on a mesh until these
# rows measure them against the rows without it)
NORM_KERNELS = "model.norm_impl=pallas"
COMMON = [  # every row: a few steps, each logged, nothing else
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=0",
    "train.sample_tokens=0",
    "train.checkpoint_every=0",
    "data.name=copy",
]


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    group: str  # losses | 1b | 7b
    config: str
    context: int  # tokens a sequence; 0: the longest the mesh holds (searched)
    mesh: dict  # mesh.* settings
    batch: int
    steps: int = 2
    min_gpus: int = 2
    extra: tuple = ()  # more section.name=value settings
    processes: int = 1  # >1: one bpt-train process a GPU (jax.distributed over localhost)
    isolated: bool = False  # each process sees only its GPU (CUDA_VISIBLE_DEVICES) instead of all

    def settings(self, context: int) -> list[str]:
        mesh = {"data": 1, **self.mesh}
        return [
            *COMMON,
            f"data.seq_len={context}",
            f"train.batch_size={self.batch}",
            f"train.steps={self.steps}",
            *(f"mesh.{k}={v}" for k, v in mesh.items()),
            *self.extra,
        ]


def rows_for(n: int, *, small: bool = False) -> list[Row]:
    """The campaign's rows on n devices, in the order they run (small: sizes for CPU tests)."""
    half = max(n // 2, 1)
    tiny = "configs/tiny.py"
    loss_rows = [
        Row("losses: 1 GPU", "losses", tiny, 256, {}, 8, steps=4, min_gpus=1),
        Row("losses: data", "losses", tiny, 256, {"data": n}, 8, steps=4),
        Row("losses: fsdp", "losses", tiny, 256, {"fsdp": n}, 8, steps=4),
        Row("losses: tensor", "losses", tiny, 256, {"tensor": min(n, 4), "data": max(n // 4, 1)}, 8, steps=4),
        Row("losses: ring zigzag", "losses", tiny, 256, {"sequence": n}, 8, steps=4),
        Row("losses: ring striped", "losses", tiny, 256, {"sequence": n, "load_balance": "striped"}, 8, steps=4),
        Row("losses: all_gather", "losses", tiny, 256, {"sequence": n, "context_parallel": "all_gather"}, 8, steps=4),
        Row("losses: fsdp x sequence", "losses", tiny, 256, {"fsdp": 2, "sequence": half}, 8, steps=4, min_gpus=4),
        Row("losses: tensor x sequence", "losses", tiny, 256, {"tensor": 2, "sequence": half}, 8, steps=4, min_gpus=4),
        Row("losses: norm kernels", "losses", tiny, 256, {"fsdp": 2, "sequence": half} if n >= 4 else {"fsdp": n},
            8, steps=4, extra=(NORM_KERNELS,)),
    ]  # fmt: skip
    one_b, seven_b = "configs/gpt_1b.py", "configs/gpt_7b.py"
    k = 1024 if not small else 4  # contexts scale down on CPUs
    cut = ("model.num_layers=2", "model.d_model=256", "model.num_heads=4") if small else ()
    # The multi-host command on one host, a process a GPU, against one process over the same
    # GPUs: equal losses, tokens/s and memory. "isolated" is the way that hides the other GPUs.
    small_gpt = "configs/gpt_125m.py" if not small else tiny
    process_rows = [
        Row("processes: one over all GPUs", "processes", small_gpt, 8 * k, {"data": n}, 2 * n, steps=6),
        Row("processes: one a GPU", "processes", small_gpt, 8 * k, {"data": n}, 2 * n, steps=6, processes=n),
        Row("processes: one a GPU, isolated", "processes", small_gpt, 8 * k, {"data": n}, 2 * n, steps=6,
            processes=n, isolated=True),
    ][: 2 if small else 3]  # fmt: skip  (CPU devices have nothing to isolate)
    big = [
        Row("1B ring zigzag 128K", "1b", one_b, 128 * k, {"sequence": n}, 1, extra=cut),
        Row("7B fsdp 32K", "7b", seven_b, 32 * k, {"fsdp": n}, n, extra=cut),
        Row("7B fsdp 32K, norm kernels", "7b", seven_b, 32 * k, {"fsdp": n}, n, extra=(*cut, NORM_KERNELS)),
        Row("1B tensor 32K", "1b", one_b, 32 * k, {"tensor": n}, 1, extra=cut),
        Row("1B all_gather 128K", "1b", one_b, 128 * k, {"sequence": n, "context_parallel": "all_gather"}, 1, extra=cut),
        Row("1B ring striped 128K", "1b", one_b, 128 * k, {"sequence": n, "load_balance": "striped"}, 1, extra=cut),
        Row("1B data 8K", "1b", one_b, 8 * k, {"data": n}, n, extra=cut),
        Row("1B fsdp 32K", "1b", one_b, 32 * k, {"fsdp": n}, n, extra=cut),
        Row("1B ring 512K", "1b", one_b, 512 * k, {"sequence": n}, 1, extra=cut),
        Row("1B all_gather 512K", "1b", one_b, 512 * k, {"sequence": n, "context_parallel": "all_gather"}, 1, extra=cut),
        Row("1B fsdp x sequence 512K", "1b", one_b, 512 * k, {"fsdp": 2, "sequence": half}, 2, min_gpus=4, extra=cut),
        Row("1B tensor x sequence 512K", "1b", one_b, 512 * k, {"tensor": 2, "sequence": half}, 1, min_gpus=4, extra=cut),
        Row("7B fsdp x sequence 128K", "7b", seven_b, 128 * k,
            {"fsdp": 2, "sequence": half} if n >= 4 else {"sequence": n}, 2 if n >= 4 else 1, extra=cut),
        Row("1B ring longest", "1b", one_b, 0, {"sequence": n}, 1, steps=1, extra=cut),
        Row("1B all_gather longest", "1b", one_b, 0, {"sequence": n, "context_parallel": "all_gather"}, 1, steps=1, extra=cut),
        Row("7B ring longest", "7b", seven_b, 0, {"sequence": n}, 1, steps=1, extra=cut),
    ]  # fmt: skip
    return loss_rows + process_rows + big


def environment(n: int, on_gpu: bool, group: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_names(n))
        # bpt-train runs the step remat_layer=auto compiled; a rerun of a row (or a row with
        # auto off) reads its step from this cache
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "bpt-xla-cache"))
    else:
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n))
    if group == "losses":  # float32 matmuls at full precision (GPUs default to TF32)
        env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    return env


def bpt_train() -> list[str]:
    """The bpt-train console script beside this Python (python -m bpt.cli.train if absent)."""
    return console_script("bpt-train")


def longest(row: Row, n: int, env: dict, out: Path, timeout: int, small: bool) -> tuple[int, str]:
    """The longest context of row's setup by compiled memory (bench_max_context's search over
    multiples of 2 x N x 1024 tokens, from N x 256K, 7B from N x 128K; the remat auto falls back to), and a note.
    Every compile the search finishes is kept (<row>.compiles.jsonl), also when the search
    runs out of time, and a later call's search goes on from them (bench_max_context --known):
    a search longer than a row's --timeout ends over several calls (--rerun_failed)."""
    granule = 2 * n * (1024 if not small else 4)
    # GPT-7B holds its parameters and optimizer state on each sequence shard: 512K over 2
    # H200s compiled to 151 GiB of 133 (docs/notes/multi_gpu.md), so its search starts lower.
    start = n * (256 * 1024 if not small else 64) // (2 if row.group == "7b" else 1)
    sets = [f"--set=mesh.{k}={v}" for k, v in {"data": 1, **row.mesh}.items()] + [f"--set={e}" for e in row.extra]
    record = out / f"{slug(row.name)}.search.json"
    compiles = out / f"{slug(row.name)}.compiles.jsonl"
    argv = [
        sys.executable, str(ROOT / "scripts" / "bench_max_context.py"), "--configs", row.config,
        "--modes", "blockwise_parallel", "--remats", "layer", "--start", str(start), "--granule", str(granule),
        "--refine", "4", "--out", str(record), "--known", str(compiles), *sets,
    ]  # fmt: skip
    if small:
        argv += ["--memory_gib", "0.5"]
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        kept = keep_compiles(compiles, _said(expired.stdout))
        raise subprocess.TimeoutExpired(expired.cmd, expired.timeout, output=f"{kept} compile{'s' * (kept != 1)} kept") from None
    keep_compiles(compiles, done.stdout)
    if done.returncode != 0 or not record.exists():
        return 0, last_line(done.stdout + done.stderr)
    records = json.loads(record.read_text())["records"]
    found = [r for r in records if r.get("summary")]
    tried = [r for r in records if "seq_len" in r]
    return (found[0]["longest"] if found else 0), f"{len(tried)} compiles"


def keep_compiles(path: Path, output: str) -> int:
    """Appends the compile records in a search's output that path does not hold yet; returns
    how many compiles path holds."""
    held = compile_records(path.read_text()) if path.exists() else {}
    new = [record for key, record in compile_records(output).items() if key not in held]
    with path.open("a") as f:
        f.writelines(json.dumps(record) + "\n" for record in new)
    return len(held) + len(new)


def run_row(row: Row, n: int, on_gpu: bool, out: Path, timeout: int, small: bool) -> dict:
    env = environment(row_gpus(row, n), on_gpu, row.group)
    result = {"name": row.name, "group": row.group, "config": row.config, "gpus": row_gpus(row, n)}
    start = time.perf_counter()
    context, note = row.context, ""
    if not context:
        try:
            context, note = longest(row, n, env, out, timeout, small)
            error = f"no context fits ({note})"
        except subprocess.TimeoutExpired as expired:
            context, error = 0, f"the search took over {timeout} s ({expired.output}; --rerun_failed goes on from them)"
        if not context:
            return dict(result, status="fail", error=error, seconds=time.perf_counter() - start)
    workdir = out / "runs" / slug(row.name)
    shutil.rmtree(workdir, ignore_errors=True)
    settings = row.settings(context)
    argv = [*bpt_train(), "--config", row.config, "--workdir", str(workdir), *(f"--config.{s}" for s in settings)]
    result.update(context=context, settings=settings, command=" ".join(["bpt-train", *argv[len(bpt_train()):]]))
    if note:
        result["search"] = note
    if row.processes > 1:
        code, text = run_processes(row, argv, env, on_gpu, timeout)
        result["processes"] = row.processes
    else:
        try:
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            code, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            code, text = None, _said(expired.stdout)[-4000:] + f"\nstill running after {timeout} s: stopped"
    result["seconds"] = time.perf_counter() - start
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / f"{slug(row.name)}.log").write_text(text)
    metrics = read_metrics(workdir / "metrics.jsonl")
    result["losses"] = [m["loss"] for m in metrics]
    result.update(compile_facts(text))
    if metrics:
        last = metrics[-1]
        tokens = last.get("tokens_per_sec")
        result.update(
            tokens_per_sec=tokens,
            tokens_per_sec_per_gpu=tokens / result["gpus"] if tokens else None,
            mfu=last.get("mfu"),
            peak_gib=max((m.get("peak_memory_gib") or 0) for m in metrics) or None,
        )
    complaints = [line.strip() for line in text.splitlines() if any(c in line for c in EXIT_COMPLAINTS)]
    if code == 0 and len(metrics) == row.steps and not complaints:
        result["status"] = "pass"
    elif code == 0 and complaints:
        result.update(status="fail", error=f"exited 0 but said: {complaints[0][:200]}")
    else:
        if code is None:
            said = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
            where = said[-2][:200] if len(said) > 1 else "no output"
            result.update(status="fail", error=f"timeout after {timeout} s; its last output: {where}")
        else:
            result.update(status="fail", error=f"exit {code}: {error_line(text)}")
    shutil.rmtree(workdir, ignore_errors=True)
    return result


# bpt-train's own lines: remat auto's choice (and, where it compiled candidates, how long it
# took), then the loop's train step where it took 10 s or came from the compile cache, or
# the line that says the loop runs the step auto compiled.
REMAT_LINE = re.compile(
    rf"model\.remat_layer=auto: (\S+) \(({'|'.join(map(re.escape, CHOICE_NOTES.values()))})?"
    r"[^\n]*?(?:; chosen in (\d+) s)?\)"
)
STEP_LINE = re.compile(r"train step (compiled|loaded from the compile cache) in (\d+) s")


def compile_facts(text: str) -> dict:
    """From a row's output: remat_layer (auto's choice, with the CHOICE_NOTES key after it
    where auto took the layer stack unrolled or offloaded the saved layer inputs), compile_s
    (the choice's compilations plus the train step's; a step under 10 s counts 0), each part
    (choice_s, step_s) and step_from_cache."""
    facts, remat, step = {}, REMAT_LINE.findall(text), STEP_LINE.findall(text)
    if remat:
        note = {line: key for key, line in CHOICE_NOTES.items()}.get(remat[-1][1])
        facts["remat_layer"] = remat[-1][0] + (f" {note}" if note else "")
    chosen = int(remat[-1][2]) if remat and remat[-1][2] else None
    if chosen is not None or step:
        facts["choice_s"], facts["step_s"] = chosen or 0, int(step[-1][1]) if step else 0
        facts["compile_s"] = facts["choice_s"] + facts["step_s"]
        facts["step_from_cache"] = bool(step) and step[-1][0] != "compiled"
        if STEP_REUSED in text:
            facts["step_reused"] = True
    return facts


def compile_cell(r: dict) -> str:
    """The table's compile seconds: the total, and where remat auto compiled candidates the
    choice's and the step's parts."""
    if "compile_s" not in r:
        return "–"
    cell = f"{r['compile_s']}"
    if r.get("step_reused"):  # the choice's compilations are all there is
        return cell + " (step reused)"
    if r.get("choice_s") and "step_s" in r:
        cell += f" ({r['choice_s']} + {r['step_s']})"
    return cell + (" (step cached)" if r.get("step_from_cache") else "")


def run_processes(row: Row, argv: list[str], env: dict, on_gpu: bool, timeout: int) -> tuple[int | None, str]:
    """argv as row.processes processes of one jax.distributed run on this host (the README's
    multi-host command, --coordinator_address on localhost), process i on GPU i: every GPU
    visible and taken with --local_device_ids, or (row.isolated) hidden by
    CUDA_VISIBLE_DEVICES. The exit status is the first nonzero one; the text, every
    process's output in turn."""
    with socket.socket() as free:
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    children = []
    for i in range(row.processes):
        own = dict(env)
        flags = [f"--coordinator_address=localhost:{port}", f"--num_processes={row.processes}", f"--process_id={i}"]
        if not on_gpu:
            own["JAX_NUM_CPU_DEVICES"] = "1"
        elif row.isolated:
            own["CUDA_VISIBLE_DEVICES"] = gpu_names(row.processes)[i]
        else:
            flags.append(f"--local_device_ids={i}")
        log = tempfile.TemporaryFile("w+")
        children.append((subprocess.Popen([*argv, *flags], cwd=ROOT, env=own, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, codes = time.monotonic() + timeout, []
    for child, _ in children:
        try:
            codes.append(child.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            child.kill()
            codes.append(None)
    texts = []
    for i, (child, log) in enumerate(children):
        child.wait()
        log.seek(0)
        texts.append(f"--- process {i} ---\n{log.read()}")
        log.close()
    text = "\n".join(texts)
    if None in codes:
        return None, text[-4000:] + f"\nstill running after {timeout} s: stopped"
    return next((c for c in codes if c), 0), text


def _said(output) -> str:
    output = output or b""  # bytes, even with text=True
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def row_gpus(row: Row, n: int) -> int:
    return 1 if row.min_gpus == 1 and not row.mesh else n


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def error_line(text: str) -> str:
    """The line that says what went wrong: bpt's one-sentence error, else the last line."""
    for line in reversed(text.splitlines()):
        if "bpt-train: error:" in line or "Error" in line or "error:" in line:
            return line.strip()[:300]
    return last_line(text)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


REFERENCES = {  # group: (the row the others must equal, tolerance, what it is called)
    "losses": ("losses: 1 GPU", LOSS_RTOL, "one GPU"),
    "processes": ("processes: one over all GPUs", PROCESS_RTOL, "one process"),
}


def check_losses(results: list[dict]) -> None:
    """Marks each losses (processes) row that ran but whose losses differ from the one-GPU
    (one-process) row's; a processes row also gets its speed and memory against that row's."""
    for group, (name, rtol, called) in REFERENCES.items():
        reference = next((r for r in results if r["name"] == name and r.get("status") == "pass"), None)
        for r in results:
            if r["group"] != group or r is reference or r.get("status") != "pass" or reference is None:
                continue
            ref, got = reference["losses"], r["losses"]
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if len(got) == len(ref) else float("inf")
            r["loss_rel_diff"] = worst
            if group == "processes" and r.get("tokens_per_sec") and reference.get("tokens_per_sec"):
                speed = r["tokens_per_sec"] / reference["tokens_per_sec"]
                memory = (r.get("peak_gib") or 0) - (reference.get("peak_gib") or 0)
                r["note"] = f"{speed:.2f}x one process's tokens/s, {memory:+.1f} GiB"
            if worst > rtol:
                r.update(status="fail", error=f"losses differ from {called}'s by {worst:.2e} (allowed {rtol:g})")


def table(results: list[dict]) -> str:
    lines = [
        "| row | GPUs | context | tokens/s/GPU | MFU | peak GiB | remat | compile s | losses | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        tokens = r.get("tokens_per_sec_per_gpu")
        losses = ", ".join(f"{x:.4f}" for x in r.get("losses", [])[:3])
        if "loss_rel_diff" in r:
            losses += f" (rel. {r['loss_rel_diff']:.1e})"
        verdict = r["status"] if r["status"] != "fail" else f"fail: {r.get('error', '')[:160]}"
        if r.get("note"):
            verdict += f" ({r['note']})"
        cells = (
            r["name"],
            str(r.get("gpus", "")),
            human_tokens(r["context"]) if r.get("context") else "–",
            f"{tokens:,.0f}" if tokens else "–",
            f"{r['mfu']:.1%}" if r.get("mfu") else "–",
            f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "–",
            r.get("remat_layer", "–"),
            compile_cell(r),
            losses or "–",
            verdict,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r["group"] != "losses" and r.get("status") in ("pass", "fail")]
    if not shown:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(shown) + 1.5), sharey=True)
    names = [f"{r['name']} ({human_tokens(r['context'])})" if r.get("context") else r["name"] for r in shown]
    colors = ["tab:green" if r["status"] == "pass" else "tab:red" for r in shown]
    axes[0].barh(names, [r.get("tokens_per_sec_per_gpu") or 0 for r in shown], color=colors)
    axes[0].set_xlabel("tokens/s per GPU")
    axes[1].barh(names, [r.get("peak_gib") or 0 for r in shown], color=colors)
    axes[1].set_xlabel("peak memory per GPU (GiB)")
    axes[0].invert_yaxis()
    fig.suptitle("bpt-train over every GPU of the host (red: failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, state: dict) -> str:
    results = state["results"]
    check_losses(results)
    text = (
        f"{state['device']}, {state['gpus']} GPUs, jax {state['jax']}, {state['date']}"
        + "".join(f", {s}" for s in state.get("settings", []))
        + f"\n\n{table(results)}\n"
        + f"\n{sum(r['status'] == 'pass' for r in results)} of {len(results)} rows pass"
        + (f"; skipped: {', '.join(r['name'] for r in results if r['status'] == 'skipped')}" if any(r["status"] == "skipped" for r in results) else "")
    )  # fmt: skip
    (out / "results.json").write_text(json.dumps(state, indent=1))
    (out / "report.md").write_text(text + "\n")
    plot(results, out / "check_gpus.png")
    return text


def device_name(on_gpu: bool) -> str:
    if not on_gpu:
        return "CPU (simulated devices)"
    listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return (listed.stdout.strip().splitlines() or ["GPU"])[0]


def jax_version() -> str:
    done = subprocess.run([sys.executable, "-c", "import jax; print(jax.__version__)"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main() -> None:
    p = script_parser(
        __doc__, out="results/check_gpus", out_help="the campaign's folder (resumed if it exists)", settings=True
    )
    p.add_argument("--rows", default="", help="run only rows whose name contains one of these (comma-separated)")
    p.add_argument("--budget_minutes", type=float, default=0.0, help="start no row after this long (0: no limit)")
    p.add_argument("--timeout", type=int, default=900, help="seconds a row may take")
    p.add_argument("--rerun_failed", action="store_true")
    p.add_argument("--report", action="store_true", help="only rebuild the report from results.json")
    p.add_argument("--list", action="store_true", help="list this host's rows and exit")
    p.add_argument("--cpu_devices", type=int, default=4, help="without GPUs: simulated devices (tests)")
    args = p.parse_args()
    n = gpu_count()
    on_gpu = n > 0
    if not on_gpu:
        n = args.cpu_devices
    # --set: settings every row's bpt-train run gets too (train.xla_flags=overlap, ...)
    rows = [dataclasses.replace(row, extra=(*row.extra, *args.set)) for row in rows_for(n, small=not on_gpu)]
    if args.list:
        for row in rows:
            print(f"{row.name}: {row.config} {' '.join(row.settings(row.context or 0))}")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    if state.get("gpus", n) != n:
        p.error(f"{path} holds a campaign over {state['gpus']} devices; this host has {n}: use another --out")
    if state.get("settings", args.set) != args.set:
        p.error(f"{path} holds a campaign with --set {state['settings']}, not {args.set}: use another --out")
    state["settings"] = args.set
    state.update(gpus=n, device=device_name(on_gpu), jax=jax_version(), date=datetime.date.today().isoformat())
    done = {r["name"]: r for r in state.get("results", [])}
    if not args.report:
        wanted = [w for w in args.rows.split(",") if w]
        began = time.perf_counter()
        for row in rows:
            if wanted and not any(w in row.name for w in wanted):
                continue
            previous = done.get(row.name, {}).get("status")
            if previous == "pass" or (previous == "fail" and not args.rerun_failed):
                continue
            if args.budget_minutes and time.perf_counter() - began > 60 * args.budget_minutes:
                print(f"--budget_minutes={args.budget_minutes:g} spent: {row.name} and later rows are left for the next call")
                break
            if n < row.min_gpus:
                done[row.name] = {"name": row.name, "group": row.group, "status": "skipped", "gpus": n}
                continue
            print(f"{row.name} ...", flush=True)
            done[row.name] = run_row(row, n, on_gpu, out, args.timeout, not on_gpu)
            r = done[row.name]
            print(f"  {r['status']} in {r['seconds']:.0f} s {r.get('error', '')}", flush=True)
            state["results"] = [done[x.name] for x in rows if x.name in done]
            write_report(out, state)
    state["results"] = [done[x.name] for x in rows if x.name in done]
    print(write_report(out, state))


if __name__ == "__main__":
    main()
