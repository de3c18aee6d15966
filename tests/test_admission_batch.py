"""Joins admitted off the link thread: bindings written in batches, each join answered only once it is on disk."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from gpumgr.manager.control.store import NODES_FILE
from gpumgr.manager.link.admission import Admission, JoinRefused
from gpumgr.wire import security
from gpumgr.wire.errors import GpumgrError


def join(admission: Admission, keys: security.KeyPair, node: str, outcomes: dict, done: threading.Event,
         expected: int) -> None:
    proof = security.join_proof(admission.join_secret(), keys.public, node)

    def settled(error: GpumgrError | None) -> None:
        on_disk = json.loads((admission.folder / NODES_FILE).read_text())["nodes"] if error is None else {}
        outcomes[node] = error or on_disk.get(node)
        if len(outcomes) == expected:
            done.set()

    admission.admit_later(keys.public, node, proof, settled)


def test_a_herd_is_written_in_batches_and_each_join_is_answered_once_on_disk(tmp_path, caplog) -> None:
    admission, outcomes, done, n = Admission(tmp_path), {}, threading.Event(), 300
    keys = {f"n{i:03d}": security.KeyPair.generate() for i in range(n)}
    with caplog.at_level(logging.INFO, logger="gpumgr.manager.link.admission"):
        for node, pair in keys.items():
            join(admission, pair, node, outcomes, done, n)
        assert done.wait(30)
    assert outcomes == {node: pair.public for node, pair in keys.items()}  # each saw its own binding on disk
    writes = [r for r in caplog.records if "with one write" in r.getMessage()]
    assert 1 <= len(writes) < n
    assert admission.nodes() == outcomes
    assert all(admission.node_of(pair.public) == node for node, pair in keys.items())
    # what a restarted manager reads back
    assert Admission(tmp_path).nodes() == outcomes


def test_a_pending_binding_admits_nobody_yet_and_clashes_are_refused_at_once(tmp_path) -> None:
    admission = Admission(tmp_path)
    first, other = security.KeyPair.generate(), security.KeyPair.generate()
    answers: list = []
    with admission._disk:  # the disk is slow: the binding stays pending while we look
        admission.admit_later(first.public, "a", security.join_proof(admission.join_secret(), first.public, "a"),
                              answers.append)
        assert admission.node_of(first.public) is None and answers == []
        admission.admit_later(other.public, "a", security.join_proof(admission.join_secret(), other.public, "a"),
                              answers.append)
        admission.admit_later(first.public, "b", security.join_proof(admission.join_secret(), first.public, "b"),
                              answers.append)
        admission.admit_later(other.public, "c", "not a proof", answers.append)
        assert [type(a) for a in answers] == [JoinRefused] * 3
        assert "bound to another agent's key" in answers[0].message
        assert "already bound to node 'a'" in answers[1].message
        assert "join token is wrong" in answers[2].message
        # the same agent asking again while it waits is answered with the first, once written
        admission.admit_later(first.public, "a", security.join_proof(admission.join_secret(), first.public, "a"),
                              answers.append)
        assert len(answers) == 3
    for _ in range(200):
        if len(answers) == 5:
            break
        threading.Event().wait(0.01)
    assert answers[3:] == [None, None]
    assert admission.node_of(first.public) == "a" and admission.node_of(other.public) is None


def test_an_admitted_agent_joining_again_is_answered_at_once(tmp_path) -> None:
    admission, pair = Admission(tmp_path), security.KeyPair.generate()
    admission.admit(pair.public, "a", security.join_proof(admission.join_secret(), pair.public, "a"))
    answers: list = []
    admission.admit_later(pair.public, "a", security.join_proof(admission.join_secret(), pair.public, "a"),
                          answers.append)
    assert answers == [None]


@pytest.mark.parametrize("key", ["", None])
def test_an_unauthenticated_peer_is_refused(tmp_path, key) -> None:
    admission, answers = Admission(tmp_path), []
    admission.admit_later(key or "", "a", "x", answers.append)
    assert isinstance(answers[0], JoinRefused)
