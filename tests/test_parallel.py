"""Runs tests/multidevice/ on 8 CPU devices, in one subprocess (the device count is fixed when
jax starts, and every other test module runs on one device)."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_multidevice_suite_on_8_cpu_devices():
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "multidevice" / "parallel_cases.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE.parent,
    )
    summary = proc.stdout.strip().splitlines()[-1:] or ["no output"]
    print(f"multidevice: {summary[0]}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]
