"""The repositories FlashKDA's targets need, for a WORKSPACE (Bazel 4.2.3) that depends on FlashKDA.

    local_repository(name = "flash_kda_src", path = "...")  # any name but flash_kda (see README)
    load("@flash_kda_src//tools:deps.bzl", "flash_kda_dependencies")
    flash_kda_dependencies()

declares @kda_python (the interpreter in --repo_env=KDA_PYTHON, registered as the Python toolchain), @cuda (the
hermetic CUDA 13.0 toolkit from pinned wheels, or $KDA_CUDA_HOME) and @pybind11; the consumer provides rules_cc
and rules_python as for any C++ / Python code. Under bzlmod, bazel_dep(name = "flash_kda") brings them itself
(MODULE.bazel).
"""

load("//tools/cuda:repositories.bzl", "cuda_toolkit_repository")
load("//tools/pybind:repository.bzl", "pybind11_repository")
load("//tools/python:repository.bzl", "kda_python_repository")

def flash_kda_dependencies():
    kda_python_repository(name = "kda_python")
    native.register_toolchains("@kda_python//:py_toolchain")
    cuda_toolkit_repository(name = "cuda")
    pybind11_repository(name = "pybind11")
