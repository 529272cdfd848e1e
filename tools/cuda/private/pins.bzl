"""The pinned wheels: ONE table for every artifact the repository rules fetch (name, version, sha256).

The cache (tools/cuda/README.md) is keyed by the sha256 below; tools/offline reads this table too.
`strip` is the directory inside the wheel that is unpacked, `dest` where it goes in the generated repository.
"""

CUDA_VERSION = "13.0.88"

# CUDA 13.0 toolkit pieces; they all unpack into one nvidia/cu13/{bin,nvvm,include,lib} tree.
CUDA_WHEELS = [
    struct(name = "nvidia-cuda-nvcc", version = "13.0.88", sha256 = "56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03", strip = "nvidia/cu13/", dest = ""),
    struct(name = "nvidia-nvvm", version = "13.0.88", sha256 = "c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0", strip = "nvidia/cu13/", dest = ""),
    struct(name = "nvidia-cuda-crt", version = "13.0.88", sha256 = "2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4", strip = "nvidia/cu13/", dest = ""),
    struct(name = "nvidia-cuda-runtime", version = "13.0.88", sha256 = "422a38f7c739ecbdd3a4b6ec7ed0a1d74db43d8e9bc26685f3d845638922b178", strip = "nvidia/cu13/", dest = ""),
    struct(name = "nvidia-cuda-cccl", version = "13.0.85", sha256 = "e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649", strip = "nvidia/cu13/", dest = ""),
]

PYBIND11_WHEEL = struct(name = "pybind11", version = "3.0.1", sha256 = "aa8f0aa6e0a94d3b64adfc38f560f33f15e589be2175e103c0a33c6bce55ee89", strip = "pybind11/include/", dest = "include/")

# fla 0.6.0 (pure Python) and what it imports beyond torch/triton: the dispatch test's peer (//kda/tests:test_fla),
# through @fla (tools/python/fla_repository.bzl). fla's chunk_kda calls an importable `flash_kda` package.
FLA_WHEELS = [
    struct(name = "fla-core", version = "0.6.0", sha256 = "b0708b70e0b119cd58a0a5146ea56cb175cef6ed969d8ac60267e3e077ce3ebd", strip = "", dest = ""),
    struct(name = "flash-linear-attention", version = "0.6.0", sha256 = "6dec9735f8454523c13553622e98aff30152dde6586b4ac7d88010fbb7a06b5f", strip = "", dest = ""),
    struct(name = "einops", version = "0.8.1", sha256 = "919387eb55330f5757c6bea9165c5ff5cfe63a642682ea788a6d472576d81737", strip = "", dest = ""),
]

ALL_WHEELS = CUDA_WHEELS + [PYBIND11_WHEEL] + FLA_WHEELS
