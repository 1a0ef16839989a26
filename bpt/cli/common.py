"""What every bpt command shares: its flags in --help, one-sentence errors, device memory.

A command is a module with `define_flags()` (returning its flag holders) and
`main(flags, argv)`; its console script calls `run_command(module)`. Every failure (a bad
setting, a missing file, a model that does not fit the device) ends the command with one
sentence on stderr and exit status 1; `--debug` (or BPT_DEBUG=1) shows the traceback
instead.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from absl import app, flags, logging

DEBUG_ENV = "BPT_DEBUG"
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
        raise
    except Exception as error:  # noqa: BLE001  (every failure becomes one sentence)
        if _debug():
            raise
        message = _one_sentence(error)
        if not isinstance(error, (ValueError, FileNotFoundError, FileExistsError, MemoryError)):
            message = f"{type(error).__name__}: {message}"
        print(f"{command}: error: {message}", file=sys.stderr)
        print(f"({command} --debug, or {DEBUG_ENV}=1, shows the traceback)", file=sys.stderr)
        sys.exit(1)


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


def define_config_flag(help_text: str):
    """--config FILE (default: bpt's default config) with its --config.<section>.<name>=value
    overrides, checked by precheck_config_flags first."""
    from ml_collections import config_flags

    import bpt.config

    precheck_config_flags(sys.argv, bpt.config.__file__)
    return config_flags.DEFINE_config_file("config", bpt.config.__file__, help_text, lock_config=True)
