"""The Python that ``gpumgr plugin install``'s launchers run: ``module.main()`` without ``site``'s start-up cost.

Kept apart from :mod:`gpumgr.plugin.install` (what install and uninstall change on a host): this
builds the code one launcher runs, from where the installed packages are imported now.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

PACKAGE = "gpumgr"
#: What a launcher says when its Python no longer finds gpumgr (``_e``: the ImportError, in its own code).
MOVED = ("gpumgr launcher: {_e}: gpumgr is not installed for this Python any more; "
         "run 'gpumgr plugin install' again with gpumgr's Python\n")

#: What each launcher imports: the folders of all go on ``sys.path``; the hook's are imported up front,
#: so a stale path is noticed while the ``site`` fall-back is still possible (``yaml`` is only read
#: by the CLI when a plugin config file exists).
HOOK_MODULE = "gpumgr.plugin.hook"
CLI_MODULE = "gpumgr.plugin.docker_gpu"
HOOK_IMPORTS = ("gpumgr.plugin", "gpumgr.wire", "msgpack")
HOOK_EAGER = ("msgpack",)
CLI_IMPORTS = ("gpumgr.plugin", "gpumgr.wire", "yaml")


def launcher_code(module: str, imports: tuple[str, ...], eager: tuple[str, ...] = ()) -> str:
    """Python for ``python -I -S -c``: run ``module.main()`` without the ``site`` start-up.

    ``site`` (every ``.pth`` file, the editable-install finder) is most of an interpreter's start-up
    time, and the hook starts one per GPU container created. The folders that hold the third-party
    ``imports`` go on the end of ``sys.path``, where ``site`` would put them; gpumgr's own packages
    are registered by folder (their ``__init__`` files hold only docstrings), because an editable
    install maps them from separate folders that no ``sys.path`` entry can express. If an import
    fails (gpumgr moved since ``gpumgr plugin install``), the launcher falls back to ``site``.
    """
    folders: list[str] = []
    packages: dict[str, str] = {}
    for name in imports:
        if name.partition(".")[0] == PACKAGE:
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):
                package = ".".join(parts[:depth])
                packages[package] = _package_folder(package)
            continue
        folder = _import_folder(name)
        if folder is not None and folder not in folders:
            folders.append(folder)
    preload = ", ".join((*eager, module))
    return (f"import sys\nsys.path.extend({json.dumps(folders)})\n"
            f"for _n, _p in {json.dumps(sorted(packages.items()))}:\n"
            f"    _m = type(sys)(_n)\n    _m.__path__ = [_p]\n    sys.modules[_n] = _m\n"
            f"    _up, _, _leaf = _n.rpartition('.')\n    if _up:\n        setattr(sys.modules[_up], _leaf, _m)\n"
            f"try:\n    import {preload}\n"
            f"except ImportError:\n"
            f"    for _n in [n for n in sys.modules if n.partition('.')[0] == {PACKAGE!r}]:\n"
            f"        del sys.modules[_n]\n"
            f"    import site\n    site.main()\n"
            f"    try:\n        import {module}\n"
            f"    except ImportError as _e:\n"
            f"        sys.stderr.write(f{MOVED!r})\n        sys.exit(127)\n"
            f"sys.exit({module}.main())\n")


def _package_folder(name: str) -> str:
    """The folder the installed package ``name`` is imported from."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not an importable package")
    return str(next(iter(spec.submodule_search_locations)))


def _import_folder(name: str) -> str | None:
    """The ``sys.path`` entry ``name`` is imported from here, or None if it is not importable."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package: its folder's parent
        return str(Path(next(iter(spec.submodule_search_locations))).parent)
    return str(Path(spec.origin).parent) if spec.origin else None
