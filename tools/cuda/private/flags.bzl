"""Every nvcc flag FlashKDA uses, in one place, and the Starlark build setting behind ptxas_verbose."""

# Target architectures. sm_90a: wgmma / setmaxnreg need the arch-specific variant.
CUDA_ARCHS = ["sm_90a"]

def gencode_flags(archs = CUDA_ARCHS):
    """-gencode pairs that embed SASS (no PTX) for each arch."""
    flags = []
    for arch in archs:
        num = arch[len("sm_"):]
        flags.append("-gencode=arch=compute_%s,code=sm_%s" % (num, num))
    return flags

# Flags on every .cu compile.
NVCC_COPTS = [
    "-std=c++17",
    "-O3",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-Xcompiler",
    "-fPIC",
]

# Added with --//tools/cuda:ptxas_verbose=1 (alias: --config=ptxas): ptxas prints registers / smem / spills
# per kernel to stderr, which Bazel shows in the build log ("INFO: From CudaCompile ...").
PTXAS_VERBOSE_COPTS = ["-Xptxas", "-v"]

def archs_define(archs = CUDA_ARCHS):
    """The define that tells build_info() which archs were compiled in."""
    return "KDA_CUDA_ARCHS=\\\"%s\\\"" % ",".join(archs)

BoolSettingInfo = provider(doc = "Value of a boolean build setting.", fields = ["value"])

def _bool_setting_impl(ctx):
    return [BoolSettingInfo(value = ctx.build_setting_value)]

bool_flag = rule(
    implementation = _bool_setting_impl,
    build_setting = config.bool(flag = True),
    doc = "A boolean command-line build setting (--//pkg:name=1/0/true/false).",
)
