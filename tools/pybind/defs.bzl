"""pybind_extension: a Python extension module built with pybind11.

`pybind_extension(name, srcs, deps = [], copts = [], linkopts = [], **kwargs)` generates:

  * `:<name>.so` -- `cc_binary(linkshared = True, linkstatic = True)` of `srcs`, with deps + `@pybind11`
    (headers, plus the Python headers of $KDA_PYTHON), `-std=c++17` (pybind11 3 needs it; Bazel 4 defaults to
    c++0x), `-O2` in every compilation mode (pybind11's dispatch is on every call's path: Bazel's default
    fastbuild compiles it at -O0, where flash_kda's 34-argument `fwd` spent about 6 µs more host time per call;
    `copts` come after it and can override it), `-fvisibility=hidden` (only PyInit_<module> is exported) and
    `-fexceptions`. Static deps (e.g. a cuda_library and libcudart_static.a) are linked in.
  * `:<name>` -- a filegroup holding the `.so` (put it in a py_library's `data`).

`name` may contain a path: `pybind_extension(name = "python/flash_kda/_C", ...)` produces
`python/flash_kda/_C.so`, importable as `flash_kda._C` from a py_library with `imports = ["python"]`.
"""

load("@rules_cc//cc:defs.bzl", "cc_binary")

def pybind_extension(name, srcs, deps = [], copts = [], linkopts = [], visibility = None, **kwargs):
    cc_binary(
        name = name + ".so",
        srcs = srcs,
        deps = deps + [Label("@pybind11//:pybind11")],
        copts = ["-std=c++17", "-O2"] + copts + ["-fvisibility=hidden", "-fexceptions"],
        linkopts = linkopts,
        linkshared = True,
        linkstatic = True,
        visibility = visibility,
        **kwargs
    )
    native.filegroup(
        name = name,
        srcs = [":" + name + ".so"],
        visibility = visibility,
        tags = kwargs.get("tags", []),
    )
