"""A code corpus every machine with Python has: the .py files of this interpreter's standard
library, then of its site-packages, as one .txt document each, in sorted path order up to a
byte budget. For quality runs on machines that reach no dataset hub (bench_flash.py's
quality part was run on one, docs/notes/flash.md):

    python scripts/python_corpus.py data/python_src --max_bytes 160e6
    bpt-prepare-data --source data/python_src --tokenizer byte --val_documents 200 --out data/python_bytes
    python scripts/bench_flash.py --parts quality --steps 1000 \\
        --set data.name=prepared --set data.path=data/python_bytes

The corpus depends on the Python version and the packages installed: corpus.json in the
output folder lists every file taken (its source path and size), so a run's data can be
told apart from another machine's.
"""

from __future__ import annotations

import argparse
import json
import site
import sys
import sysconfig
from pathlib import Path

PACKAGE_DIRS = {"site-packages", "dist-packages"}


def source_roots() -> list[Path]:
    """The standard library, then each site-packages folder of this interpreter."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), *(Path(p) for p in site.getsitepackages())]
    return [root for root in roots if root.is_dir()]


def collect(roots: list[Path], max_bytes: int, max_file_bytes: int) -> list[tuple[Path, int]]:
    """(path, size) of the .py files to take: each root's in sorted order (the standard
    library's without the package folders under it), every file once (by its resolved path),
    none empty or over max_file_bytes, until the next file would pass max_bytes."""
    taken, seen, total = [], set(), 0
    for i, root in enumerate(roots):
        for path in sorted(root.rglob("*.py")):
            if i == 0 and PACKAGE_DIRS & set(path.relative_to(root).parts):
                continue
            resolved = path.resolve()
            if resolved in seen or not path.is_file():
                continue
            seen.add(resolved)
            size = path.stat().st_size
            if size == 0 or size > max_file_bytes:
                continue
            if total + size > max_bytes:
                return taken
            taken.append((path, size))
            total += size
    return taken


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", help="the folder to write (000000.txt, ... and corpus.json)")
    parser.add_argument("--max_bytes", type=float, default=160e6, help="the corpus's size at most")
    parser.add_argument("--max_file_bytes", type=float, default=2e6, help="larger files are left out")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} is not empty: give a new folder")
    if args.max_bytes <= 0 or args.max_file_bytes <= 0:
        parser.error("--max_bytes and --max_file_bytes must be > 0")
    roots = source_roots()
    files = collect(roots, int(args.max_bytes), int(args.max_file_bytes))
    if not files:
        parser.error(f"no .py files under {', '.join(map(str, roots))} within --max_bytes")
    out.mkdir(parents=True, exist_ok=True)
    for i, (path, _) in enumerate(files):
        (out / f"{i:06d}.txt").write_bytes(path.read_bytes())
    manifest = dict(
        python=sys.version.split()[0],
        roots=[str(r) for r in roots],
        documents=len(files),
        bytes=sum(size for _, size in files),
        files=[[str(path), size] for path, size in files],
    )
    (out / "corpus.json").write_text(json.dumps(manifest, indent=1))
    print(
        f"{out}: {manifest['documents']:,} files, {manifest['bytes']:,} bytes "
        f"(Python {manifest['python']}; first {files[0][0]}, last {files[-1][0]})"
    )


if __name__ == "__main__":
    main()
