"""What every bpt command shares: its flags in --help, one-sentence errors, device memory.

A command is a module with `define_flags()` (returning its flag holders) and
`main(flags, argv)`; its console script calls `run_command(module)`. Every failure (a bad
setting, a missing file, a model that does not fit the device) ends the command with one
sentence on stderr and exit status 1; `--debug` (or BPT_DEBUG=1) shows the traceback
instead.

A command that compiles a model (its module sets SUPERVISED = True: bpt-train, bpt-eval,
bpt-sample) runs its work in a child process that this one watches (supervise): a crash that
no Python error reports (a segmentation fault or failed check inside XLA, the host's
out-of-memory killer) still ends in one sentence that says what the run was doing and what to
try (bpt.train.phases). BPT_NO_SUPERVISOR=1 runs the work in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from types import ModuleType

from absl import app, flags, logging

DEBUG_ENV = "BPT_DEBUG"
CHILD_ENV = "BPT_SUPERVISED"  # set in the child a supervising process starts
NO_SUPERVISOR_ENV = "BPT_NO_SUPERVISOR"
# Signals a supervising process passes on to its child (which stops as it would alone).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
CRASHES = {
    signal.SIGSEGV: "a segmentation fault",
    signal.SIGABRT: "an abort (a failed check inside XLA or CUDA; its message is above)",
    signal.SIGBUS: "a bus error",
    signal.SIGILL: "an illegal instruction",
    signal.SIGFPE: "a floating-point exception",
    signal.SIGKILL: "SIGKILL (the host's out-of-memory killer, or kill -9)",
}
MEMORY_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
HELP_FLAGS = {"--help", "-help", "-h", "--helpshort", "--helpfull", "-?"}


def _debug() -> bool:
    return "--debug" in sys.argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _one_sentence(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    if isinstance(error, KeyError) and text.startswith(("'", '"')):
        text = text[1:-1]  # KeyError quotes its message
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines)


def run_command(module: ModuleType) -> None:
    """Defines module's flags (listed by --help), parses them and runs module.main; a
    failure prints `<command>: error: <message>` and exits with status 1."""
    name = getattr(module.__spec__, "name", None) or module.__name__  # __main__ under python -m
    command = "bpt-" + name.rsplit(".", 1)[-1].replace("_", "-")  # as its console script
    if _debug():
        os.environ[DEBUG_ENV] = "1"  # the library's own quieting (bpt.train.checkpoint) stands down too
    if _supervises(module):
        sys.exit(supervise([sys.executable, "-m", name, *sys.argv[1:]], command))
    try:
        main_module = sys.modules.get("__main__")
        if main_module is not None and main_module is not module:
            main_module.__doc__ = module.__doc__  # the usage text --help prints
        holders = module.define_flags()
        _define_debug_flag()
        _make_key_flags(module)
        app.run(lambda argv: _main(module, holders, argv))
    except SystemExit as exit:
        if exit.code == 1 and HELP_FLAGS & set(sys.argv[1:]):
            sys.exit(0)  # absl ends --help with status 1: asking for help is no failure
        raise
    except KeyboardInterrupt:
        if _debug():
            raise
        # (a Ctrl-C while compiling, or a second one while training: a run's folder changes only
        # at a checkpoint, so it keeps its last one)
        print(f"\n{command}: interrupted (Ctrl-C); nothing after the last checkpoint was kept", file=sys.stderr)
        sys.exit(130)
    except Exception as error:  # noqa: BLE001  (every failure becomes one sentence)
        if _debug():
            raise
        message = _one_sentence(error)
        if not isinstance(error, (ValueError, FileNotFoundError, FileExistsError, MemoryError)):
            message = f"{type(error).__name__}: {message}"
        print(f"{command}: error: {message}", file=sys.stderr)
        print(f"({command} --debug, or {DEBUG_ENV}=1, shows the traceback)", file=sys.stderr)
        sys.exit(1)


def _supervises(module: ModuleType) -> bool:
    return (
        getattr(module, "SUPERVISED", False)
        and os.environ.get(CHILD_ENV) != "1"
        and os.environ.get(NO_SUPERVISOR_ENV, "") in ("", "0")
        and not HELP_FLAGS & set(sys.argv[1:])
    )


def supervise(argv: list[str], command: str) -> int:
    """Runs argv in a child process and returns its exit status. The child gets its own
    process group, so a Ctrl-C at the terminal reaches it once, through this process (which
    passes SIGINT, SIGTERM and SIGHUP on), and it dies with this one. If a signal this
    process did not pass on kills it, the crash is said in one sentence on stderr: the
    signal, the phase the child last entered (bpt.train.phases) and its hint."""
    from bpt.train import phases

    with tempfile.TemporaryDirectory(prefix="bpt-") as folder:
        phase_file = os.path.join(folder, "phase.json")
        env = dict(os.environ, **{CHILD_ENV: "1", phases.PHASE_ENV: phase_file})
        child = subprocess.Popen(argv, env=env, preexec_fn=_child_setup)
        forwarded = set()

        def forward(signum, frame):
            forwarded.add(signum)
            child.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        try:
            code = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if code >= 0:
            return code
        sig = -code
        if sig in forwarded:  # stopped as asked
            return 128 + sig
        state = phases.read(phase_file)
        print(f"{command}: error: {crash_message(sig, state)}", file=sys.stderr, flush=True)
        return 128 + sig


def crash_message(sig: int, state: dict) -> str:
    """One sentence for a child killed by signal sig in the phase state (phases.read)."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    what = CRASHES.get(sig, name)
    phase = state.get("phase")
    where = f" while {phase}" if phase else ""
    hint = state.get("hint") or "run it again with --debug for the whole output"
    return f"the process died of {what} ({name}){where}, with no Python error to report; {hint}"


def _child_setup() -> None:
    """In the child, before it runs: a process group of its own, and SIGTERM when its parent
    dies (Linux), so that no orphan keeps the GPUs."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _main(module: ModuleType, holders, argv: list[str]) -> None:
    expected = getattr(module, "ARGUMENTS", ())  # positional arguments, by name
    if len(argv) - 1 != len(expected):
        got = " ".join(argv[1:]) or "none"
        raise app.UsageError(f"expected the arguments {' '.join(expected) or '(none)'}; got {got}")
    logging.set_verbosity(logging.ERROR)  # Orbax's routine warnings are not the user's business
    module.main(holders, argv)


def _define_debug_flag() -> None:
    if "debug" not in flags.FLAGS:
        flags.DEFINE_bool("debug", False, f"Show the traceback of an error (or set {DEBUG_ENV}=1).")


def _make_key_flags(module: ModuleType) -> None:
    """--help lists the flags of the module sys.argv[0] names; a console script is not the
    module that defines them, so they are registered for it as well."""
    fv = flags.FLAGS
    for name, module_flags in fv.flags_by_module_dict().items():
        if name == module.__name__ or name.startswith("bpt.cli."):
            for flag in module_flags:
                if not flag.name.startswith("config."):
                    fv.register_key_flag_for_module(sys.argv[0], flag)


def set_memory_fraction(fraction: float) -> None:
    """Lets a GPU's memory pool take `fraction` of the device (XLA's default is 0.75, which
    cuts the longest contexts short); the user's own XLA_PYTHON_CLIENT_MEM_FRACTION wins.
    Must run before jax creates its backend (the first use of a device)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"train.memory_fraction must be in (0, 1]; got {fraction}")
    os.environ.setdefault(MEMORY_ENV, str(fraction))


# train.xla_flags presets. overlap: collectives overlapped with compute on meshes of several
# GPUs (the scheduler that moves them off the critical path, and the collectives of a
# scanned layer stack pipelined across its iterations); docs/notes/step_speed.md.
XLA_PRESETS = {
    "overlap": (
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
        "--xla_gpu_enable_while_loop_double_buffering=true",
    ),
}
XLA_FLAGS_ENV = "XLA_FLAGS"


def xla_flags(setting: str) -> list[str]:
    """The flags train.xla_flags stands for: a preset's, or its own; a clear error for
    anything else (XLA itself would abort the process on a flag it does not know)."""
    setting = (setting or "").strip()
    if setting in XLA_PRESETS:
        return list(XLA_PRESETS[setting])
    flags = setting.split()
    bad = [flag for flag in flags if not flag.startswith("--xla_")]
    if bad:
        raise ValueError(
            f"train.xla_flags takes a preset ({', '.join(XLA_PRESETS)}) or XLA flags such as "
            f"--xla_gpu_enable_latency_hiding_scheduler=true; got {bad[0]!r}"
        )
    return flags


def set_xla_flags(setting: str) -> None:
    """Adds train.xla_flags's flags to XLA_FLAGS, after the environment's own (XLA reads the
    last of a repeated flag, so the run's setting wins). Must run before jax creates its
    backend."""
    flags = xla_flags(setting)
    if flags:
        os.environ[XLA_FLAGS_ENV] = " ".join([os.environ.get(XLA_FLAGS_ENV, ""), *flags]).strip()


def run_memory_fraction(workdir) -> float:
    """train.memory_fraction of the run in workdir (the default where its config.json lacks it)."""
    import json
    from pathlib import Path

    from bpt.config import base_config

    fraction = base_config().train.memory_fraction
    path = Path(workdir) / "config.json"
    if path.is_file():
        try:
            fraction = json.loads(path.read_text()).get("train", {}).get("memory_fraction", fraction)
        except ValueError:
            pass  # restoring the run reports a broken config.json
    return fraction


def precheck_config_flags(argv: list[str], default_path: str) -> None:
    """Checks --config FILE and every --config.<key>=value of argv before ml_collections
    parses them, so a missing file or an unknown key reads as one sentence."""
    from bpt.config import check_keys, load_config_file

    path, overrides, args = default_path, [], iter(argv[1:])
    for arg in args:
        if arg in ("--config", "-config"):
            path = next(args, "")
        elif arg.startswith(("--config=", "-config=")):
            path = arg.split("=", 1)[1]
        elif arg.startswith(("--config.", "-config.")):
            overrides.append(arg.split("config.", 1)[1].split("=", 1)[0])
    config = load_config_file(path)
    check_keys(config, overrides)
    argv[:] = [_integral(config, arg) for arg in argv]


def _integral(config, arg: str) -> str:
    """--config.<key>=1e3 for an integer setting as --config.<key>=1000 (ml_collections
    reads integers by int(), which takes no exponent); any other argument as it is."""
    if not arg.startswith(("--config.", "-config.")) or "=" not in arg:
        return arg
    flag, value = arg.split("=", 1)
    node = config
    for part in flag.split("config.", 1)[1].split("."):
        node = node.get(part) if hasattr(node, "get") else None
    if isinstance(node, bool) or not isinstance(node, int) or value.strip().lstrip("-").isdigit():
        return arg
    try:
        number = float(value)
    except ValueError:
        return arg
    return f"{flag}={int(number)}" if number.is_integer() else arg


def define_config_flag(help_text: str):
    """--config FILE (default: bpt's default config) with its --config.<section>.<name>=value
    overrides, checked by precheck_config_flags first."""
    from ml_collections import config_flags

    import bpt.config

    precheck_config_flags(sys.argv, bpt.config.__file__)
    return config_flags.DEFINE_config_file("config", bpt.config.__file__, help_text, lock_config=True)


def flag_config(flag):
    """The config a define_config_flag flag holds, its family switched where the command line
    set --config.model.family (bpt.config.switch_family)."""
    from bpt.config import switch_family

    return switch_family(flag.value, [arg for arg in sys.argv[1:] if arg.startswith(("--config.", "-config."))])
