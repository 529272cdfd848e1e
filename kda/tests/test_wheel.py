"""The wheel //kda:wheel as a non-Bazel user meets it: pip-installed into a fresh venv, imported from outside
the workspace. CPU test (CI): metadata, the compiled extension's import, and the CPU path against float64.
GPU test: the installed wheel's kernel equals the numerics twin bit for bit on one case.

The fresh venv gets torch (and what torch needs) through a .pth file pointing at the test interpreter's
site-packages, because downloading torch in a test is neither possible offline nor wanted; nothing else of the
test environment (PYTHONPATH, the runfiles' flash_kda) is visible to it.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

_WHEEL_NAME = re.compile(r"^flash_kda-(?P<version>[0-9.]+\+(g[0-9a-f]{7,40}|unknown))-(?P<py>cp\d+)-(?P=py)-linux_x86_64\.whl$")


def _wheel() -> Path:
    roots = [os.environ.get("RUNFILES_DIR", ""), os.environ.get("TEST_SRCDIR", ""), os.getcwd()]
    found = sorted({p for root in roots if root for p in glob.glob(os.path.join(root, "**", "kda", "wheel", "*.whl"),
                                                                    recursive=True)})
    assert len(found) == 1, f"expected one wheel from //kda:wheel in the runfiles, found {found}"
    return Path(found[0])


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, str]:
    """(the fresh venv's python, a working directory outside the workspace, the wheel's version)."""
    wheel = _wheel()
    match = _WHEEL_NAME.match(wheel.name)
    assert match, f"wheel name {wheel.name!r} does not carry version+commit and this interpreter's tags"
    assert match["py"] == f"cp{sys.version_info.major}{sys.version_info.minor}"
    root = tmp_path_factory.mktemp("wheel")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "torch_of_the_test_interpreter.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                          "--target", str(site), str(wheel)], capture_output=True, text=True)
    assert pip.returncode == 0, f"pip install of {wheel.name} failed:\n{pip.stdout}\n{pip.stderr}"
    work = root / "elsewhere"
    work.mkdir()
    return python, work, match["version"]


def _run(installed, code: str) -> str:
    python, work, _ = installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RUNFILES", "TEST_SRCDIR"))}
    env["PYTHONNOUSERSITE"] = "1"
    result = subprocess.run([str(python), "-c", textwrap.dedent(code)], cwd=work, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"the installed wheel failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_wheel_contents():
    with zipfile.ZipFile(_wheel()) as whl:
        names = set(whl.namelist())
        metadata = next(whl.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    for expected in ("flash_kda/__init__.py", "flash_kda/api.py", "flash_kda/_C.so", "flash_kda/py.typed"):
        assert expected in names
    assert "Requires-Dist: torch" in metadata
    assert not any(n.startswith(("kda/", "tests/")) for n in names)


def test_installed_wheel_imports_outside_the_workspace(installed):
    out = _run(installed, """
        import importlib.metadata, pathlib, flash_kda
        from flash_kda import _ext
        print(pathlib.Path(flash_kda.__file__).parent)
        print(importlib.metadata.version("flash_kda"))
        print(_ext.available(), flash_kda.build_info()["archs"] if _ext.available() else None)
    """)
    location, version, ext = out.splitlines()[:3]
    assert "venv" in location and "runfiles" not in location, location
    assert version == installed[2]
    assert ext.startswith("True"), f"flash_kda._C did not import from the wheel: {ext}"


def test_installed_wheel_cpu_path_matches_float64(installed):
    out = _run(installed, """
        import torch, flash_kda
        from flash_kda import reference
        g = torch.Generator().manual_seed(0)
        B, T, H, D = 1, 37, 2, 128
        r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
        q, k, v, gg, beta = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H)
        A_log, dt_bias = torch.randn(H, generator=g), torch.randn(H, D, generator=g)
        init = torch.randn(B, H, D, D, generator=g)
        out, fin = torch.empty_like(v), torch.empty_like(init)
        flash_kda.fwd(q, k, v, gg, beta, D ** -0.5, out, A_log, dt_bias, -5.0, initial_state=init, final_state=fin)
        ref_out, ref_fin = reference.reference_chunked(q, k, v, gg, beta, D ** -0.5, A_log, dt_bias, -5.0,
                                                       initial_state=init)
        rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
        print(rel(out, ref_out), rel(fin, ref_fin))
    """)
    err_out, err_state = map(float, out.split())
    assert err_out < 1e-2 and err_state < 7.5e-3, (err_out, err_state)  # the matrix's bounds


@pytest.mark.gpu
def test_installed_wheel_kernel_equals_twin(installed):
    out = _run(installed, """
        import torch, flash_kda
        from flash_kda import numerics
        g = torch.Generator(device="cuda").manual_seed(0)
        B, T, H, D = 1, 300, 4, 128
        r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
        q, k, v, gg, beta = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H)
        A_log = torch.randn(H, generator=g, device="cuda")
        dt_bias = torch.randn(H, D, generator=g, device="cuda")
        init = torch.randn(B, H, D, D, generator=g, device="cuda")
        out, fin = torch.empty_like(v), torch.empty_like(init)
        flash_kda.fwd(q, k, v, gg, beta, D ** -0.5, out, A_log, dt_bias, -5.0, initial_state=init, final_state=fin)
        twin_out, twin_fin = numerics.twin_forward(q, k, v, gg, beta, D ** -0.5, A_log, dt_bias, -5.0,
                                                   initial_state=init)
        print(torch.equal(out, twin_out), torch.equal(fin, twin_fin))
    """)
    assert out.split() == ["True", "True"], out
