"""The wheel holds every module and the dashboard's files: built, installed into a fresh virtual environment
and imported there module by module (an editable install, as the tests use, would hide a package missing
from ``[tool.setuptools] packages``; ``examples/swarm/build-image`` installs the wheel)."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.procs import ROOT

IMPORT_ALL = """
import importlib, pkgutil, sys
import gpumgr
assert "site-packages" in gpumgr.__file__ and "{root}" not in gpumgr.__file__, gpumgr.__file__
names = sorted(m.name for m in pkgutil.walk_packages(gpumgr.__path__, "gpumgr.") if not m.name.endswith("__main__"))
for name in names:
    importlib.import_module(name)
from importlib.resources import files
static = files("gpumgr.manager.api") / "static"
print(len(names), sorted(p.name for p in static.iterdir()))
"""


def test_the_wheel_installs_and_imports_every_module(tmp_path: Path) -> None:
    # built from a clean copy of the sources: setuptools reuses a build/ folder left in the tree, which would
    # hide a package missing from the list
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "gpumgr", "manager", "agent", "wire", "plugin"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (ROOT / name).is_dir() else {}))  # type: ignore[operator]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("gpumgr-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"gpumgr/{p.relative_to(ROOT / part).as_posix()}" if part == "gpumgr" else
               f"gpumgr/{part}/{p.relative_to(ROOT / part).as_posix()}"
               for part in ("gpumgr", "manager", "agent", "wire", "plugin") for p in (ROOT / part).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sources - shipped == set(), "modules missing from the wheel"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    # its dependencies come from this environment (appended after its own site-packages, so its gpumgr wins;
    # this environment's editable finder is not loaded: a .pth named by a path is not run)
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    Path(own, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    done = subprocess.run([str(python), "-c", IMPORT_ALL.replace("{root}", str(ROOT))], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    count, static = done.stdout.split(" ", 1)
    # every module but the root package itself and __main__
    assert int(count) == len(sources) - 2 and "index.html" in static, done.stdout
