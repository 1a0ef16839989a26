"""Two steps' profiles side by side: where their kernel time differs, by kind of operation.

    python scripts/compare_profiles.py runs/ln/profile.json runs/rms/profile.json --top 12

Reads the profile.json files that `scripts/profile_step.py --out DIR` writes. An unrolled
step names each layer's copy of an operation apart (fusion.12, fusion.13, ...), so the
operations are grouped by their name without its numeric suffix and by what they compute
(the shape and custom call in the profile's "hlo" column): one row a kind, with its time a
step and calls in each profile. Prints the step totals and parts, then the `--top` kinds
whose times differ most (`--skip 'matmul|gemm'` leaves out kinds that match: GEMMs that only
changed their names between two programs).
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

from benchlib import script_parser

HLO_CHARS = 90  # the part of the "hlo" column that names a kind


def kind_of(op: dict) -> tuple[str, str]:
    return re.sub(r"\.\d+$", "", op["op"]), op.get("hlo", "")[:HLO_CHARS]


def kinds(profile: dict) -> dict[tuple[str, str], list[float]]:
    """{(operation without its suffix, hlo): [ms a step, calls]}."""
    grouped: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for op in profile["ops"]:
        entry = grouped[kind_of(op)]
        entry[0] += op["ms"]
        entry[1] += op["calls"]
    return dict(grouped)


def compare(a: dict, b: dict, *, top: int, names: tuple[str, str] = ("a", "b"), skip: str = "") -> str:
    """The comparison as markdown: totals, then the `top` kinds that differ most (those whose
    operation or computes match the regular expression skip left out)."""
    ka, kb = kinds(a), kinds(b)
    if skip:
        ka, kb = ({k: v for k, v in g.items() if not re.search(skip, " ".join(k))} for g in (ka, kb))
    ms_a, ms_b = a["kernel_ms_per_step"], b["kernel_ms_per_step"]
    lines = [f"kernels a step: {names[0]} {ms_a:.1f} ms, {names[1]} {ms_b:.1f} ms ({ms_a - ms_b:+.1f})"]
    parts = sorted(set(a.get("by_part", {})) | set(b.get("by_part", {})))
    for part in parts:
        pa, pb = a.get("by_part", {}).get(part, 0.0), b.get("by_part", {}).get(part, 0.0)
        lines.append(f"  {part}: {pa:.1f} against {pb:.1f} ms ({pa - pb:+.1f})")
    lines += ["", f"| operation | computes | {names[0]} ms (calls) | {names[1]} ms (calls) | difference |"]
    lines.append("|---|---|---|---|---|")
    zero = [0.0, 0.0]
    rows = sorted(set(ka) | set(kb), key=lambda k: -abs(ka.get(k, zero)[0] - kb.get(k, zero)[0]))
    for key in rows[:top]:
        (ms_a, calls_a), (ms_b, calls_b) = ka.get(key, zero), kb.get(key, zero)
        cell_a = f"{ms_a:.2f} ({calls_a:g})" if calls_a else "none"
        cell_b = f"{ms_b:.2f} ({calls_b:g})" if calls_b else "none"
        computes = key[1].replace("|", "/")
        lines.append(f"| {key[0]} | {computes} | {cell_a} | {cell_b} | {ms_a - ms_b:+.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = script_parser(__doc__, out_help="also write the comparison here (markdown)")
    parser.add_argument("first", help="a profile.json of scripts/profile_step.py")
    parser.add_argument("second", help="the profile.json to compare it with")
    parser.add_argument("--top", type=int, default=12, help="kinds of operation to list")
    parser.add_argument(
        "--skip", default="", help="leave out kinds whose operation or computes match (e.g. 'matmul|gemm')"
    )
    args = parser.parse_args()
    a, b = (json.loads(Path(p).read_text()) for p in (args.first, args.second))
    names = tuple(Path(p).parent.name or Path(p).stem for p in (args.first, args.second))
    text = compare(a, b, top=args.top, names=names, skip=args.skip)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
