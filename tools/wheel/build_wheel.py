"""Writes a wheel (PEP 427) from files already laid out by Bazel; the action behind tools/wheel/defs.bzl.

    build_wheel.py --out_dir DIR --distribution NAME --version_from DEST --status STABLE_STATUS_FILE
                   [--requires REQ ...] --file DEST=SRC ...

The version is the `__version__ = "..."` of the file packed at DEST (the package's __init__.py: one source),
with a local part naming the commit (`V+g<sha>` from STABLE_GIT_COMMIT in Bazel's stable status file;
`+unknown` outside a git checkout). Python and ABI tags are this interpreter's (the one that built the
extension), the platform tag `sysconfig.get_platform()`: the wheel is for machines like the build machine.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import sys
import sysconfig
import zipfile

_FIXED_TIME = (2020, 1, 1, 0, 0, 0)  # zip entries' timestamps: the same inputs give the same bytes


def _commit(status_path: str) -> str:
    with open(status_path) as f:
        for line in f:
            key, _, value = line.strip().partition(" ")
            if key == "STABLE_GIT_COMMIT" and value and value != "unknown":
                return value
    return "unknown"


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--distribution", required=True)
    parser.add_argument("--version_from", required=True, help="DEST of the file that defines __version__")
    parser.add_argument("--status", required=True)
    parser.add_argument("--summary", default="")
    parser.add_argument("--requires", action="append", default=[])
    parser.add_argument("--requires_python", default=">=3.10")
    parser.add_argument("--file", action="append", default=[], help="DEST=SRC (DEST relative to the wheel root)")
    args = parser.parse_args()

    sources = dict(spec.partition("=")[::2] for spec in args.file)
    with open(sources[args.version_from]) as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if not match:
        raise SystemExit(f"no __version__ = \"...\" line in {args.version_from}")
    commit = _commit(args.status)
    version = f"{match.group(1)}+g{commit}" if commit != "unknown" else f"{match.group(1)}+unknown"
    py_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    tag = f"{py_tag}-{py_tag}-{platform}"
    name = args.distribution.replace("-", "_")
    dist_info = f"{name}-{version}.dist-info"

    files: list[tuple[str, bytes]] = []
    for spec in sorted(args.file):
        dest, _, src = spec.partition("=")
        with open(src, "rb") as f:
            files.append((dest, f.read()))
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {args.distribution}",
        f"Version: {version}",
        f"Summary: {args.summary}",
        f"Requires-Python: {args.requires_python}",
        *(f"Requires-Dist: {req}" for req in args.requires),
        "",
    ]
    wheel = ["Wheel-Version: 1.0", "Generator: flash_kda tools/wheel/build_wheel.py", "Root-Is-Purelib: false",
             f"Tag: {tag}", ""]
    top_level = sorted({dest.split("/", 1)[0] for dest, _ in files if "/" in dest})
    files += [
        (f"{dist_info}/METADATA", "\n".join(metadata).encode()),
        (f"{dist_info}/WHEEL", "\n".join(wheel).encode()),
        (f"{dist_info}/top_level.txt", ("\n".join(top_level) + "\n").encode()),
    ]
    record = [f"{dest},{_record_hash(data)},{len(data)}" for dest, data in files] + [f"{dist_info}/RECORD,,"]
    files.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode()))

    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{name}-{version}-{tag}.whl")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as whl:
        for dest, data in files:
            info = zipfile.ZipInfo(dest, date_time=_FIXED_TIME)
            info.external_attr = (0o755 if dest.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(info, data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
