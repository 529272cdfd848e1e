"""One table of FlashKDA's times over the builds that tools/dev/gpu_iterate.sh benchmarked in OUT_DIR (a development
summary, not a test): the tree's bench.json first, then bench_variant1.json, bench_variant2.json, ... in order, one
row each, a column per bench case, "graph ms (eager ms)". An alternated A/B reads down a column, and the table stays
a few lines long however many variants ran, so that it survives a truncated log.

  python3 tools/dev/variant_table.py OUT_DIR [--variants "$KDA_VARIANT"]

--variants (the KDA_VARIANT value of the run) names each variant row after the file that replaced the tree's first
path: the folder patch_variants.py or issue_bound_proxy.py wrote it into (a patch's name, "tree", "variant1"), or
its own name; without it the rows are "variant N".
"""
from __future__ import annotations

import argparse
import json
import pathlib


def builds(out_dir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """The bench JSONs of one gpu_iterate.sh run, in build order: (0, bench.json) for the tree, (N, bench_variantN)."""
    found = [(0, out_dir / "bench.json")] if (out_dir / "bench.json").exists() else []
    found += [(int(p.stem.removeprefix("bench_variant")), p) for p in out_dir.glob("bench_variant*.json")]
    return sorted(found)


def variant_label(variant: str) -> str:
    """A short name for one variant of a KDA_VARIANT value (PATH=FILE[+PATH=FILE...])."""
    path, file = variant.split("+")[0].split("=", 1)
    if file.endswith("/" + path):  # patch_variants.py: OUT_DIR/<patch name>/<path>
        return pathlib.PurePath(file[: -len(path) - 1]).name
    if pathlib.PurePath(file).name == pathlib.PurePath(path).name:  # issue_bound_proxy.py: OUT_DIR/<build>/<name>
        return pathlib.PurePath(file).parent.name
    return pathlib.PurePath(file).name


def table(rows: list[tuple[str, list[dict]]]) -> str:
    cases: list[str] = []
    for _, bench_rows in rows:
        cases += [r["case"] for r in bench_rows if r["case"] not in cases]

    def cell(bench_rows: list[dict], case: str) -> str:
        row = next((r for r in bench_rows if r["case"] == case), None)
        if row is None or row.get("flash_kda_ms") is None:
            return "-"
        graph = row.get("flash_kda_graph_ms")
        eager = f"{row['flash_kda_ms']:.4f}"
        return f"{graph:.4f} ({eager})" if graph is not None else f"- ({eager})"

    lines = ["| build | " + " | ".join(cases) + " |", "|---|" + "---:|" * len(cases)]
    lines += [f"| {label} | " + " | ".join(cell(r, c) for c in cases) + " |" for label, r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--variants", default="", help="the run's KDA_VARIANT value (names the variant rows)")
    args = parser.parse_args()
    labels = [variant_label(v) for v in args.variants.split(",") if v]
    rows = []
    for n, path in builds(args.out_dir):
        label = "the tree as built" if n == 0 else f"{n}: {labels[n - 1]}" if n <= len(labels) else f"variant {n}"
        rows.append((label, json.loads(path.read_text())["rows"]))
    print("FlashKDA ms, graph (eager), by build:" if rows else f"no bench JSON in {args.out_dir}")
    if rows:
        print(table(rows))


if __name__ == "__main__":
    main()
