"""XLA's compiled programs kept on disk between runs (train.compile_cache).

A long context's training step takes minutes to compile; with the cache a restarted or
resumed run loads it instead, model.remat_layer=auto's candidates included. (Within a run,
auto's chosen step is the loop's own: bpt-train runs it without compiling it again, cache
or not; bpt.train.loop.) This is jax's persistent compilation cache; only compilations of a
second or more are kept (jax's jax_persistent_cache_min_compile_time_secs). Nothing is
evicted (jax's size bound needs every writer of the folder to keep access times, which a
folder shared with other jax programs does not): the folder can be deleted at any time.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from bpt.data.text import cache_root

HIT_EVENT = "/jax/compilation_cache/cache_hits"
_UNSET = object()
_state = {"dir": _UNSET, "hits": 0, "compiles": 0}


def cache_dir(setting: str) -> Path | None:
    """The folder train.compile_cache names: "auto" is jax's own setting where the environment
    makes one (JAX_COMPILATION_CACHE_DIR), else compiled/ in bpt's cache folder ($BPT_CACHE,
    else ~/.cache/bpt, where the corpora go too); "" turns the cache off; anything else is a
    path."""
    if not isinstance(setting, str):
        raise ValueError(f'train.compile_cache must be "auto", "" (off) or a folder; got {setting!r}')
    if setting == "":
        return None
    if setting == "auto":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
        return cache_root() / "compiled"
    return Path(setting).expanduser()


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


def _count(event: str, **_) -> None:
    if event == HIT_EVENT:
        _state["hits"] += 1


def _count_compile(event: str, seconds: float, **_) -> None:
    if event == COMPILE_EVENT:
        _state["compiles"] += 1


# once, when this module is first imported
jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(_count_compile)


def use(setting: str) -> Path | None:
    """Points jax's compilation cache at train.compile_cache's folder (created here), or turns
    it off; returns the folder. Takes effect for the compilations that follow."""
    folder = cache_dir(setting)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        folder = folder.resolve()
    if folder != _state["dir"]:
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()  # jax opens its cache once; a new folder needs a reset
        jax.config.update("jax_compilation_cache_dir", None if folder is None else str(folder))
        jax.config.update("jax_enable_compilation_cache", folder is not None)
        # A program with cuDNN's attention holds the address of jax's partitioning callback
        # for it, which differs every run: without this no such program would ever be found
        # again. The executable no longer calls it (partitioning happens while compiling).
        jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)
        _state["dir"] = folder
    return folder


def hits() -> int:
    """Compiled programs loaded from the cache in this process so far."""
    return _state["hits"]


def compiles() -> int:
    """XLA compilations run in this process so far (programs the cache did not have, or any
    with the cache off)."""
    return _state["compiles"]
