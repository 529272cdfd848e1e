"""Public CUDA build rules for FlashKDA. Implementation: //tools/cuda/private.

`cuda_library(name, srcs, hdrs = [], deps = [], copts = [], defines = [], archs = [], **kwargs)`

Compiles CUDA sources with the toolkit's nvcc (the hermetic CUDA 13.0 of @cuda, or $KDA_CUDA_HOME when given
explicitly) and wraps the objects in a C++ library that C++ targets can depend on.

Generated targets, for `cuda_library(name = "foo", ...)`:

  * `:foo_cu_objs` (private) -- one `CudaCompile` action per `.cu` in `srcs`, output
    `_cuda_objs/foo_cu_objs/<src>.pic.o`. Flags, all from tools/cuda/private/flags.bzl:
    `-gencode=arch=compute_90a,code=sm_90a` (per arch in `archs`, default `["sm_90a"]`), `-std=c++17 -O3
    -lineinfo --expt-relaxed-constexpr -Xcompiler -fPIC`, `-ccbin <C++ toolchain's gcc>` (set CC through
    `--repo_env=CC=/usr/bin/gcc` to change it), `-I` for the workspace root, the output roots and every include
    dir of `deps` (nvcc has no -iquote, so `#include "kda/csrc/x.h"` works), `-D` for the deps' defines,
    `defines` and `KDA_CUDA_ARCHS="sm_90a"`, then `copts`. With `--//tools/cuda:ptxas_verbose=1`
    (`--config=ptxas`) ptxas' per-kernel resource report (`-Xptxas -v`) is printed in the build log.
  * `:foo` -- `cc_library(srcs = [the objects], hdrs = hdrs with C++ header extensions (.cuh files only reach
    the nvcc actions), deps = deps + @cuda//:cudart_static + @cuda//:cuda_headers, alwayslink = True,
    linkstatic = True, defines = defines + ['KDA_CUDA_ARCHS="sm_90a"'])`. Depending on it links
    libcudart_static.a (+ -ldl -lpthread -lrt): no runtime dependency on libcudart.so.

Args:
  name: name of the cc_library.
  srcs: `.cu` files; each one is its own action, so split kernels across files to compile them in parallel.
  hdrs: headers (`.h`, `.cuh`, ...) of this library; all are inputs of every nvcc action.
  deps: cc_library targets whose headers/defines the `.cu` files use; linked into dependents too.
  copts: extra nvcc flags (appended last).
  defines: extra `-D` values, for nvcc and for dependents.
  archs: SASS targets such as `["sm_90a"]` (default: flags.bzl's CUDA_ARCHS).
  **kwargs: `visibility`, `tags`, `testonly` ... passed to the cc_library.

Example:
    load("//tools/cuda:defs.bzl", "cuda_library")
    cuda_library(name = "kda_cuda", srcs = glob(["csrc/*.cu"]), hdrs = glob(["csrc/*.h", "csrc/*.cuh"]))
"""

load("//tools/cuda/private:rules.bzl", "cuda_library_macro")

cuda_library = cuda_library_macro
