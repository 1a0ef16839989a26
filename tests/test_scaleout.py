"""Scale-out campaigns (scripts/bench_scaleout.py, scripts/check_gpus.py: cells, rows,
resumption, reports) and how a run of several processes ends."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO, load_script


@pytest.fixture
def scaleout():
    return load_script("bench_scaleout")


def write_cell(out, part, n, results):
    path = out / part / f"{n}gpu"
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps(results))


def test_the_gpus_a_campaign_uses_follow_cuda_visible_devices(scaleout, monkeypatch):
    """A campaign confined to some GPUs (CUDA_VISIBLE_DEVICES) counts and hands out only
    those, by their CUDA names; without it, every GPU nvidia-smi lists."""
    monkeypatch.setattr(scaleout.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    listing = SimpleNamespace(returncode=0, stdout="GPU 0: H200 (UUID: a)\nGPU 1: H200 (UUID: b)\nGPU 2: H200 (UUID: c)\n")
    monkeypatch.setattr(scaleout.subprocess, "run", lambda *a, **k: listing)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert scaleout.visible_gpus() == ["0", "1", "2"] and scaleout.gpu_count() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    assert scaleout.visible_gpus() == ["2", "1"] and scaleout.gpu_count() == 2
    assert scaleout.device_env(1, True)["CUDA_VISIBLE_DEVICES"] == "2" and scaleout.gpu_names(2) == ["2", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert scaleout.gpu_count() == 0


def test_context_cells_start_near_n_times_one_gpu_in_zigzag_units(scaleout, tmp_path):
    args = SimpleNamespace(
        configs="configs/gpt_1b.py", modes="blockwise_parallel", chunk=1024, context_stop=1 << 24,
        context_start=65536, context_set=["mesh.context_parallel=all_gather"], memory_gib=0.0,
        verify=False, verify_max=0, context_refine=32, context_jobs=2, context_together=False,
    )  # fmt: skip
    one = scaleout.cell_command(args, "context", 1, tmp_path, {})
    assert "--set=mesh.data=1" in one and not any("mesh.sequence" in a for a in one)
    assert "--start=65536" in one and "--granule=1024" in one and "--refine=32" in one and "--jobs=2" in one
    four = scaleout.cell_command(
        args, "context", 4, tmp_path, {("configs/gpt_1b.py", "blockwise_parallel"): 786432}
    )
    assert "--set=mesh.sequence=4" in four and "--set=mesh.context_parallel=all_gather" in four
    # half of 4 x 768K, a multiple of 2 x 4 x 1024
    assert "--start=1572864" in four and "--granule=8192" in four
    env = scaleout.device_env(4, on_gpu=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and "autotune" not in env.get("XLA_FLAGS", "")
    assert scaleout.device_env(2, on_gpu=False)["JAX_NUM_CPU_DEVICES"] == "2"
    assert "--xla_gpu_autotune_level=0" in scaleout.device_env(4, True, autotune=False)["XLA_FLAGS"]
    args.context_together = True  # all GPU counts at once: each from N x the start
    four = scaleout.cell_command(args, "context", 4, tmp_path, {})
    assert "--start=262144" in four


def test_report_tables_and_targets_from_the_cells(scaleout, tmp_path):
    summary = dict(config="configs/gpt_1b.py", mode="blockwise_parallel", summary=True)
    write_cell(tmp_path, "context", 1, {"records": [dict(summary, longest=786432)]})
    write_cell(tmp_path, "context", 4, {"records": [dict(summary, longest=2768896)]})
    train = dict(tokens_per_device=16384, ok=True, mfu=0.4)
    write_cell(
        tmp_path,
        "throughput",
        1,
        {"train": [dict(train, setup="1 GPU", seq_len=16384, tokens_per_second_per_gpu=1000.0)]},
    )
    write_cell(tmp_path, "throughput", 4, {"train": [
        dict(train, setup="data", seq_len=16384, tokens_per_second_per_gpu=933.0),
        dict(train, setup="sequence (ring)", seq_len=65536, tokens_per_second_per_gpu=300.0),
    ]})  # fmt: skip
    times = {"local shard": 1e-4, "tree": 2e-4, "ring": 2e-3}
    write_cell(
        tmp_path,
        "decode",
        4,
        {"tree": [dict(context=262144, heads="16/16", times=times, ring_over_tree=10.0)]},
    )
    (tmp_path / "decode" / "8gpu").mkdir()
    (tmp_path / "decode" / "8gpu" / "failed.json").write_text("{}")
    text = scaleout.report(tmp_path)
    assert "| gpt_1b | blockwise_parallel | 768K | 2704K (3.52x, 0.88 N) |" in text
    assert "| 16K | data | 4 | 16K | 933 | 40.0% | 0.933 |" in text
    assert "| 256K | 16/16 | 4 | 100 | 200 | 2,000 | 10.00 |" in text
    assert "- Context gpt_1b blockwise_parallel on 4 GPUs: 0.88 x N x one GPU's (short of >= 0.9)" in text
    assert "- Data-parallel efficiency on 4 GPUs at 16K tokens per GPU: 0.933 (met >= 0.9)" in text
    assert "- Tree against ring decoding on 4 GPUs: ring / tree >= 10.00 at every context (met > 1)" in text
    assert "Failed cells: decode/8gpu" in text
    assert (tmp_path / "report.md").read_text() == text
    assert all((tmp_path / f"{p}.png").exists() for p in ("context", "throughput", "decode"))


def test_a_campaign_runs_its_cells_once_and_resumes(tmp_path):
    """Real cells on simulated CPU devices: Tree against ring decoding on 2, and sampling
    through bpt.sample on 1 and 2 (the cache split along its slots); run again, the campaign
    finds them done."""
    command = [sys.executable, str(REPO / "scripts" / "bench_scaleout.py"), f"--out={tmp_path}"]
    command += ["--parts=decode,sample", "--gpus=1,2,16", "--cpu_devices=2"]
    command += ["--decode_contexts=2048", "--decode_heads=16/16", "--decode_repeats=1"]
    command += [
        "--sample_config=configs/tiny.py",
        "--sample_contexts=1024",
        "--new_tokens=8",
        "--prefill_chunk=256",
    ]
    first = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "cells on [1, 2] (skipped [16])" in first.stdout and "decode on 2: ran in" in first.stdout
    assert "| 2K | 16/16 | 2 |" in first.stdout and "| 1K | 2 |" in first.stdout
    rows = json.loads((tmp_path / "decode" / "2gpu" / "results.json").read_text())["tree"]
    assert rows[0]["devices"] == 2 and rows[0]["ring_over_tree"] > 0
    for n in (1, 2):
        (sample,) = json.loads((tmp_path / "sample" / f"{n}gpu" / "results.json").read_text())["sample"]
        assert "error" not in sample and sample["cache_devices"] == n
        assert sample["cache_shard_shape"][2] == 1024 // n  # [layers, batch, slots, heads, head_dim]
    second = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert "decode on 2: done before" in second.stdout, second.stdout + second.stderr
    assert "sample on 1: done before" in second.stdout


def test_context_cells_together_on_cpu_devices(tmp_path):
    """--context_together: the searches on 1 and 2 simulated devices run at once (tiny model,
    a 1 GiB budget, lengths 512 to 1024), and the report compares them."""
    command = [sys.executable, str(REPO / "scripts" / "bench_scaleout.py"), f"--out={tmp_path}"]
    command += ["--parts=context", "--gpus=1,2", "--cpu_devices=2", "--context_together"]
    command += ["--configs=configs/tiny.py", "--modes=blockwise_parallel", "--chunk=64", "--memory_gib=1"]
    command += ["--context_start=512", "--context_stop=1024"]
    run = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "context on 1, 2 devices at once" in run.stdout
    for n in (1, 2):
        records = json.loads((tmp_path / "context" / f"{n}gpu" / "results.json").read_text())["records"]
        (summary,) = [r for r in records if r.get("summary")]
        assert summary["longest"] == 1024, records  # the tiny model fits the whole range
        assert min(r["seq_len"] for r in records if "seq_len" in r) == 512 * n
    assert "| tiny | blockwise_parallel | 1K | 1K (1.00x, 0.50 N) |" in run.stdout


def test_scaling_table_compares_sequence_setups_with_one_gpu_at_their_context(tmp_path):
    """bench_scaling's train table: each setup against one GPU at its tokens per GPU, and the
    sequence setups also against one GPU at their whole context, from two runs' JSON merged."""

    def row(setup, tokens, seq_len, devices, rate):
        return dict(setup=setup, tokens_per_device=tokens, seq_len=seq_len, devices=devices, ok=True,
                    tokens_per_second=rate * devices, tokens_per_second_per_gpu=rate, mfu=0.3, peak_gib=50.0)  # fmt: skip

    runs = {
        "four.json": [
            row("1 GPU", 65536, 65536, 1, 16000.0),
            row("sequence (ring)", 65536, 262144, 4, 3000.0),
        ],
        "one.json": [row("1 GPU", 262144, 262144, 1, 4000.0)],
    }
    for name, rows in runs.items():
        (tmp_path / name).write_text(json.dumps({"meta": {"name": name}, "ring": [], "train": rows}))
    proc = subprocess.run(
        [sys.executable, "scripts/bench_scaling.py", "--out", str(tmp_path / "merged"),
         "--from_json", f"{tmp_path / 'four.json'},{tmp_path / 'one.json'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split("|")[2].strip() + " " + line.split("|")[1].strip(): line for line in proc.stdout.splitlines()
             if line.startswith("| ") and "GPU" not in line.split("|")[1]}  # fmt: skip
    ring = [c.strip() for c in lines["sequence (ring) 64K"].split("|")]
    assert ring[7:9] == ["0.188", "0.750"]  # 3000 / 16000 and 3000 / 4000
    assert [c.strip() for c in lines["1 GPU 256K"].split("|")][7:9] == ["1.000", "–"]
    assert (tmp_path / "merged" / "scaling.png").is_file()
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert len(merged["train"]) == 3 and [m["name"] for m in merged["meta"]["runs"]] == [
        "four.json",
        "one.json",
    ]


def test_check_gpus_runs_bpt_train_on_each_mesh_with_one_devices_losses(tmp_path):
    """scripts/check_gpus.py on two simulated devices: real bpt-train runs, the one-device
    reference, tensor parallelism (the copy task's odd vocabulary, padded) and fsdp with bpt's
    LayerNorm kernels, their losses compared; --set reaches every run and the report; a second call resumes (runs nothing) and
    the report is rebuilt, one with other settings is refused; a losses row that differs fails."""
    out = tmp_path / "check"
    script = [sys.executable, str(REPO / "scripts" / "check_gpus.py"), "--out", str(out), "--cpu_devices", "2"]
    argv = [*script, "--set", "train.xla_flags=overlap"]
    rows = "losses: 1 GPU,losses: tensor,losses: norm kernels"
    done = subprocess.run([*argv, "--rows", rows], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in state["results"]}
    assert rows["losses: 1 GPU"]["status"] == "pass" and rows["losses: 1 GPU"]["gpus"] == 1
    # bpt's LayerNorm kernels (interpreted here) on each device's rows under fsdp: the same losses
    assert rows["losses: norm kernels"]["status"] == "pass", rows["losses: norm kernels"]
    assert rows["losses: norm kernels"]["command"].endswith("--config.model.norm_impl=pallas --config.train.xla_flags=overlap")
    assert rows["losses: tensor"]["status"] == "pass" and rows["losses: tensor"]["gpus"] == 2
    assert rows["losses: tensor"]["loss_rel_diff"] <= 1e-4 and len(rows["losses: tensor"]["losses"]) == 4
    assert "| losses: tensor | 2 | 256 |" in done.stdout and "pass |" in done.stdout
    assert rows["losses: tensor"]["command"].startswith("bpt-train --config configs/tiny.py")
    assert rows["losses: tensor"]["command"].endswith("--config.train.xla_flags=overlap")
    assert "jax " in done.stdout and ", train.xla_flags=overlap\n" in done.stdout

    again = subprocess.run([*argv, "--rows", "losses: tensor"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "losses: tensor ..." not in again.stdout  # done rows are kept
    other = subprocess.run([*script, "--rows", "losses: tensor"], capture_output=True, text=True, timeout=300)
    assert other.returncode != 0 and "use another --out" in other.stderr

    check = load_script("check_gpus")
    state["results"][1]["losses"][2] *= 1.01
    state["results"][1]["status"] = "pass"
    check.check_losses(state["results"])
    assert state["results"][1]["status"] == "fail" and "losses differ from one GPU's" in state["results"][1]["error"]


def test_check_gpus_reads_how_long_a_run_compiled():
    """A row's compile time from bpt-train's lines: remat auto's choice plus the train step,
    and whether the step came from the compile cache."""
    check = load_script("check_gpus")
    probe = "model.remat_layer=auto: attention_saveable (step memory: x 9.0 GiB; the device has 8.0 GiB; chosen in 212 s)"
    assert check.compile_facts(f"{probe}\ncompiling the train step ...\ntrain step compiled in 95 s\n") == {
        "remat_layer": "attention_saveable",
        "choice_s": 212,
        "step_s": 95,
        "compile_s": 307,
        "step_from_cache": False,
    }
    cached = check.compile_facts(f"{probe}\ntrain step loaded from the compile cache in 3 s")
    assert cached == {
        "remat_layer": "attention_saveable",
        "choice_s": 212,
        "step_s": 3,
        "compile_s": 215,
        "step_from_cache": True,
    }
    assert check.compile_facts("train step compiled in 12 s") == {
        "choice_s": 0,
        "step_s": 12,
        "compile_s": 12,
        "step_from_cache": False,
    }
    assert check.compile_facts("step 1: loss=3.0") == {}
    cpu = "model.remat_layer=auto: nothing_saveable (the device reports no memory limit)"
    assert check.compile_facts(cpu) == {"remat_layer": "nothing_saveable"}
    unrolled = (
        "model.remat_layer=auto: attention_and_dots_saveable (the layer stack unrolled; step memory: "
        "attention_and_dots_saveable 45.2 GiB, unrolled 47.5 GiB; the device has 132.8 GiB; chosen in 120 s)"
    )
    assert check.compile_facts(unrolled)["remat_layer"] == "attention_and_dots_saveable unrolled"
    assert check.compile_facts(unrolled)["choice_s"] == 120
    offloaded = (  # GPT-7B's line on an H200, as bpt-train printed it
        "model.remat_layer=auto: attention_saveable (the saved layer inputs offloaded to the host; step memory: "
        "attention_and_dots_saveable 201.8 GiB, attention_saveable 136.8 GiB, attention_saveable offloaded 129.5 GiB; "
        "the device has 132.8 GiB; chosen in 25 s)"
    )
    assert check.compile_facts(offloaded)["remat_layer"] == "attention_saveable offloaded"
    assert check.compile_facts(offloaded)["choice_s"] == 25
    assert "| 215 (212 + 3) (step cached) |" in check.table([dict(cached, name="r", status="pass")])
    reused = check.compile_facts(f"{unrolled}\ncompiling the train step ...\n{check.STEP_REUSED}\nstep 1: loss=3.0")
    assert reused == {
        "remat_layer": "attention_and_dots_saveable unrolled",
        "choice_s": 120,
        "step_s": 0,
        "compile_s": 120,
        "step_from_cache": False,
        "step_reused": True,
    }
    assert "| 120 (step reused) |" in check.table([dict(reused, name="r", status="pass")])
    row = {"name": "r", "status": "pass", "compile_s": 215, "step_from_cache": True}  # an older results.json
    assert "| 215 (step cached) |" in check.table([row])


def test_a_stopped_length_search_goes_on_from_its_compiles(tmp_path):
    """bench_max_context --known: lengths an earlier search compiled (its printed JSON lines)
    are not compiled again and are judged against this search's budget; check_gpus keeps a
    search's compiles (also a stopped one's: the lines it printed) for the next call."""
    argv = [sys.executable, str(REPO / "scripts" / "bench_max_context.py"), "--configs=configs/tiny.py",
            "--modes=blockwise_parallel", "--chunks=64", "--start=512", "--stop=2048", "--refine=2"]  # fmt: skip

    def search(*more):
        done = subprocess.run([*argv, *more], capture_output=True, text=True, cwd=REPO, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        return done.stdout, [r for r in records if "seq_len" in r and "fits" in r]

    said, first = search("--memory_gib=1")
    assert [r["seq_len"] for r in first] == [512, 1024, 2048] and all(r["fits"] for r in first)
    check = load_script("check_gpus")
    kept = tmp_path / "compiles.jsonl"
    assert check.keep_compiles(kept, "bpt: starting\n" + said[: said.index(json.dumps(first[1]))]) == 1  # stopped
    assert check.keep_compiles(kept, said) == 3  # the two the stopped search did not finish added
    _, again = search("--memory_gib=1", f"--known={kept}")
    assert [r["seq_len"] for r in again] == [512, 1024, 2048] and all(r["known"] and r["fits"] for r in again)
    assert check.keep_compiles(kept, "\n".join(json.dumps(r) for r in again)) == 3  # nothing new
    # a smaller budget: 1024 tokens no longer fit, judged from the kept compile; 768 is compiled
    budget = (first[0]["compiled_gib"] + first[1]["compiled_gib"]) / 2
    _, lower = search(f"--memory_gib={budget}", f"--known={kept}")
    assert [(r["seq_len"], r["fits"], bool(r.get("known"))) for r in lower] == [
        (512, True, True), (1024, False, True), (768, lower[2]["fits"], False)
    ]  # fmt: skip


def test_check_gpus_runs_a_process_a_device_with_one_process_losses(tmp_path):
    """The multi-host command on one host (scripts/check_gpus.py's processes rows): two
    bpt-train processes joined by jax.distributed on localhost, one simulated device each,
    log one process's losses over both devices, and both exit 0 with nothing of the
    coordination service's errors in their logs (what GPUs showed while bpt-train left
    through jax.distributed.shutdown instead of distributed.leave; CPU processes did not
    show it either way)."""
    out = tmp_path / "check"
    argv = [sys.executable, str(REPO / "scripts" / "check_gpus.py"), "--out", str(out), "--cpu_devices", "2"]
    done = subprocess.run([*argv, "--rows", "processes"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert set(rows) == {"processes: one over all GPUs", "processes: one a GPU"}
    split = rows["processes: one a GPU"]
    assert split["status"] == "pass" and split["processes"] == 2 and len(split["losses"]) == 6, split
    assert split["loss_rel_diff"] <= 1e-5 and "one process's tokens/s" in split["note"]
    log = (out / "logs" / "processes__one_a_GPU.log").read_text()
    assert log.count("bpt-train: starting") == 2 and "--- process 1 ---" in log
    check = load_script("check_gpus")
    assert not any(c in log for c in check.EXIT_COMPLAINTS)


def test_every_way_of_ending_a_run_of_several_processes_exits_zero():
    """scripts/repro_exit_warning.py on two CPU processes: jax.distributed.shutdown and
    bpt.parallel.distributed.leave both end every process with status 0 after an all-reduce
    over their devices gave the right sum (what the warnings were is a GPU matter)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "repro_exit_warning.py"), "--cpu", "--ways", "shutdown,leave", "--verbose"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| shutdown | [0, 0] |" in done.stdout and "| leave | [0, 0] |" in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("sum 3.0") == 4, done.stdout[-3000:]  # 1 + 2 in each process, each way


LEAVE_ALONE = """
import os, sys, time
index, port = int(sys.argv[1]), sys.argv[2]
import jax
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=index)
if index == 1:  # never comes to the barrier
    time.sleep(5)
    os._exit(0)
from bpt.parallel.distributed import leave
start = time.time()
try:
    leave(timeout_s=1)
except Exception as error:
    print(f"raised after {time.time() - start:.1f} s: {error}", flush=True)
    os._exit(3)
"""


def test_leaving_alone_is_an_error_after_the_timeout_not_a_hang(tmp_path):
    """bpt.parallel.distributed.leave meets the other processes at the coordination service's
    barrier: a process that never comes makes it an error after timeout_s."""
    import socket

    script = tmp_path / "leave_alone.py"
    script.write_text(LEAVE_ALONE)
    with socket.socket() as free:
        free.bind(("localhost", 0))
        port = str(free.getsockname()[1])
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    other = subprocess.Popen([sys.executable, str(script), "1", port], env=env)
    done = subprocess.run([sys.executable, str(script), "0", port], env=env, capture_output=True, text=True, timeout=120)
    other.wait(timeout=60)
    assert done.returncode == 3 and "raised after" in done.stdout and "Barrier timed out" in done.stdout, (
        done.stdout[-2000:] + done.stderr[-2000:]
    )
