"""Shim of rules_cc's cc/defs.bzl: re-exports Bazel's native C++ rules.

Used offline (Bazel 4.2.3 WORKSPACE mode, and the offline bzlmod check through --override_module), where the
real rules_cc cannot be fetched. Online Bazel 7+ users get the real module from the registry instead.
"""

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)
