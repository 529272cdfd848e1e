"""Merges several bench_fwd --json runs into one table (JSON, markdown, PNG), one row per case.

    bazel-bin/kda/bench/merge_runs --out=/tmp/bench-h200-DATE runA.json runB.json runM.json

Runs are taken in the order given: a case keeps the first row found for it, so list the runs with both peers
first. Each merged row keeps its own process's numbers (all three implementations of a row come from one
run) and gets a "run" field (--labels, or A, B, … in argument order); the markdown header names every run's command. For a
time limit too short for one run of every case with fla (whose Triton autotuning takes 80-110 s per new
shape on a fresh machine). A program, not a test.
"""

from __future__ import annotations

import json
import string

from absl import app, flags

import bench_fwd

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "output path without extension: writes OUT.json, OUT.md and OUT.png")
flags.DEFINE_list("notes", [], "extra notes for the markdown (comma list)")
flags.DEFINE_list("labels", [], "names of the runs, in argument order (default A, B, C, ...)")


def merge(runs: list[dict], labels: list[str]) -> tuple[list[dict], dict]:
    """(rows in bench_fwd.CASES order, meta of the merged table) from bench_fwd JSON documents."""
    rows: dict[str, dict] = {}
    for letter, run in zip(labels, runs):
        for row in run["rows"]:
            if row.get("flash_kda_ms") is None or row["case"] in rows:
                continue
            rows[row["case"]] = {**row, "run": letter}
    order = [c.name for c in bench_fwd.CASES]
    merged = [rows[name] for name in order if name in rows] + [r for n, r in rows.items() if n not in order]
    meta = dict(runs[-1]["meta"])
    meta["command"] = " | ".join(f"run {letter}: {run['meta']['command']}"
                                 for letter, run in zip(labels, runs))
    meta["copy_bytes_per_s"] = min(run["meta"]["copy_bytes_per_s"] for run in runs)
    versions: dict = {}
    for run in runs:  # the peers any run loaded
        for peer, version in run["meta"].get("peer_versions", {}).items():
            versions[peer] = versions.get(peer) or version
    meta["peer_versions"] = versions
    meta["notes"] = ["Merged from several bench_fwd processes; each row's numbers come from one process "
                     "(its 'run' in the JSON)."] + list(FLAGS.notes)
    return merged, meta


def main(argv: list[str]) -> None:
    paths = argv[1:]
    if not paths or not FLAGS.out:
        raise app.UsageError("usage: merge_runs --out=PATH_STEM RUN.json [RUN.json ...]")
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    labels = list(FLAGS.labels) or list(string.ascii_uppercase[: len(runs)])
    if len(labels) != len(runs):
        raise app.UsageError(f"--labels names {len(labels)} runs, {len(runs)} given")
    rows, meta = merge(runs, labels)
    bench_fwd.write_json(FLAGS.out + ".json", rows, meta)
    bench_fwd.write_markdown(FLAGS.out + ".md", rows, meta)
    bench_fwd.write_png(FLAGS.out + ".png", rows, meta)
    for row in rows:
        print(row["run"], row["case"], *(bench_fwd._fmt(row.get(f"{impl}_ms"), ".3f") for impl in bench_fwd.IMPLS))


if __name__ == "__main__":
    app.run(main)
