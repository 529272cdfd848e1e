"""The layout of the extension's ``fwd`` arguments: what ``launch.run`` passes and what the binding reads (CPU).

``launch.run`` hands ``_C.fwd`` four plain tuples (kda/csrc/binding.cpp reads them item by item, without
conversions). A CPU machine never launches a kernel, so these tests make sure the two sides agree without one:

- the number of items of each tuple that ``launch.run`` builds (read from its source) equals the number the
  binding's signature declares;
- the binding accepts tuples of that layout: the call gets past argument parsing and fails only where it needs a
  CUDA device (device index -1 is never valid), not with a TypeError.
"""

from __future__ import annotations

import ast
import inspect
import re

import pytest

from flash_kda import _ext, launch


def _binding_arities() -> list[int]:
    """Items of fwd's tuple arguments (tensors, shape, launch) from the binding's signature."""
    signature = _ext.load().fwd.__doc__.splitlines()[0]
    tuples = re.findall(r"tuple\[([^\]]*)\]", signature)
    assert len(tuples) == 3, signature
    return [len(t.split(",")) for t in tuples]


def _launch_arities() -> list[int]:
    """Items of the tuples launch.run passes to C.fwd (tensors, shape, launch), from its source."""
    tree = ast.parse(inspect.getsource(launch.run).lstrip())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "fwd" and isinstance(node.func.value, ast.Name) and node.func.value.id == "C"]
    assert len(calls) == 1, "launch.run should call C.fwd once"
    args = calls[0].args
    assert len(args) == 4 and isinstance(args[0], ast.Tuple) and isinstance(args[1], ast.Tuple) and \
        isinstance(args[3], ast.Tuple), ast.dump(calls[0])[:200]
    return [len(args[0].elts), len(args[1].elts), len(args[3].elts)]


def test_launch_builds_the_tuples_the_binding_reads():
    assert _launch_arities() == _binding_arities()


def test_binding_parses_tuples_of_its_declared_layout():
    C = _ext.load()
    tensors_items, shape_items, launch_items = _binding_arities()
    # tensors: 5 input addresses, A_log and its type code, dt_bias and its type code, out, then (address, flag)
    # pairs for the states, cu_seqlens and the index tensors
    pairs = (tensors_items - 10) // 2
    tensors = (0,) * 5 + (0, 0, 0, 0, 0) + (0, False) * pairs
    assert len(tensors) == tensors_items
    # shape: B, T, N, heads, scale, lower_bound, P, key heads, gate, beta scale, then ints
    shape = (1, 16, 1, 1, 0.1, -5.0, 1, 1, 0, 1.0) + (0,) * (shape_items - 10)
    plan = C.choose_plan(16, 16, 1, 1, False, 132)
    with pytest.raises(RuntimeError):  # past the parsing: no valid CUDA device -1
        C.fwd(tensors, shape, plan, (0, 0, 0, 0, -1))
    with pytest.raises(TypeError):  # one item short is refused by the parser
        C.fwd(tensors[:-1], shape, plan, (0, 0, 0, 0, -1))
