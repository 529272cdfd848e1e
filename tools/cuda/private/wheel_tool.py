"""Fetch a pinned wheel into the content-addressed cache, verify it, unpack part of it.

Run by the repository rules (tools/cuda/private/artifacts.bzl) with the chosen interpreter ($KDA_PYTHON):

  wheel_tool.py --name NAME --version VER --sha256 HEX --cache DIR --tmp DIR --strip PREFIX --dest DIR

Cache layout: DIR/<sha256>/<wheel file name>  (one file per directory; any file name ending in .whl).
A missing entry is fetched with `python -m pip download --no-deps --only-binary=:all: NAME==VER` (pip's
configured index, mirrors included), verified, then moved into the cache atomically. Every use re-verifies the
sha256. Members under PREFIX are unpacked into --dest with PREFIX removed (file modes kept: nvcc needs +x).
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def die(msg):
    sys.stderr.write("\n*** FlashKDA artifact fetch FAILED: %s\n" % msg)
    sys.exit(1)


def cached_wheel(cache, sha):
    d = os.path.join(cache, sha)
    if not os.path.isdir(d):
        return None
    whls = sorted(f for f in os.listdir(d) if f.endswith(".whl"))
    return os.path.join(d, whls[0]) if whls else None


def main():
    ap = argparse.ArgumentParser()
    for opt in ("name", "version", "sha256", "cache", "tmp", "strip", "dest"):
        ap.add_argument("--" + opt, required=opt not in ("strip",), default="")
    a = ap.parse_args()
    spec = "%s==%s" % (a.name, a.version)

    whl = cached_wheel(a.cache, a.sha256)
    if whl:
        sys.stderr.write("flash_kda: %s from cache %s\n" % (spec, whl))
    else:
        sys.stderr.write("flash_kda: %s not in cache %s; pip download ...\n" % (spec, a.cache))
        shutil.rmtree(a.tmp, ignore_errors=True)
        os.makedirs(a.tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", spec, "-d", a.tmp]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            die("`%s` failed (exit %d). Offline? Fill the cache %s (tools/cuda/README.md).\n%s"
                % (" ".join(cmd), r.returncode, a.cache, r.stdout))
        got = [f for f in os.listdir(a.tmp) if f.endswith(".whl")]
        if len(got) != 1:
            die("pip download of %s produced %r, expected one wheel" % (spec, got))
        tmp_whl = os.path.join(a.tmp, got[0])
        actual = sha256_of(tmp_whl)
        if actual != a.sha256:
            die("sha256 mismatch for %s (%s):\n  expected %s\n  actual   %s\nThe index served a different file; "
                "NOT caching it." % (spec, got[0], a.sha256, actual))
        d = os.path.join(a.cache, a.sha256)
        os.makedirs(d, exist_ok=True)
        whl = os.path.join(d, got[0])
        shutil.copyfile(tmp_whl, whl + ".part")
        os.replace(whl + ".part", whl)
        shutil.rmtree(a.tmp, ignore_errors=True)
        sys.stderr.write("flash_kda: cached %s as %s\n" % (spec, whl))

    actual = sha256_of(whl)
    if actual != a.sha256:
        die("sha256 mismatch for cached %s (%s):\n  expected %s\n  actual   %s\nDelete %s and retry."
            % (spec, whl, a.sha256, actual, os.path.dirname(whl)))

    n = 0
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            if not info.filename.startswith(a.strip) or info.filename.endswith("/"):
                continue
            rel = info.filename[len(a.strip):]
            if rel.startswith(".metadata/") or not rel:
                continue
            out = os.path.join(a.dest, rel)
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(out, (mode or 0o644) | 0o444 | (0o111 if mode & 0o100 else 0))
            n += 1
    if n == 0:
        die("%s: no files under %r in %s" % (spec, a.strip, whl))
    sys.stderr.write("flash_kda: unpacked %d files of %s\n" % (n, spec))


if __name__ == "__main__":
    main()
