"""Shim of rules_python's python/defs.bzl: re-exports Bazel's native Python rules.

Used offline (Bazel 4.2.3 WORKSPACE mode, and the offline bzlmod check through --override_module), where the
real rules_python cannot be fetched. Online Bazel 7+ users get the real module from the registry instead.
"""

load("@bazel_tools//tools/python:toolchain.bzl", _py_runtime_pair = "py_runtime_pair")

def py_library(**attrs):
    native.py_library(**attrs)

def py_binary(**attrs):
    native.py_binary(**attrs)

def py_test(**attrs):
    native.py_test(**attrs)

def py_runtime(**attrs):
    native.py_runtime(**attrs)

def py_runtime_pair(name, py2_runtime = None, py3_runtime = None, **attrs):
    # native.py_runtime_pair does not exist; the rule lives in @bazel_tools.
    _py_runtime_pair(name = name, py2_runtime = py2_runtime, py3_runtime = py3_runtime, **attrs)
