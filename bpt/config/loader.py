"""Config files and overrides: a file's get_config(), "section.name=value" settings parsed as
bpt-train parses --config.section.name=value, and unknown keys named with the closest ones.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from ml_collections import ConfigDict

from bpt.config.schema import set_family


def load_config_file(path) -> ConfigDict:
    """The ConfigDict of a config file (a Python file with get_config()), by its path.

    As with ml_collections' --config flag, "file.py:ARG" calls get_config("ARG")."""
    path, *args = str(path).split(":", 1)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    spec = importlib.util.spec_from_file_location(f"bpt_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"config file {path} has no get_config() function")
    return module.get_config(*args)


def config_keys(c: ConfigDict, prefix: str = "") -> list[str]:
    """Every setting of a config as a dotted path ("train.steps", ...)."""
    keys = []
    for name, value in c.items():
        if isinstance(value, ConfigDict):
            keys += config_keys(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def check_keys(c: ConfigDict, keys) -> None:
    """Raises ValueError for the first dotted key that names no setting of c, with the
    closest existing ones ("unknown key train.stepz; did you mean train.steps?")."""
    known = config_keys(c)
    for key in keys:
        if key in known:
            continue
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == leaf]  # the right name, another section
        close = close or difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; bpt/config/schema.py lists the settings"
        raise ValueError(f"unknown key {key}{hint}")


def override(c: ConfigDict, *settings: str) -> ConfigDict:
    """Sets fields from "section.name=value" strings, parsed exactly as bpt-train parses
    --config.section.name=value (ml_collections' config flags: the field's type decides).
    A model.family among them switches the family as set_family does (the other model
    settings given keep their values, whatever their order). Returns c, changed in place."""
    from absl import flags
    from ml_collections import config_flags

    for setting in settings:
        if "=" not in setting:
            raise ValueError(f"cannot set {setting!r}: expected section.name=value")
    check_keys(c, [setting.split("=", 1)[0].strip() for setting in settings])
    argv = ["bpt", *(f"--config.{setting.strip()}" for setting in settings)]
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_dict("config", c, flag_values=values, lock_config=True, sys_argv=argv)
    try:
        values(argv)
    except flags.Error as error:
        raise ValueError(str(error)) from None
    return switch_family(holder.value, settings)


def switch_family(c: ConfigDict, settings) -> ConfigDict:
    """c after its overrides `settings` ("section.name=value" or "--config.section.name=value"):
    where they set model.family, set_family(c, family) keeping the model settings they gave."""
    keys = [setting.split("=", 1)[0].strip().lstrip("-").removeprefix("config.") for setting in settings]
    if "model.family" in keys:
        given = [key.split(".", 1)[1] for key in keys if key.startswith("model.")]
        with c.unlocked():
            set_family(c, c.model.family, keep=given)
    return c
