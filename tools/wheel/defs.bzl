"""kda_wheel: a pip-installable wheel of a Python package and its compiled extension.

kda_wheel(name, srcs, strip_prefix, distribution, version_from, requires = [], summary = "")

  Generates `:<name>`, a directory output `<name>/` holding one file
  `<distribution>-<version>+g<commit>-cpXY-cpXY-<platform>.whl`: `srcs` (Python files, the extension `.so`, data
  such as `py.typed`) at their paths below `strip_prefix`, plus METADATA (`Requires-Dist` from `requires`),
  WHEEL and RECORD. The version is the `__version__` of the packed file `version_from` (a path below
  strip_prefix, e.g. "flash_kda/__init__.py"), with a local part naming the commit. The commit comes from Bazel's stable status (`STABLE_GIT_COMMIT`, printed by the
  workspace status command in .bazelrc); the Python tag is the toolchain interpreter's, which also built
  the extension. The wheel's name holds the commit, hence the directory output.
"""

def _kda_wheel_impl(ctx):
    out = ctx.actions.declare_directory(ctx.attr.name)
    prefix = ctx.attr.strip_prefix.rstrip("/") + "/"
    args = ctx.actions.args()
    args.add("--out_dir", out.path)
    args.add("--distribution", ctx.attr.distribution)
    args.add("--version_from", ctx.attr.version_from)
    args.add("--summary", ctx.attr.summary)
    args.add("--status", ctx.info_file.path)
    for req in ctx.attr.requires:
        args.add("--requires", req)
    for f in ctx.files.srcs:
        if not f.short_path.startswith(prefix):
            fail("%s is not below strip_prefix %s" % (f.short_path, prefix))
        args.add("--file", "%s=%s" % (f.short_path[len(prefix):], f.path))
    ctx.actions.run(
        executable = ctx.executable._builder,
        arguments = [args],
        inputs = ctx.files.srcs + [ctx.info_file],
        outputs = [out],
        mnemonic = "KdaWheel",
        progress_message = "Packing wheel %s" % ctx.label,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

kda_wheel = rule(
    implementation = _kda_wheel_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = True, mandatory = True),
        "strip_prefix": attr.string(mandatory = True),
        "distribution": attr.string(mandatory = True),
        "version_from": attr.string(mandatory = True),
        "requires": attr.string_list(),
        "summary": attr.string(),
        "_builder": attr.label(default = Label("//tools/wheel:build_wheel"), executable = True, cfg = "exec"),
    },
    doc = "A wheel of srcs below strip_prefix; see the module docstring.",
)
