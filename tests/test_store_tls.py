"""Several managers' store over TLS with client certificates (``etcds://``, ``--store-ca/-cert/-key``).

The store holds the join secret, so the README tells operators to serve etcd over TLS and to require
client certificates. This runs a real etcd member that does exactly that (certificates made here with
the ``openssl`` command, loopback only) and checks that a manager given the CA and its certificate
leads on it, that the CLI reads it with the same flags, and that a client without a certificate, or
one that does not verify the server, gets nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.control.etcdv3 import EtcdError
from gpumgr.manager.control.ha import describe
from gpumgr.manager.service import Manager
from tests.etcd import etcd_binary
from tests.ha_procs import shared_state
from tests.procs import ROOT, free_port, wait_for


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def certificates(folder: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, each signed by the CA."""
    folder.mkdir(mode=0o700)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=gpumgr test CA", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=gpumgr-{name}", cwd=folder)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext", cwd=folder)
    return {name: str(folder / name) for name in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


@pytest.fixture
def tls_etcd(tmp_path) -> Iterator[tuple[str, dict[str, str]]]:
    """One etcd member serving clients only over TLS and only with a certificate the test CA signed."""
    binary = etcd_binary()
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificates")
    files = certificates(tmp_path / "pki")
    client, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{client}"
    log = open(tmp_path / "etcd.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [binary, "--name", "tls", "--data-dir", str(tmp_path / "data"), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"tls=http://127.0.0.1:{peer}", "--cert-file", files["server.crt"],
         "--key-file", files["server.key"], "--client-cert-auth", "--trusted-ca-file", files["ca.crt"],
         "--log-level", "warn", "--auto-compaction-retention", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        store = f"etcds://127.0.0.1:{client}/tls"

        def answers() -> bool:
            try:
                describe(store, ca=files["ca.crt"], cert=files["client.crt"], key=files["client.key"])
                return True
            except (EtcdError, OSError):
                assert proc.poll() is None, (tmp_path / "etcd.log").read_text()
                return False

        wait_for(answers, 30, interval=0.2, what="the TLS etcd member to answer")
        yield store, files
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def test_a_manager_leads_on_an_etcd_that_requires_client_certificates(tls_etcd, tmp_path) -> None:
    store, files = tls_etcd
    manager = Manager(ManagerSettings(store=store, store_ca=files["ca.crt"], store_cert=files["client.crt"],
                                      store_key=files["client.key"], state_dir=shared_state(tmp_path, "m"),
                                      agents="tcp://127.0.0.1:0", advertise_api=f"http://127.0.0.1:{free_port()}"))
    manager.start()
    try:
        wait_for(lambda: manager.leading.loaded, 20, what="the manager to lead on the TLS store")
        # the CLI reads the same store with the same flags: the join secret came from etcd, over TLS
        status = subprocess.run([sys.executable, "-m", "gpumgr", "store", "status", "--store", store,
                                 "--store-ca", files["ca.crt"], "--store-cert", files["client.crt"],
                                 "--store-key", files["client.key"]], cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, status.stderr
        assert '"leader"' in status.stdout and manager.settings.advertise_api in status.stdout
    finally:
        manager.stop()
    # without a client certificate, or without the CA that verifies the server, etcd gives nothing
    with pytest.raises(EtcdError):
        describe(store, ca=files["ca.crt"])
    with pytest.raises(EtcdError):
        describe(store, cert=files["client.crt"], key=files["client.key"])
