"""Shared repository-rule helper: fetch a pinned wheel through the sha256-keyed cache and unpack it.

Used by tools/cuda (the toolkit) and tools/pybind (pybind11). Cache layout and offline use: tools/cuda/README.md.
"""

ARTIFACT_ENV = ["KDA_PYTHON", "KDA_ARTIFACT_CACHE", "HOME"]

def kda_python(rctx):
    """The interpreter from $KDA_PYTHON (set by tools/bazel), or fail with a clear message."""
    py = rctx.os.environ.get("KDA_PYTHON", "")
    if not py:
        fail("KDA_PYTHON is not set. Run Bazel through tools/bazel (it prepares a venv and passes " +
             "--repo_env=KDA_PYTHON=...), or pass --repo_env=KDA_PYTHON=/path/to/python3 yourself.")
    r = rctx.execute([py, "-c", "import sys; print(sys.version_info[0])"])
    if r.return_code != 0 or r.stdout.strip() != "3":
        fail("KDA_PYTHON=%s is not a working Python 3 interpreter: %s%s" % (py, r.stdout, r.stderr))
    return py

def artifact_cache(rctx):
    cache = rctx.os.environ.get("KDA_ARTIFACT_CACHE", "")
    if not cache:
        cache = rctx.os.environ.get("HOME", "/tmp") + "/.cache/flash_kda/artifacts"
    return cache

def fetch_wheel(rctx, wheel, dest = None):
    """Makes sure `wheel` (a struct from pins.bzl) is cached and verified, and unpacks its `strip` subtree.

    Args:
      rctx: the repository context.
      wheel: struct(name, version, sha256, strip, dest).
      dest: directory in the repository to unpack into (default wheel.dest).
    """
    py = kda_python(rctx)
    tool = rctx.path(Label("//tools/cuda/private:wheel_tool.py"))
    out = dest if dest != None else wheel.dest
    r = rctx.execute([
        py,
        str(tool),
        "--name=" + wheel.name,
        "--version=" + wheel.version,
        "--sha256=" + wheel.sha256,
        "--cache=" + artifact_cache(rctx),
        "--tmp=" + str(rctx.path("_download_" + wheel.name)),
        "--strip=" + wheel.strip,
        "--dest=" + str(rctx.path(out if out else ".")),
    ], timeout = 1800, quiet = False)
    if r.return_code != 0:
        fail("fetching pinned wheel %s==%s failed:\n%s%s" % (wheel.name, wheel.version, r.stdout, r.stderr))
