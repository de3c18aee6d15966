"""The docs' Quick start (``docs/install.md``), run as written: every ``sh`` block under it, in order, in one shell.

The README keeps the first of those blocks (install, ``gpumgr up``, the first ``curl``) under its own
Quick start; they must be the docs' first blocks word for word, so running the docs' runs the README's.

The blocks are found with markdown-it-py (the CommonMark parser rich itself uses), so a block is what
a reader sees as one. They run against a real ``gpumgr up`` on simulated GPUs and the real Docker
engine, with three adjustments that let the test share a machine, each a plain text substitution:

- ``pip install`` lines are not run: the test already runs in the environment gpumgr is installed in
  (it checks that the ``gpumgr`` command is there instead);
- the ``gpumgr up`` line is started in the background, its API on a free port, and every
  ``localhost:9400`` becomes that port;
- the walkthrough's container names get a suffix unique to this run, so that two runs on one engine
  never collide.

Then what the page says each step shows is checked against what it printed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests
from markdown_it import MarkdownIt

from tests.procs import ROOT, free_port, wait_for

pytestmark = pytest.mark.docker

README = ROOT / "README.md"
#: The page whose Quick start is the walkthrough; the README's Quick start is its beginning.
WALKTHROUGH = ROOT / "docs" / "install.md"
SECTION = "Quick start"
PORT = "9400"
NAMES = ("greedy", "neighbour")
#: What separates two blocks' output in the one shell's stdout.
MARK = "=== gpumgr-readme-block {} ==="


def quick_start_blocks(text: str) -> list[str]:
    """The ``sh`` code blocks of the level-2 section ``SECTION`` (its sub-sections included), in order."""
    tokens = MarkdownIt("commonmark").parse(text)
    blocks: list[str] = []
    inside = False
    for index, token in enumerate(tokens):
        if token.type == "heading_open" and token.tag == "h2":
            inside = tokens[index + 1].content.strip() == SECTION
        elif inside and token.type == "fence" and token.info.split()[:1] == ["sh"]:
            blocks.append(token.content)
    return blocks


def test_the_quick_start_has_its_blocks() -> None:
    """The extraction itself: a page without the section, or with its blocks renamed, must not pass as empty."""
    blocks = quick_start_blocks(WALKTHROUGH.read_text())
    assert len(blocks) >= 5 and any("gpumgr up" in b for b in blocks) and any("docker exec" in b for b in blocks)
    assert quick_start_blocks("## Quick start\n\n```python\nprint(1)\n```\n## Other\n\n```sh\nls\n```\n") == []


def test_the_readmes_quick_start_is_the_docs_beginning() -> None:
    """The README's Quick start blocks are the walkthrough's first blocks, as written, so the test below runs them."""
    readme, docs = quick_start_blocks(README.read_text()), quick_start_blocks(WALKTHROUGH.read_text())
    assert readme and any(re.match(r"^gpumgr up\b", line) for b in readme for line in b.splitlines()), readme
    assert docs[: len(readme)] == readme, "the README's Quick start must match the start of docs/install.md's"


def adapt(block: str, port: int, suffix: str) -> tuple[str, bool]:
    """The block as this test runs it, and whether it held the ``gpumgr up`` line (which it then leaves out)."""
    lines, starts = [], False
    for line in block.splitlines():
        command = line.split("#", 1)[0].strip()
        if command.startswith("pip install"):
            continue
        if re.match(r"^gpumgr up\b", command):
            starts = True
            continue
        lines.append(line)
    text = "\n".join(lines).replace(f"localhost:{PORT}", f"localhost:{port}")
    for name in NAMES:
        text = re.sub(rf"\b{name}\b", f"{name}-{suffix}", text)
    return text, starts


@pytest.fixture
def quick_start(tmp_path: Path, docker_client: Any, test_image: str) -> Any:
    """Start ``gpumgr up`` as the page's block does when the script reaches it; stop it and clean up after."""
    port = free_port()
    suffix = uuid.uuid4().hex[:8]
    procs: list[subprocess.Popen[bytes]] = []

    def start(line: str) -> None:
        # the command 'pip install .' puts beside this Python (tests/run also puts that folder on PATH)
        gpumgr = shutil.which("gpumgr", path=os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"])))
        assert gpumgr, "the gpumgr command is not installed: pip install -c constraints.txt -e '.[test]'"
        argv = shlex.split(line.split("#", 1)[0])[2:]
        env = {**os.environ, "GPUMGR_API": f"127.0.0.1:{port}", "GPUMGR_AGENTS": f"tcp://127.0.0.1:{free_port()}",
               "GPUMGR_STATE_DIR": str(tmp_path / "state"), "GPUMGR_NODE": f"readme-{suffix}",
               "GPUMGR_GPUS": "sim:2x24GiB", "GPUMGR_NETWORK_MODE": "none"}
        log = (tmp_path / "up.log").open("ab")
        procs.append(subprocess.Popen([gpumgr, "up", *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        wait_for(lambda: _ready(port, procs[0], tmp_path / "up.log"), 30, what="gpumgr up to have a ready node")

    yield port, suffix, start
    for proc in procs:
        proc.terminate()
        assert proc.wait(30) == 0, (tmp_path / "up.log").read_text()  # Ctrl-C / SIGTERM stops it cleanly
    for name in NAMES:
        subprocess.run(["docker", "rm", "-f", f"{name}-{suffix}"], capture_output=True)


def _ready(port: int, proc: subprocess.Popen[bytes], log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"gpumgr up exited with {proc.returncode}:\n{log.read_text()}")
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).json().get("nodes_ready") == 1
    except (requests.ConnectionError, ValueError):
        return False


def test_the_quick_start_runs_as_written(quick_start: Any, tmp_path: Path) -> None:
    port, suffix, start = quick_start
    outputs: dict[str, str] = {}
    for number, block in enumerate(quick_start_blocks(WALKTHROUGH.read_text())):
        script, starts = adapt(block, port, suffix)
        if starts:
            start(next(line for line in block.splitlines() if line.strip().startswith("gpumgr up")))
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                                timeout=120, cwd=tmp_path)
        assert result.returncode == 0, f"block {number} failed:\n{script}\n{result.stdout}\n{result.stderr}"
        outputs[block] = result.stdout
    check_what_the_comments_promise(outputs, suffix)


def json_values(text: str) -> list[Any]:
    """The JSON values printed one after another (curl adds no newline), skipping any other text between them."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while (position := _next_json(text, position)) < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
            values.append(value)
        except ValueError:
            position += 1
    return values


def _next_json(text: str, position: int) -> int:
    found = [i for i in (text.find("{", position), text.find("[", position)) if i >= 0]
    return min(found) if found else len(text)


def output_of(outputs: dict[str, str], words: str) -> str:
    return next(out for block, out in outputs.items() if words in block)


def check_what_the_comments_promise(outputs: dict[str, str], suffix: str) -> None:
    """What the README's comments say each step shows."""
    greedy, neighbour = (f"{name}-{suffix}" for name in NAMES)
    assert json_values(output_of(outputs, "/healthz"))[0]["status"] == "ok"

    created, _, nodes = json_values(output_of(outputs, "run greedy; run neighbour"))
    assert created["state"] == _["state"] == "running" and created["gpus"] == _["gpus"]  # binpack: one GPU
    gpu = next(g for n in nodes["nodes"] for g in n["gpus"] if g["uuid"] == created["gpus"][0]["uuid"])
    assert gpu["memory_reserved"] == 16 << 30 and gpu["memory_used"] == 4 << 30  # "memory_used 4GiB, ... 16GiB"

    overrun = output_of(outputs, "docker exec")
    killed, events = json_values(overrun)[:2]
    assert [(c["name"], c["state"], c["reason"]) for c in killed["containers"]] == [
        (greedy, "killed", "gpu_memory_exceeded")]
    assert killed["containers"][0]["detail"]["overrun"]["observed"] == 9 << 30  # "observed 9GiB"
    assert any(e["type"] == "killed" for e in events["events"])
    running = [line.split()[-1] for line in overrun[overrun.index("CONTAINER ID"):].splitlines()[1:]]  # docker ps
    assert neighbour in running and greedy not in running

    cleanup = output_of(outputs, "DELETE").strip().splitlines()
    assert cleanup[-1].startswith("CONTAINER ID")  # "nothing left": only docker ps's header
