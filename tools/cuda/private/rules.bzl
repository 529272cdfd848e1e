"""Implementation of cuda_library: one nvcc action per .cu, wrapped in a cc_library."""

load("@rules_cc//cc:defs.bzl", "cc_library")
load(
    "//tools/cuda/private:flags.bzl",
    "BoolSettingInfo",
    "CUDA_ARCHS",
    "NVCC_COPTS",
    "PTXAS_VERBOSE_COPTS",
    "archs_define",
    "gencode_flags",
)

# Header extensions cc_library accepts in hdrs; other headers (.cuh) only feed the nvcc actions.
_CC_HDR_EXTS = (".h", ".hh", ".hpp", ".hxx", ".inc", ".inl", ".ipp", ".tcc")

def _basename_no_ext(f):
    return f.basename[:-(len(f.extension) + 1)] if f.extension else f.basename

def _under(out_dir, root):
    return out_dir + "/" + root if root else out_dir

def _cuda_objects_impl(ctx):
    cc_toolchain = ctx.attr._cc_toolchain[cc_common.CcToolchainInfo]
    host_cc = cc_toolchain.compiler_executable
    nvcc = ctx.file._nvcc

    comp_ctxs = [d[CcInfo].compilation_context for d in ctx.attr.deps if CcInfo in d]
    headers = depset(ctx.files.hdrs, transitive = [c.headers for c in comp_ctxs])

    # nvcc has no -iquote: every include root becomes -I. The target's repository root and the output roots under
    # it make `#include "kda/csrc/..."` work for sources and generated headers alike, in this workspace (root ".")
    # and where another workspace depends on this one (root "external/<name>").
    root = ctx.label.workspace_root
    inc_dirs = [root or ".", _under(ctx.genfiles_dir.path, root), _under(ctx.bin_dir.path, root)]
    defines = []
    for c in comp_ctxs:
        inc_dirs += c.quote_includes.to_list() + c.includes.to_list() + c.system_includes.to_list()
        defines += c.defines.to_list()
    seen = {}
    inc_flags = []
    for d in inc_dirs:
        if d not in seen:
            seen[d] = True
            inc_flags.append("-I" + d)

    archs = ctx.attr.archs or CUDA_ARCHS
    base_flags = gencode_flags(archs) + NVCC_COPTS + ["-ccbin", host_cc] + inc_flags
    base_flags += ["-D" + d for d in defines + [archs_define(archs)] + ctx.attr.defines]
    if ctx.attr._ptxas_verbose[BoolSettingInfo].value:
        base_flags += PTXAS_VERBOSE_COPTS
    base_flags += ctx.attr.copts

    host_dir = host_cc.rpartition("/")[0]
    env = {"PATH": (host_dir + ":" if host_dir else "") + "/usr/local/bin:/usr/bin:/bin"}

    objs = []
    for src in ctx.files.srcs:
        obj = ctx.actions.declare_file("_cuda_objs/%s/%s.pic.o" % (ctx.label.name, _basename_no_ext(src)))
        args = ctx.actions.args()
        args.add_all(base_flags)
        # Intermediate files beside the object, not in /tmp: nvcc names them by its process id, which is the same
        # in every sandbox's PID namespace, so two builds on one machine could delete each other's files.
        args.add_all(["--objdir-as-tempdir", "-c", src.path, "-o", obj.path])
        ctx.actions.run(
            executable = nvcc,
            arguments = [args],
            inputs = depset([src], transitive = [headers, depset(ctx.files._toolkit), cc_toolchain.all_files]),
            outputs = [obj],
            env = env,
            mnemonic = "CudaCompile",
            progress_message = "Compiling CUDA %s (%s)" % (src.short_path, ",".join(archs)),
        )
        objs.append(obj)
    return [DefaultInfo(files = depset(objs))]

cuda_objects = rule(
    implementation = _cuda_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = True),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "defines": attr.string_list(),
        "archs": attr.string_list(),
        "_nvcc": attr.label(default = Label("@cuda//:nvcc"), allow_single_file = True, cfg = "exec"),
        "_toolkit": attr.label(default = Label("@cuda//:toolkit"), allow_files = True),
        "_cc_toolchain": attr.label(default = Label("@bazel_tools//tools/cpp:current_cc_toolchain")),
        "_ptxas_verbose": attr.label(default = Label("//tools/cuda:ptxas_verbose")),
    },
    fragments = ["cpp"],
    doc = "Compiles each .cu in srcs with the toolkit's nvcc into a .pic.o (see //tools/cuda:defs.bzl).",
)

def cuda_library_macro(name, srcs = [], hdrs = [], deps = [], copts = [], defines = [], archs = [], visibility = None, **kwargs):
    cuda_objects(
        name = name + "_cu_objs",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps + [Label("@cuda//:cuda_headers")],
        copts = copts,
        defines = defines,
        archs = archs,
        visibility = ["//visibility:private"],
        tags = kwargs.get("tags", []),
    )
    cc_library(
        name = name,
        srcs = [":" + name + "_cu_objs"],
        hdrs = [h for h in hdrs if h.endswith(_CC_HDR_EXTS)],
        deps = deps + [Label("@cuda//:cudart_static"), Label("@cuda//:cuda_headers")],
        defines = defines + [archs_define(archs or CUDA_ARCHS)],
        alwayslink = True,
        linkstatic = True,
        visibility = visibility,
        **kwargs
    )
