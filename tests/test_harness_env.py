"""The test suite does not read the user's ``GPUMGR_*`` environment (issue 33).

A user of ``docker gpu`` and the client exports ``GPUMGR_TOKEN`` and ``GPUMGR_MANAGER``, as the README
says; the in-process manager's settings would take that token and answer the tests' calls with 401.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import HARNESS_ENV

ROOT = Path(__file__).resolve().parent.parent
#: What a user of docker gpu and the client has exported (.ci/run exports the same for the whole run).
USER_ENV = {"GPUMGR_TOKEN": "a-users-own-token", "GPUMGR_MANAGER": "http://127.0.0.1:9"}


def test_no_gpumgr_variable_but_the_harness_own_reaches_a_test() -> None:
    assert {name for name in os.environ if name.startswith("GPUMGR_")} <= HARNESS_ENV


def test_an_in_process_manager_test_passes_with_the_users_token_exported(tmp_path) -> None:
    # the test the issue saw fail with 401, run by pytest as a user would run it, with the user's variables set
    test = "tests/test_openapi.py::test_a_created_container_and_the_map_match_the_document"
    env = {**os.environ, **USER_ENV}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
