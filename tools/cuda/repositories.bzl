"""Public entry point for WORKSPACE: the hermetic CUDA toolkit repository rule."""

load("//tools/cuda/private:repository.bzl", _cuda_toolkit_repository = "cuda_toolkit_repository")

cuda_toolkit_repository = _cuda_toolkit_repository
