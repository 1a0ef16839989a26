"""The training loop: data -> model -> jit-ed steps, with a progress bar and metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
from flax.training.train_state import TrainState
from ml_collections import ConfigDict
from tqdm.auto import tqdm

import bpt.rl.data  # noqa: F401  (registers data.name=exorl with make_dataset)
from bpt.config import ADDED_SETTINGS, base_config, check_config, model_config, set_family
from bpt.data.datasets import Prefetcher, make_dataset, put_batch
from bpt.models import make_model
from bpt.models.lm import CausalLM
from bpt.sample import generate
from bpt.train import compile_cache, phases
from bpt.train.checkpoint import Checkpoints, load_params
from bpt.train.metrics import MetricsWriter, peak_flops_per_device, peak_memory_bytes, train_flops_per_token
from bpt.train.optimizer import learning_rate_schedule
from bpt.train.probe import StepMemory, choose_remat, is_out_of_memory, memory_budget
from bpt.train.run_files import (
    METRICS,
    RunFiles,
    check_tokenizer,
    check_workdir,
    describe_changes,
    latest_metrics,
    own_tokenizer_path,
)
from bpt.train.state import create_state, jit_steps, make_parallelism


def evaluate(state: TrainState, batches: list[dict], step_fn, *, perplexity: bool = True) -> dict:
    """eval_loss and eval_accuracy over the batches; eval_perplexity too for a language model
    (perplexity=False: a loss that is no log-likelihood, as AT's squared error)."""
    sums = sum(np.asarray(step_fn(state, b)) for b in batches)
    loss = sums[0] / max(sums[1], 1.0)
    out = {"eval_loss": float(loss), "eval_accuracy": float(sums[2] / max(sums[1], 1.0))}
    if perplexity:
        out["eval_perplexity"] = float(np.exp(loss))
    return out


class Reporter:
    """Turns the metrics of the steps since the last log into one metrics.jsonl line."""

    def __init__(
        self,
        config: ConfigDict,
        workdir: Path,
        eval_host: list[dict],
        bar,
        model: CausalLM,
        eval_fn,
        batch_sharding=None,
        *,
        held: bool = False,
    ):
        """held: keep the rows in memory until writer.release() (bpt.train.run_files)."""
        self.config, self.eval_host, self.bar = config, eval_host, bar
        self.batch_sharding = batch_sharding
        self.eval_data = [put_batch(b, batch_sharding) for b in eval_host]
        self.writer = MetricsWriter(workdir, held=held) if jax.process_index() == 0 else None
        self.schedule = learning_rate_schedule(config.train)
        self.eval_fn = eval_fn
        self.perplexity = model.language_model
        self.model_config = model.config
        self.flops_per_token = train_flops_per_token(model.config, config.data.seq_len)
        self.device = jax.local_devices()[0]
        self.num_devices = 1 if model.parallel is None else model.parallel.mesh.size
        peak = peak_flops_per_device(self.device, config.train.peak_flops)
        self.peak_flops = peak * self.num_devices if peak else None  # the devices the step runs on
        self.tokens_per_step = config.train.batch_size * config.data.seq_len
        self.timer = None  # (time, step) when timing began

    def start_timer(self, step: int) -> None:
        """Throughput is timed from here: before the first step (preflight compiled it) and
        again after each evaluation and checkpoint, which are not training time."""
        self.timer = (time.perf_counter(), step)

    def finite(self, fetched: list[dict], step: int) -> list[dict]:
        """The steps with a finite loss and gradient, of host metrics whose last step is
        `step`; a non-finite one stops the run (unless train.skip_nonfinite) before it is saved."""
        finite = [m for m in fetched if m["finite"]]
        if len(finite) < len(fetched) and not self.config.train.skip_nonfinite:
            index = next(i for i, m in enumerate(fetched) if not m["finite"])
            bad = fetched[index]
            raise FloatingPointError(
                f"step {step - len(fetched) + 1 + index} gave loss {float(bad['loss'])} and gradient "
                f"norm {float(bad['grad_norm'])}; the run stops before saving it. Lower train.learning_rate, check the data, or set "
                "train.skip_nonfinite=True to skip such steps"
            )
        if not finite:
            raise FloatingPointError(
                f"all {len(fetched)} steps up to step {step} had a non-finite loss or gradient "
                "and were skipped: the run is not training; lower train.learning_rate or check the data"
            )
        return finite

    def log(
        self, pending: list[dict], step: int, state: TrainState, *, evaluate_now: bool, stopped: bool = False
    ) -> dict:
        """One row over the pending steps' metrics; stopped: a row between two logged steps
        (a Ctrl-C), which a resumed run replaces by the whole window's."""
        fetched = jax.device_get(pending)  # waits for the steps: only now is the time right
        tokens_per_sec = step_seconds = None
        if self.timer is not None and step > self.timer[1]:
            step_seconds = (time.perf_counter() - self.timer[0]) / (step - self.timer[1])
            tokens_per_sec = self.tokens_per_step / step_seconds
        finite = self.finite(fetched, step)
        loss = float(np.mean([m["loss"] for m in finite]))
        flops_per_token, seen = self.flops_per_token, None
        if "keys_seen" in fetched[0]:  # packed documents: attention over each query's document
            seen = float(np.mean([m["keys_seen"] for m in fetched]))
            seq_len = self.config.data.seq_len
            flops_per_token = train_flops_per_token(self.model_config, seq_len, keys_seen=seen)
        record = {
            "step": step,
            "loss": loss,
            "accuracy": float(np.mean([m["accuracy"] for m in finite])),
            "grad_norm": float(finite[-1]["grad_norm"]),
            "learning_rate": float(self.schedule(step - 1)),
            "tokens_per_sec": tokens_per_sec,
            "step_seconds": step_seconds,
            "flops_per_token": flops_per_token,
        }
        if seen is not None:
            record["keys_seen"] = seen
        if stopped:
            record["stopped"] = True
        if tokens_per_sec and self.peak_flops:
            record["mfu"] = flops_per_token * tokens_per_sec / self.peak_flops
        peak_memory = peak_memory_bytes(self.device)
        if peak_memory is not None:
            record["peak_memory_gib"] = peak_memory / 2**30
        skipped = int(fetched[-1]["skipped_steps"])  # over the whole run: it lives in the optimizer state
        if skipped:
            record["skipped_steps"] = skipped
        eval_every = self.config.train.eval_every
        if self.eval_data and (evaluate_now or (eval_every and step % eval_every == 0)):
            record.update(evaluate(state, self.eval_data, self.eval_fn, perplexity=self.perplexity))
            first = self.config.train.eval_by_position
            if first:
                buckets = position_buckets(self.config.data.seq_len, first)
                rows = evaluate_by_position(state, self.eval_host, self.eval_fn, buckets, self.batch_sharding)
                record["eval_by_position"] = [{k: r[k] for k in ("start", "end", "loss", "tokens")} for r in rows]
        if self.writer is not None:
            self.writer.write(record)
        postfix = {"loss": f"{loss:.3f}"}
        if tokens_per_sec:
            postfix["tok/s"] = f"{tokens_per_sec:.0f}"
        if "mfu" in record:
            postfix["mfu"] = f"{record['mfu']:.1%}"
        if "eval_loss" in record:
            postfix["eval"] = f"{record['eval_loss']:.3f}"
        self.bar.set_postfix(postfix)
        return record

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def say(*args, **kwargs) -> None:
    """print, on process 0 only: a run of several processes speaks once."""
    if jax.process_index() == 0:
        print(*args, **kwargs)


class StopRequest:
    """Turns the first Ctrl-C (SIGINT) into a request to stop after the current step.

    The loop then logs, evaluates and saves a checkpoint before returning; stopping inside a
    step instead would lose that step's state, whose buffers are already handed to the
    device. A second Ctrl-C interrupts at once.
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (Ctrl-C again to abort now)", flush=True)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def setup(config: ConfigDict, *, training: bool = False) -> tuple[object, CausalLM, TrainState]:
    """The run's dataset, model (on the mesh config.mesh describes) and initial train state,
    after checking the config. training: model.remat_layer=auto is chosen on this device
    (choose_remat; the saved config keeps "auto"); evaluation and sampling do not
    rematerialize, so they skip the choice and its compilations. The compilations from here
    on use the run's compile cache (train.compile_cache), for training, evaluation and
    sampling alike."""
    return _setup(config, training=training)[:3]


def _setup(config: ConfigDict, *, training: bool) -> tuple[object, CausalLM, TrainState, tuple | None]:
    """setup's (dataset, model, state), and where remat auto compiled the chosen step, that
    step's (train_step, eval_step, batch_sharding): the model and the state are then that
    TrainingStep's own, so the loop runs the program auto compiled without tracing it again
    (a new trace lowers bpt's Mosaic GPU kernels again, and on jax 0.11 each lowering stamps
    a process-wide counter into a kernel's module, so the compile cache would miss it)."""
    check_config(config)
    compile_cache.use(config.train.get("compile_cache", "auto"))
    parallel = make_parallelism(config)  # a mesh that does not fit the devices fails before the data
    dataset = make_dataset(config.data, config.seed)
    fields = getattr(dataset, "model_fields", {})  # what the data says of the model (AT's shapes)
    rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 0)
    model_settings, chosen = config.model, None
    if training and config.model.remat_layer == "auto":
        phases.enter("choosing model.remat_layer=auto (compiling its candidates' steps)", compile_hint(config))
        resolved, chosen = choose_remat(config, vocab_size=dataset.vocab_size)
        model_settings = resolved.model
    if chosen is not None:
        steps = (chosen.step, chosen.eval_step, chosen.batch_sharding)
        return dataset, chosen.model, chosen.init(rng), steps
    model = make_model(
        model_config(model_settings, vocab_size=dataset.vocab_size, seq_len=config.data.seq_len, **fields),
        parallel,
    )
    return dataset, model, create_state(config, model, rng), None


def shardings_of(state: TrainState):
    """The state's layout, as create_state made it (restored checkpoints keep it)."""
    return jax.tree.map(lambda x: x.sharding, state)


def position_buckets(seq_len: int, first: int = 64) -> list[tuple[int, int]]:
    """[start, end) ranges of window positions that double in length: [0, first),
    [first, 2 first), [2 first, 4 first), ... ending at seq_len."""
    if first <= 0:
        raise ValueError(f"the first position bucket must hold at least one position; got {first}")
    edges, edge = [0], min(first, seq_len)
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    edges.append(seq_len)
    return list(zip(edges[:-1], edges[1:]))


def evaluate_by_position(
    state: TrainState, batches: list[dict], step_fn, buckets: list[tuple[int, int]], sharding=None
) -> list[dict]:
    """Validation loss of the predictions made at each bucket of window positions (position
    t predicts token t + 1 from t + 1 tokens of context): does the model use a long context?
    Each bucket is one masked pass over the batches (host arrays), so memory stays that of
    an ordinary evaluation at any context length."""
    rows = []
    for start, end in buckets:
        sums = 0.0
        for batch in batches:
            keep = np.zeros(batch["loss_mask"].shape[-1], np.float32)
            keep[start:end] = 1.0
            masked = dict(batch, loss_mask=batch["loss_mask"] * keep)
            sums = sums + np.asarray(step_fn(state, put_batch(masked, sharding)))
        loss = float(sums[0] / max(sums[1], 1.0))
        rows.append(
            {"start": start, "end": end, "loss": loss, "perplexity": math.exp(loss), "tokens": int(sums[1])}
        )
    return rows


def evaluate_checkpoint(
    workdir: str | Path, *, eval_batches: int = 0, batch_size: int = 0, first_bucket: int = 0
) -> dict:
    """Validation loss, perplexity and accuracy of a run's latest checkpoint; with
    first_bucket > 0 also the loss by position (position_buckets) under "by_position"."""
    config, dataset, model, state = restore_run(workdir)
    _, eval_fn, batch_sharding = jit_steps(config, model, shardings_of(state))
    eval_batches = eval_batches or config.train.eval_batches
    if not eval_batches:
        raise ValueError("the run has train.eval_batches=0: give eval_batches (bpt-eval --eval_batches N)")
    host_batches = dataset.eval_batches(eval_batches, batch_size or config.train.batch_size)
    batches = [put_batch(b, batch_sharding) for b in host_batches]
    result = {"step": int(state.step), "seq_len": config.data.seq_len,
              **evaluate(state, batches, eval_fn, perplexity=model.language_model)}  # fmt: skip
    if first_bucket:
        buckets = position_buckets(config.data.seq_len, first_bucket)
        result["by_position"] = evaluate_by_position(state, host_batches, eval_fn, buckets, batch_sharding)
    return result


def restore_run(workdir: str | Path, mesh: dict | None = None):
    """(config, dataset, model, state) of a run's latest checkpoint; mesh: settings of
    config.mesh to use instead of the run's (the checkpoint restores onto any mesh)."""
    workdir = Path(workdir)
    config_path = workdir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: --workdir must be a bpt-train run")
    config = base_config()  # today's defaults under the saved settings: older runs still load
    saved = json.loads(config_path.read_text())
    model = saved.setdefault("model", {})
    for name, value in ADDED_SETTINGS.get(model.get("family", "gpt"), {}).items():
        model.setdefault(name, value)  # saved before the setting existed: what the run computed
    config.update(saved)
    # Runs saved before each family had its own settings hold every family's; only the
    # run's own were ever read.
    set_family(config, config.model.family)
    config.data.verify_checksums = False  # training checked them; sizes are still checked
    own = own_tokenizer_path(workdir)
    if own is not None and config.data.name != "prepared":
        # The run's own copy: the one it was trained with, wherever the folder now is.
        config.data.tokenizer = str(own)
    config.mesh.update(mesh or {})
    sizes = [config.mesh[name] for name in ("data", "fsdp", "sequence", "tensor")]
    if -1 not in sizes and math.prod(sizes) != jax.device_count():
        # Saved on another number of devices: the checkpoint restores onto any mesh, so read
        # it data-parallel over the devices at hand.
        say(f"the run's mesh {sizes} does not fit {jax.device_count()} devices; using data parallelism")
        config.mesh.update(data=-1, fsdp=1, sequence=1, tensor=1)
    dataset, model, state = setup(config)
    if config.data.name == "prepared":  # it brings its own tokenizer: the run's must match it
        check_tokenizer(workdir, getattr(dataset, "tokenizer", None), f"the prepared data at {config.data.path}'s tokenizer")
    with Checkpoints(workdir / "checkpoints", read_only=True) as checkpoints:
        restored = checkpoints.restore_latest(state, vocab_size=getattr(model.config, "vocab_size", None))
    if restored is None:
        damaged = "; ".join(f"step {step}: {reason}" for step, reason in checkpoints.damaged)
        raise FileNotFoundError(
            f"no checkpoint in {workdir / 'checkpoints'} loads"
            + (f" (damaged: {damaged})" if damaged else "")
        )
    return config, dataset, model, restored[0]


def preflight(config: ConfigDict, train_step, state: TrainState, batch: dict, rng) -> None:
    """Compiles the train step (the loop's first call then reuses it) and checks that its
    memory fits the device: a step that cannot fit stops here, with both numbers and the
    settings that would make it fit, instead of in an allocator error minutes later."""
    compiled = train_step.lower(state, batch, rng).compile()
    budget = memory_budget()
    if not budget:  # a CPU: the backend sets no limit
        return
    need = StepMemory.of(compiled).peak
    if need > budget:
        raise MemoryError(out_of_memory_message(config, need, budget))


def compile_hint(config: ConfigDict) -> str:
    """What to try when XLA's compiler crashes on a run's step (bpt.train.phases)."""
    m, mesh = config.model, config.mesh
    tries = []
    if mesh.sequence > 1:
        other = "all_gather" if mesh.context_parallel == "ring" else "ring"
        tries.append(f"mesh.context_parallel={other}")
        if mesh.get("context_head_groups", 0) != 1:
            tries.append("mesh.context_head_groups=1")
    if m.attention_impl in ("auto", "pallas", "cudnn"):
        tries.append("model.attention_impl=blockwise")
    if m.remat_layer == "auto":
        tries.append("model.remat_layer=nothing_saveable")
    tries = f"; try {' or '.join(tries)}" if tries else ""
    return (
        "nothing in the workdir was written or changed; this is a crash inside XLA's compiler, not a "
        f"setting out of range{tries}, and please report it with the command"
    )


def out_of_memory_message(
    config: ConfigDict, need: int | None = None, budget: int | None = None, *, step: int | None = None
) -> str:
    """One sentence: what the step needs, what the device has, what would make it fit (step:
    the training step that ran out, after the fit check passed)."""
    m = config.model
    hints = []
    if m.remat_group == 1 and m.scan_layers and m.num_layers % 4 == 0 and not m.offload_layer_inputs:
        hints.append("model.remat_group=4" + (" with model.scan_unroll=1" if m.scan_unroll > 1 else ""))
    if not m.offload_layer_inputs:
        hints.append(
            "model.offload_layer_inputs=True" + (" with model.remat_group=1" if m.remat_group > 1 else "")
        )
    if m.family != "flash" and m.attention_mode != "blockwise_parallel":
        hints.append("model.attention_mode=blockwise_parallel")
    if m.family == "flash" and m.attention == "quadratic":
        hints.append("model.attention=mixed_chunk")
    chunks = ("loss_chunk_size",) if m.family == "flash" else ("q_chunk_size", "kv_chunk_size", "loss_chunk_size")
    if max(m[name] for name in chunks) > 512:
        hints.append("smaller " + " / ".join(f"model.{name}" for name in chunks))
    if config.train.optimizer_state_dtype == "float32":
        hints.append("train.optimizer_state_dtype=bfloat16")
    if config.train.batch_size // config.train.grad_accum_steps > 1:
        hints.append("a larger train.grad_accum_steps")
    hints.append(f"a shorter data.seq_len (now {config.data.seq_len})")
    if jax.device_count() > 1:
        hints.append("more devices over mesh.sequence or mesh.fsdp")
    device = jax.local_devices()[0].device_kind
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    pool = f" (XLA_PYTHON_CLIENT_MEM_FRACTION={fraction})" if fraction else ""
    if need is not None:
        what = f"needs {need / 2**30:.1f} GiB per device but the {device} has {budget / 2**30:.1f} GiB for it{pool}"
    elif step is not None:
        what = f"ran out of memory at step {step} on the {device}{pool}, though its compiled memory fit"
    else:
        what = f"ran out of memory on the {device}{pool}"
    return f"the train step {what}; to fit, try {', '.join(hints)}"


def resume_hint(checkpoints: Checkpoints, saved: int | None = None) -> str:
    """What a run that dies while training keeps (bpt.train.phases)."""
    steps = checkpoints.steps() if saved is None else [saved]
    if not steps:
        return "no checkpoint was saved yet: the same command starts the run again"
    return (
        f"the checkpoint of step {steps[-1]} (or the one before, if that save was cut short) is intact, "
        "and the same command resumes from it"
    )


def train(config: ConfigDict, workdir: str | Path) -> dict:
    """Trains config's model on config's data; returns the last logged metrics.

    A workdir that holds checkpoints is resumed from the latest good one: the run then logs
    what an uninterrupted run would have logged after that step (a run stopped between two
    logged steps keeps the steps it had in its checkpoint, and their row is logged whole
    again), and each setting that differs from the run's config.json is said. Nothing in
    workdir changes until the config, the data, the checkpoint and the step's memory have
    passed their checks and the first new checkpoint is saved (bpt.train.run_files).
    """
    workdir = Path(workdir)
    check_workdir(workdir)
    tc = config.train
    source = config.init.params_from
    if source and not Path(source).expanduser().exists() and not (workdir / "checkpoints").is_dir():
        # before the data is tokenized: a mistyped path should not cost minutes
        raise FileNotFoundError(f"config.init.params_from={source!r} does not exist")
    say("preparing the run: config, data, model ...", flush=True)
    dataset, model, state, chosen_steps = _setup(config, training=True)
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    say(
        f"model: {num_params / 1e6:.2f}M parameters, {model.config.summary}; "
        f"data: {config.data.name}, seq_len={config.data.seq_len}; {mesh_summary(model)}"
    )
    micro_batch = tc.batch_size // tc.grad_accum_steps
    impls = model.resolved_impls(micro_batch, config.data.seq_len, packed=bool(config.data.get("segment_ids")))
    if impls:
        say(f"kernels: {impls}")

    with Checkpoints(
        workdir / "checkpoints", keep=tc.keep_checkpoints, async_save=tc.async_checkpoints
    ) as checkpoints:
        state, window, resumed = _restore(config, workdir, model, state, checkpoints)
        start = int(state.step)
        tokenizer = getattr(dataset, "tokenizer", None)
        if resumed:  # its checkpoints were trained with the run's own copy
            check_tokenizer(workdir, tokenizer, f"data.tokenizer={config.data.tokenizer!r}")
        files = RunFiles(
            workdir, config, start, writer=jax.process_index() == 0, tokenizer=tokenizer, resumed=resumed
        )
        if files.changes and start:
            say(f"resuming with changed settings: {describe_changes(files.changes)}")
        if start >= tc.steps:
            say(
                f"the run in {workdir} is already at step {start} of train.steps={tc.steps}; raise "
                "train.steps to train it further (bpt-eval and bpt-sample read it as it is)"
            )
            return latest_metrics(workdir / METRICS, start, write=False)[0]
        train_step, eval_fn, batch_sharding = chosen_steps or jit_steps(config, model, shardings_of(state))
        compile_first_step(
            config, model, dataset, train_step, state, batch_sharding, start, chosen=chosen_steps is not None
        )
        last, state = _loop(
            config, workdir, dataset, model, state, checkpoints, files, (train_step, eval_fn, batch_sharding), window
        )
    if last:
        _finish(config, workdir, dataset, model, state, last)
    return last


def mesh_summary(model: CausalLM) -> str:
    """The devices a run uses, in a few words ("mesh: data 2 x sequence 2", "one device")."""
    if model.parallel is None:
        return f"one device ({jax.devices()[0].device_kind})"
    mesh = model.parallel.mesh
    sizes = " x ".join(f"{name} {mesh.shape[name]}" for name in mesh.axis_names if mesh.shape[name] > 1)
    return f"mesh: {sizes} ({mesh.size} {jax.devices()[0].device_kind})"


def _restore(config: ConfigDict, workdir: Path, model, state: TrainState, checkpoints: Checkpoints):
    """(state, the logged window it was stopped in, whether a checkpoint was restored): the
    latest checkpoint's, or state with init.params_from's parameters, or state as it is."""
    vocab_size = getattr(model.config, "vocab_size", None)  # another padding of it restores
    restored = checkpoints.restore_latest(state, vocab_size=vocab_size)
    if restored is not None:
        state, meta = restored
        say(f"resuming from the checkpoint at step {int(state.step)}")
        return state, meta.get("log_window", []), True
    if checkpoints.damaged:
        say(f"no checkpoint of {workdir} loads: the run starts again from step 0")
    if config.init.params_from:
        params = load_params(
            config.init.params_from,
            state.params,
            extend_positions=config.init.extend_positions,
            vocab_size=vocab_size,
        )
        state = state.replace(params=params)
        say(f"parameters loaded from {config.init.params_from}")
    return state, [], False


# What bpt-train says when its loop runs the step remat auto compiled (scripts/check_gpus.py reads it).
STEP_REUSED = "train step: the one remat auto compiled (not compiled again)"


def compile_first_step(
    config, model, dataset, train_step, state, batch_sharding, start: int, *, chosen: bool = False
) -> None:
    """Compiles the train step (the loop's first call reuses it) and checks that it fits the
    device; a failure names the setting to change. chosen: train_step is the one remat auto
    compiled (bpt.train.probe.choose_remat), which then needs no compilation."""
    say("compiling the train step ...", flush=True)
    phases.enter("compiling the train step", compile_hint(config))
    first = put_batch(dataset.train_batch(start, config.train.batch_size), batch_sharding)
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(config.seed), 1), start)
    started, hits, compiles = time.perf_counter(), compile_cache.hits(), compile_cache.compiles()
    try:
        preflight(config, train_step, state, first, rng)
    except Exception as error:
        if is_out_of_memory(error):
            raise MemoryError(out_of_memory_message(config)) from error
        if "cudnn" in str(error).lower() and "model.attention_impl" not in str(error):
            line = (str(error).strip().splitlines() or [""])[0][:200]
            impl = model.config.attention_impl
            chose = "model.attention_impl=auto chose cuDNN" if impl == "auto" else f"model.attention_impl={impl!r}"
            raise ValueError(
                f"cuDNN failed to compile this run's attention ({line}; {chose}): set "
                "model.attention_impl=pallas or blockwise"
            ) from error
        raise
    took, loaded = time.perf_counter() - started, compile_cache.hits() > hits
    if chosen and compile_cache.compiles() == compiles and not loaded:
        say(STEP_REUSED, flush=True)
    elif took >= 10 or loaded:
        say(f"train step {'loaded from the compile cache' if loaded else 'compiled'} in {took:.0f} s", flush=True)


def _commit(files: RunFiles, reporter: Reporter, checkpoints: Checkpoints | None) -> None:
    """The run's first checkpoint is saved (or it ends without one): its config.json, history
    and metrics go to the folder now (bpt.train.run_files)."""
    if files.committed:
        return
    if checkpoints is not None:
        checkpoints.wait()  # config.json describes a checkpoint on disk, not one in flight
    dropped = files.commit()
    if dropped:
        say(f"\nmetrics.jsonl: {dropped} rows past step {files.start} removed (they are logged again)")
    if reporter.writer is not None:
        reporter.writer.release()


def _loop(config, workdir, dataset, model, state, checkpoints, files: RunFiles, steps, window: list) -> tuple:
    """The training loop from state's step to train.steps (or a Ctrl-C): (last logged
    metrics, state)."""
    tc = config.train
    train_step, eval_fn, batch_sharding = steps
    start = int(state.step)
    step_rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
    meta = {"config": json.loads(config.to_json_best_effort()), "seed": config.seed}
    batches, bar, reporter = _start_loop(config, workdir, dataset, model, checkpoints, files, steps, start)
    # The steps logged since the last row: a run stopped between two rows saved them.
    pending, last, done, running = list(window), {}, start, start + 1
    with StopRequest() as stop:
        try:
            for step, batch in batches:
                running = step + 1  # (1-based, as the bar and the rows count)
                state, metrics = train_step(state, batch, jax.random.fold_in(step_rng, step))
                if pending:
                    # One step in flight at most: the bar and a Ctrl-C see the step the
                    # device is on, not one the host queued far ahead of it.
                    jax.block_until_ready(pending[-1])
                pending.append(metrics)
                done = step + 1
                bar.update(1)
                stopping = stop.requested  # read once: a signal may arrive at any moment
                final = done == tc.steps or stopping
                save_now = tc.checkpoint_every > 0 and (final or done % tc.checkpoint_every == 0)
                log_now = final or done % tc.log_every == 0
                if save_now or log_now:
                    # The steps since the last row, which a resumed run logs with the rest of
                    # their window: where a save or a stop falls between two rows.
                    between = done % tc.log_every != 0 and done != tc.steps
                    held = [_host_metrics(m) for m in pending] if between else []
                    if log_now:  # (checks the loss for NaN, as a save needs)
                        rows = held if between else pending  # (between: fetched already)
                        last = reporter.log(rows, done, state, evaluate_now=final, stopped=between)
                        pending = []
                    else:  # a save between two rows: the window goes on after it
                        reporter.finite(held, done)
                        pending = list(held)  # (held itself goes into the save, written later)
                    if save_now:
                        checkpoints.save(state, {**meta, "data_step": done, "log_window": held})
                        _commit(files, reporter, checkpoints)
                        phases.enter("training", resume_hint(checkpoints, done))
                    reporter.start_timer(done)  # evaluation and saving are not training time
                if stopping:
                    saved = "its checkpoint is saved" if tc.checkpoint_every else "train.checkpoint_every=0: no checkpoint"
                    say(f"\nstopped after step {done}; {saved}")
                    break
            _commit(files, reporter, None)  # a run without checkpoints: once it ends
        except Exception as error:  # a step's error surfaces where its results are read
            if is_out_of_memory(error):
                raise MemoryError(out_of_memory_message(config, step=running)) from error
            raise
        finally:
            batches.close()
            bar.close()
            reporter.close()
    return last, state


def _start_loop(config, workdir, dataset, model, checkpoints, files: RunFiles, steps, start: int) -> tuple:
    """(the batches from step `start` on, fetched ahead; the progress bar; the Reporter),
    with the run's files committed where nothing of it can be lost yet."""
    tc = config.train
    _, eval_fn, batch_sharding = steps
    batches = iter(
        Prefetcher(
            lambda s: dataset.train_batch(s, tc.batch_size),
            range(start, tc.steps),
            depth=config.data.prefetch,
            sharding=batch_sharding,
        )
    )
    bar = tqdm(  # counted by hand: a Ctrl-C leaves the loop with the bar on the last step
        desc="train",
        unit="step",
        dynamic_ncols=True,
        initial=start,
        total=tc.steps,
        disable=jax.process_index() != 0,
    )
    eval_host = dataset.eval_batches(tc.eval_batches, tc.batch_size)
    reporter = Reporter(config, workdir, eval_host, bar, model, eval_fn, batch_sharding, held=True)
    if files.new:
        _commit(files, reporter, None)  # nothing to lose: its metrics are followed from the start
    elif tc.checkpoint_every:
        first = min(tc.steps, (start // tc.checkpoint_every + 1) * tc.checkpoint_every)
        say(f"metrics.jsonl and config.json are updated at the first new checkpoint (step {first})")
    reporter.start_timer(start)  # preflight compiled the step: even a one-step run is timed
    phases.enter("training", resume_hint(checkpoints))
    return batches, bar, reporter


def _host_metrics(metrics: dict) -> dict:
    """A step's metrics as plain numbers, for a checkpoint's JSON record."""
    keys = ("loss", "accuracy", "grad_norm", "finite", "skipped_steps")
    return {k: np.asarray(jax.device_get(metrics[k])).item() for k in keys}


def _finish(config: ConfigDict, workdir: Path, dataset, model, state: TrainState, last: dict) -> None:
    """The closing summary, and a sample from the trained model."""
    tc = config.train
    summary = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if isinstance(v, float))
    say(f"step {last['step']}: {summary}")
    say(f"metrics: {workdir / METRICS}; checkpoints: {workdir / 'checkpoints'}")
    tokenizer = getattr(dataset, "tokenizer", None)
    if tc.sample_tokens and tokenizer is not None:
        new = generate(
            model,
            state.params,
            tokenizer.encode(tc.sample_prompt),
            num_tokens=tc.sample_tokens,
            max_len=config.data.seq_len,
            rng=jax.random.fold_in(jax.random.PRNGKey(config.seed), 2),
            temperature=tc.sample_temperature,
            top_k=tc.sample_top_k,
            top_p=tc.sample_top_p,
        )
        text = tc.sample_prompt + tokenizer.decode(new)
        if jax.process_index() == 0:
            (workdir / "sample.txt").write_text(text)
        say(f"--- sample ---\n{text}\n--------------")
