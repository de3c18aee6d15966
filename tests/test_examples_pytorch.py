"""examples/pytorch: the grant arithmetic both scripts share, and that the scripts compile and read the grant.

PyTorch is not a dependency of gpumgr: the scripts import it only after their arguments are read, so
``--help`` runs here; the GPU checks (``.ci/gpu-check``) run ``train.py`` on a real GPU.
"""

from __future__ import annotations

import ast
import importlib.util
import py_compile
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

FOLDER = Path(__file__).resolve().parent.parent / "examples" / "pytorch"
SCRIPTS = ("train.py", "serve.py")
GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def grant() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_grant", FOLDER / "grant.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fraction_leaves_the_context_its_reserve_inside_the_grant(grant) -> None:
    assert grant.memory_fraction(2 * GiB, 80 * GiB) == pytest.approx((2 * GiB - 512 * MiB) / (80 * GiB))
    assert grant.memory_fraction(2 * GiB, 80 * GiB, reserve=0) == pytest.approx(2 / 80)
    assert grant.memory_fraction(512 * MiB, 80 * GiB) == pytest.approx(256 * MiB / (80 * GiB))  # at most half
    assert grant.memory_fraction(200 * GiB, 80 * GiB) == 1.0  # a grant past the GPU caps nothing
    with pytest.raises(ValueError):
        grant.memory_fraction(0, 80 * GiB)


def test_the_grant_is_read_from_gpumgr_gpu_memory(grant) -> None:
    assert grant.grant_bytes({"GPUMGR_GPU_MEMORY": str(3 * GiB)}) == 3 * GiB
    assert grant.grant_bytes({"GPUMGR_GPU_MEMORY": " 1024\n"}) == 1024
    for absent in ({}, {"GPUMGR_GPU_MEMORY": ""}, {"GPUMGR_GPU_MEMORY": "3GiB"}, {"GPUMGR_GPU_MEMORY": "0"}):
        assert grant.grant_bytes(absent) is None


def test_cap_allocator_sets_the_fraction_on_the_device(grant, monkeypatch) -> None:
    calls: list[tuple[float, int]] = []
    cuda = SimpleNamespace(get_device_properties=lambda device: SimpleNamespace(total_memory=80 * GiB),
                           set_per_process_memory_fraction=lambda fraction, device: calls.append((fraction, device)))
    torch = SimpleNamespace(cuda=cuda)
    monkeypatch.setenv("GPUMGR_GPU_MEMORY", str(4 * GiB))
    assert grant.cap_allocator(torch, 1) == pytest.approx((4 * GiB - 512 * MiB) / (80 * GiB))
    assert calls == [(pytest.approx((4 * GiB - 512 * MiB) / (80 * GiB)), 1)]
    assert grant.cap_allocator(torch, 0, grant=12 * GiB) == pytest.approx((12 * GiB - 512 * MiB) / (80 * GiB))
    monkeypatch.delenv("GPUMGR_GPU_MEMORY")
    assert grant.cap_allocator(torch, 0) is None and len(calls) == 2  # not under gpumgr: nothing capped


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_compiles_and_caps_the_allocator_before_using_the_gpu(script, tmp_path) -> None:
    path = FOLDER / script
    py_compile.compile(str(path), cfile=str(tmp_path / f"{script}c"), doraise=True)
    main = next(node for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.FunctionDef) and node.name == "main")
    calls = [(node.lineno, ast.unparse(node.func)) for node in ast.walk(main) if isinstance(node, ast.Call)]
    capped = [line for line, name in calls if name == "grant.cap_allocator"]
    placed = [line for line, name in calls if name.endswith(".to")]
    assert capped and placed and min(capped) < min(placed)  # capped before any model is put on the GPU


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_answers_help_without_pytorch(script) -> None:
    done = subprocess.run([sys.executable, str(FOLDER / script), "--help"], capture_output=True, text=True,
                          timeout=60, cwd=FOLDER)
    assert done.returncode == 0, done.stderr
    assert "--memory" in done.stdout and "GPUMGR_GPU_MEMORY" in done.stdout


def test_the_server_refuses_malformed_batches_with_a_reason(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(FOLDER))
    spec = importlib.util.spec_from_file_location("example_serve", FOLDER / "serve.py")
    assert spec is not None and spec.loader is not None
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    assert serve.rows_of(b'{"inputs": [%s]}' % str([0.5] * serve.INPUTS).encode()) == [[0.5] * serve.INPUTS]
    for body in (b"{}", b'{"inputs": []}', b'{"inputs": [[1, 2]]}', b'{"inputs": [["x"]]}', b"[1]"):
        with pytest.raises(ValueError):
            serve.rows_of(body)
