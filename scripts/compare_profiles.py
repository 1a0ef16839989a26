"""Two steps' profiles side by side: where their kernel time differs, by kind of operation.

    python scripts/compare_profiles.py runs/ln/profile.json runs/rms/profile.json --top 12

Reads the profile.json files that `scripts/profile_step.py --out DIR` writes. An unrolled
step names each layer's copy of an operation apart (fusion.12, fusion.13, ...), so the
operations are grouped by their name without its numeric suffix and by what they compute
(the shape and custom call in the profile's "hlo" column): one row a kind, with its time a
step and calls in each profile. Prints the step totals and parts, then the `--top` kinds
whose times differ most (`--skip 'matmul|gemm'` leaves out kinds that match: GEMMs that only
changed their names between two programs).

--png draws the profiles' parts (one bar a profile, each part's share of its kernel time,
with its ms a step), for any number of profiles:

    python scripts/compare_profiles.py p8/profile.json p32/profile.json p7b/profile.json \
        --names "GPT-1B 8K,GPT-1B 32K,GPT-7B 32K" --png parts.png
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


# The parts in the order the bars stack them (profile_step's names); others follow.
PART_ORDER = (
    "dense matmuls",
    "attention forward",
    "attention backward",
    "LM head and loss",
    "elementwise and norms",
    "copies",
    "collectives",
    "optimizer and gradient sums",
)


def part_shares(profile: dict) -> list[tuple[str, float, float]]:
    """(part, ms a step, share of the parts' sum) in PART_ORDER, then any other part."""
    by_part = profile.get("by_part", {})
    total = sum(by_part.values()) or 1.0
    names = [p for p in PART_ORDER if p in by_part] + sorted(p for p in by_part if p not in PART_ORDER)
    return [(name, by_part[name], by_part[name] / total) for name in names]


def plot_parts(profiles: dict[str, dict], path: str | Path) -> None:
    """One horizontal bar a profile (named by the dict's keys, top to bottom): its parts'
    shares of the kernel time, each segment labeled with its ms a step where it is wide
    enough."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = {name: part_shares(p) for name, p in profiles.items()}
    parts = [p for p in PART_ORDER if any(p == s[0] for rows in shares.values() for s in rows)]
    parts += sorted({s[0] for rows in shares.values() for s in rows} - set(parts))
    colors = dict(zip(parts, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(profiles)))
    names = list(profiles)
    for row, name in enumerate(names):
        left = 0.0
        for part, ms, share in shares[name]:
            ax.barh(row, share * 100, left=left, color=colors[part], label=part if row == 0 else None)
            if share > 0.06:
                ax.text(left + share * 50, row, f"{ms:.0f} ms", ha="center", va="center", fontsize=8)
            left += share * 100
    for part in parts:  # a legend entry for parts the first bar lacks
        if not any(part == s[0] for s in shares[names[0]]):
            ax.barh(0, 0, color=colors[part], label=part)
    ax.set_yticks(range(len(names)), [f"{n} ({profiles[n]['kernel_ms_per_step']:.0f} ms)" for n in names])
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the step's kernel time (%)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.05 * len(names)), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = script_parser(__doc__, out_help="also write the comparison here (markdown)")
    parser.add_argument("profiles", nargs="+", help="profile.json files of scripts/profile_step.py")
    parser.add_argument("--top", type=int, default=12, help="kinds of operation to list")
    parser.add_argument(
        "--skip", default="", help="leave out kinds whose operation or computes match (e.g. 'matmul|gemm')"
    )
    parser.add_argument("--names", default="", help="comma-separated names (default: each file's folder)")
    parser.add_argument("--png", default="", help="draw the profiles' parts here")
    args = parser.parse_args()
    profiles = [json.loads(Path(p).read_text()) for p in args.profiles]
    names = args.names.split(",") if args.names else [Path(p).parent.name or Path(p).stem for p in args.profiles]
    if len(names) != len(profiles):
        parser.error(f"--names gives {len(names)} names for {len(profiles)} profiles")
    if not args.png and len(profiles) != 2:
        parser.error("the comparison takes two profiles (--png draws any number)")
    if args.png:
        plot_parts(dict(zip(names, profiles)), args.png)
        print(f"wrote {args.png}")
    if len(profiles) == 2:
        text = compare(*profiles, top=args.top, names=tuple(names), skip=args.skip)
        if args.out:
            Path(args.out).write_text(text + "\n")
        print(text)


if __name__ == "__main__":
    main()
