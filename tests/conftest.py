import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# One persistent compilation cache for the whole run, made before jax starts: the pytest-xdist
# workers and every subprocess a test starts (bpt-train, the scripts, the 8-device suite)
# inherit it, so a program compiled once (the same tiny model's train step in many tests) is
# loaded, not compiled, the next time. XLA's CPU compiles are most of the suite's time. Set
# JAX_COMPILATION_CACHE_DIR to keep a cache across runs; the one made here is removed at the end.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="bpt-tests-jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# XLA's CPU backend at LLVM's -O0 and with its older fusion emitters: the suite's programs are
# small and run once or a few times, so compiling them is most of their cost. -O0 took about
# a third off the suite's CPU time (93 -> 62 minutes on 2 cores); the older emitters compile
# the suite's programs about 30% faster again (2026-11-30: 22.0 -> 14.3 s, 32.6 -> 23.0 s and
# 17.3 -> 12.0 s for three tests of test_model.py and test_gau.py). XLA's HLO passes and
# buffer assignment, which the memory tests read, are the same or nearly so: the tiny model's
# step at 1K needs the same temp bytes to 0.1% in each attention mode. Only where jax has no
# GPU plugin: GPU tests keep XLA's own settings.
CPU_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _has_gpu_plugin() -> bool:
    from importlib.metadata import distributions

    return any((d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm"))
               for d in distributions())  # fmt: skip


def with_xla_flags(env: dict, *flags: str) -> dict:
    """env with flags ("--name=value") in its XLA_FLAGS, each replacing one of the same name:
    a subprocess keeps the suite's own flags and sets its device count."""
    names = {flag.split("=")[0] for flag in flags}
    kept = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=")[0] not in names]
    return dict(env, XLA_FLAGS=" ".join([*kept, *flags]))


def _xla_takes(flags: list[str]) -> bool:
    """Whether this jaxlib's XLA knows flags: an unknown one aborts the process that starts
    the backend, so a short subprocess asks (once: pytest-xdist's workers and the tests'
    subprocesses inherit the result in XLA_FLAGS)."""
    env = dict(with_xla_flags(os.environ, *flags), JAX_PLATFORMS="cpu")
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0


# a user's own setting of a flag stays
_missing = [f for f in CPU_XLA_FLAGS if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
if _missing and not _has_gpu_plugin():
    if not _xla_takes(_missing):  # a jaxlib without the older emitters: -O0 alone
        _missing = [f for f in _missing if f == CPU_XLA_FLAGS[0]]
    os.environ["XLA_FLAGS"] = with_xla_flags(os.environ, *_missing)["XLA_FLAGS"]


import jax  # noqa: E402  (after the cache's and XLA's settings)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The longest single test (the 8-device suite in one subprocess, 10 to 14 minutes) goes first:
# pytest-xdist's worksteal gives each worker a contiguous half of the collected tests, so a
# long test collected late ends the run alone while the other worker idles; first, it runs
# beside the rest of the suite, and the other worker steals from its queue when done with its own.
FIRST = ("test_parallel.py::test_multidevice_suite_on_8_cpu_devices",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.endswith(FIRST))  # stable: the rest keep their order


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The memory tests read XLA's buffer assignment on the CPU; on a GPU each cuBLAS call's 32 MiB
# workspace is part of a program's temp size, which hides the growth they measure.
cpu_memory_analysis = pytest.mark.skipif(
    jax.default_backend() == "gpu",
    reason="measures the CPU's buffer assignment (a GPU adds cuBLAS workspaces)",
)


@pytest.fixture(autouse=True)
def fp32_matmuls_are_fp32(request):
    """The suite's fp32 comparisons hold its tolerances with fp32 matmuls. A GPU multiplies
    fp32 in TF32 by default (about 1e-3 relative error): there every test but the GPU ones
    (marked gpu, which set their own precisions) runs at jax's highest matmul precision. On a
    CPU it changes nothing."""
    if request.node.get_closest_marker("gpu") or jax.default_backend() != "gpu":
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


def memory_mappings() -> int:
    """How many memory mappings this process holds (0 where /proc does not say)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


# jax keeps every program it compiled while the function that made it lives, and each CPU
# executable is JIT code in about six memory mappings of its own. A pytest-xdist worker runs
# hundreds of tests (eager model calls compile each primitive apart), and Linux lets a
# process hold 65,530 mappings (vm.max_map_count): past that, XLA cannot map the next
# program's code ("Failed to materialize symbols") and the worker dies in the C++ error's
# unwinding (a segmentation fault, 2026-12-05). After a test that leaves the process holding
# more than this many mappings, the compiled programs go; one needed again is compiled anew
# or loaded from the persistent cache above.
MAPPINGS_BEFORE_CLEARING = 30_000


@pytest.fixture(autouse=True)
def compiled_programs_go_before_the_process_runs_out_of_mappings():
    yield
    if memory_mappings() > MAPPINGS_BEFORE_CLEARING:
        jax.clear_caches()


@pytest.fixture
def no_compilation_cache():
    """Compiles as if no cache existed, for a test that counts XLA's compilations (jax reads
    the setting once per process; reset_cache makes it read it again)."""
    from jax._src import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


@pytest.fixture
def own_compile_cache(tmp_path):
    """A train.compile_cache folder of this test's own that keeps every compilation, however
    short (jax keeps those of a second or more); the suite's own cache again afterwards."""
    from bpt.train import compile_cache

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    yield str(tmp_path / "cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
    compile_cache.use("auto")


@pytest.fixture
def key():
    """A fresh random key per test; the seed is printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (2**31))
    print(f"random seed: {seed}")
    return jax.random.PRNGKey(seed)


REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """scripts/<name>.py imported as a module (the scripts are not a package; their shared
    helpers, scripts/benchlib.py, become importable too)."""
    import importlib.util
    import sys

    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def kernel_grids(jaxpr) -> dict:
    """{kernel name: its launches' grids} of every Pallas kernel in jaxpr, nested ones too."""
    grids = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            grids.setdefault(str(eqn.params["name"]), []).append(eqn.params["grid_mapping"].grid)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            for name, found in kernel_grids(sub).items():
                grids.setdefault(name, []).extend(found)
    return grids


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tree_rel_err(a, b, floor: float = 1e-3) -> float:
    """The worst leaf's relative error. A leaf whose true value is (near) zero, such as the
    gradient of a key bias, which softmax cancels exactly, is measured against `floor` of the
    whole tree's norm instead of its own."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    total = np.sqrt(sum(np.sum(np.asarray(y, np.float64) ** 2) for y in lb))
    worst = 0.0
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), floor * total, 1e-30)))
    return worst


def saved_and_grads(loss, args, capsys) -> tuple[str, object]:
    """(what loss's backward keeps, as jax.ad_checkpoint prints it; the gradient of loss with
    respect to its one argument, or the tuple of them for several)."""
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(loss, *args)
    argnums = 0 if len(args) == 1 else tuple(range(len(args)))
    return capsys.readouterr().out, jax.grad(loss, argnums=argnums)(*args)
