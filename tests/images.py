"""The test image, built without any registry: a static busybox with its applets and a /tmp.

Shared by the tests (tests/conftest.py, the throw-away engines) and the benchmarks (bench/harness.py),
so both run against the same image.
"""

from __future__ import annotations

import io
import shutil
import tarfile

IMAGE = "gpumgr-test/busybox:latest"
BUSYBOX_APPLETS = ("sh", "sleep", "echo", "cat", "env", "true", "false", "kill", "ls", "rm", "dd", "seq",
                   "nc", "timeout", "grep")


def busybox_tar(busybox: str | None = None) -> bytes:
    """An image tarball of a static busybox (``busybox`` or the one on PATH), for ``docker import``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(busybox or shutil.which("busybox") or "/bin/busybox", arcname="bin/busybox")
        for applet in BUSYBOX_APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(tmp)
    return buffer.getvalue()
