"""Revision pairing with real parts: the compat token travels in the authenticated welcome
(an ingress advertises it, a sender validates it), and a role sends each request only to
downstream replicas whose token pairs with its own; with none, it is not ready."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from disagg_core import contract
from disagg_core.compat import Compat
from disagg_core.contract import Peer
from disagg_core.spec import parse_pipeline
from disagg_runtime.client import Client, RequestFailed
from disagg_runtime.local import ports, supervisor
from disagg_runtime.relay import RelayError
from disagg_runtime.role.runtime import RoleRuntime
from tests.integration.handler_pipelines import pipeline_doc
from tests.relay_rig import KEY, Rig, write_key
from tests.support import wait_for


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def test_the_welcome_carries_the_receivers_compat(rig: Rig) -> None:
    advertised = Compat("kv-2", frozenset({"kv-1"}))
    assert rig.sender("tcp", rig.ingress("tcp", compat=advertised)).peer_compat == advertised
    assert rig.sender("tcp", rig.ingress("tcp")).peer_compat is None


def test_a_malformed_compat_in_the_welcome_fails_the_connection(rig: Rig) -> None:
    ingress = rig.ingress("tcp", compat=Compat("not a token"))
    with pytest.raises(RelayError, match="field 'compat'"):
        rig.sender("tcp", ingress)


def _tagging(replica: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def handler(payload: dict[str, Any]) -> dict[str, Any]:
        return {**payload, "by": torch.tensor([replica])}

    return handler


class _Pair:
    """prefill (1 replica, or one per token in a list) -> decode (one replica per token),
    each with the compat it is given."""

    def __init__(
        self,
        prefill: str | list[str],
        decode: list[str],
        *,
        accepts: frozenset[str] = frozenset(),
        timeout: float = 10.0,
    ) -> None:
        doc = pipeline_doc("it-pairing", [("p", "identity"), ("d", "identity")])
        doc["spec"]["transport"]["requestTimeoutSeconds"] = timeout
        prefills = [prefill] if isinstance(prefill, str) else prefill
        doc["spec"]["roles"][0]["replicas"] = len(prefills)
        doc["spec"]["roles"][1]["replicas"] = len(decode)
        pipeline = parse_pipeline(doc)
        self.dir = tempfile.mkdtemp(prefix="disagg-pair-")
        topology_file = os.path.join(self.dir, "topology.json")
        configs = supervisor.plan_local(pipeline, ports.free_ports(), topology_file)
        contract.write_topology(configs[0].topology, topology_file)
        key_file = write_key(self.dir)
        self.roles: list[RoleRuntime] = []
        self.client: Client | None = None
        try:
            for config in configs:
                token = (prefills if config.role == "p" else decode)[config.replica]
                also = accepts if config.role == "p" else frozenset()
                config = dataclasses.replace(
                    config, peer_key_file=key_file, compat=token, compatible_with=also
                )
                handler = _tagging(config.replica) if config.role == "d" else _tagging(-1)
                self.roles.append(RoleRuntime(config, handler=handler, grace_s=2.0))
            for role in self.roles:
                role.start()
            self.prefill = self.roles[0]
            addresses = tuple(
                f"127.0.0.1:{r.config.ingress_port}" for r in self.roles if r.name == "p"
            )
            self.client = Client(
                [Peer("p", addresses)],
                ("d",),
                pipeline="it-pairing",
                entry_relay="shm",
                reply_relay="shm",
                timeout=timeout,
                key=KEY,
            )
        except BaseException:
            self.close()
            raise

    def served_by(self, n: int) -> set[int]:
        assert self.client is not None
        futures = [self.client.submit_async({"i": i}) for i in range(n)]
        return {int(f.result(timeout=30)["by"].item()) for f in futures}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for role in self.roles:
            role.stop(grace_s=2.0)


def test_requests_go_only_to_replicas_that_pair_and_the_rest_keep_serving() -> None:
    pair = _Pair("kv-2", ["kv-1", "kv-2", "kv-1"])
    try:
        assert pair.served_by(40) == {1}  # 40 request ids hash across all 3 otherwise
        assert pair.prefill._ready()
    finally:
        pair.close()


def test_without_a_partner_the_sender_is_not_ready_and_requests_fail_naming_why() -> None:
    pair = _Pair("kv-3", ["kv-1", "kv-2"], timeout=2.0)
    try:
        wait_for(lambda: not pair.prefill._ready(), 10.0, message="prefill not ready")
        with pytest.raises(RequestFailed, match="pairs with compat token 'kv-3'"):
            pair.served_by(1)
    finally:
        pair.close()


def test_a_declared_compatibility_list_lets_both_revisions_serve() -> None:
    pair = _Pair("kv-2", ["kv-1", "kv-2"], accepts=frozenset({"kv-1"}))
    try:
        assert pair.served_by(40) == {0, 1}
    finally:
        pair.close()


def test_a_draining_sender_hands_requests_waiting_for_a_partner_on_to_another_replica() -> None:
    """Requests waiting for a partner at a prefill replica that starts draining are handed
    back to the client at once (not held to the end of the drain and failed) and moved to
    the other prefill replica, which has a partner: every one is served."""
    pair = _Pair(["kv-3", "kv-2"], ["kv-1", "kv-2"], timeout=30.0)
    try:
        assert pair.client is not None
        futures = [pair.client.submit_async({"i": i}) for i in range(16)]
        wait_for(lambda: not pair.prefill.idle(), 10.0, message="a request waiting at p0")
        started = time.monotonic()
        pair.roles.remove(pair.prefill)  # stopped here, not again by close()
        pair.prefill.stop(grace_s=5.0)
        served = {int(f.result(timeout=20)["by"].item()) for f in futures}
        assert served == {1}  # the decode replica that pairs with p1's kv-2
        assert time.monotonic() - started < 10.0  # not the request's 30 s deadline
        assert pair.client.migrations >= 1
        text = pair.prefill.metrics.render().decode()
        handed = [
            ln for ln in text.splitlines() if ln.startswith("disagg_requests_handed_on_total")
        ]
        assert any('reason="handed_back"' in ln and not ln.endswith(" 0.0") for ln in handed)
    finally:
        pair.close()


def test_a_draining_sender_with_no_other_replica_fails_requests_naming_why() -> None:
    """A request waiting for a partner at a role that shuts down is not lost with the
    process (the client would time out after its whole deadline): handed back, it has no
    other replica to go to, and fails naming why, before the role exits."""
    pair = _Pair("kv-3", ["kv-1", "kv-2"], timeout=30.0)
    try:
        assert pair.client is not None
        future = pair.client.submit_async({"i": 0})
        wait_for(lambda: not pair.prefill.idle(), 10.0, message="the request at prefill")
        started = time.monotonic()
        pair.roles.remove(pair.prefill)  # stopped here, not again by close()
        pair.prefill.stop(grace_s=2.0)
        with pytest.raises(RequestFailed, match="draining") as failed:
            future.result(timeout=20)
        assert "pairs with compat token 'kv-3'" in str(failed.value)
        assert time.monotonic() - started < 10.0  # not the request's 30 s deadline
    finally:
        pair.close()


def test_readiness_answers_at_once_while_downstream_replicas_do_not() -> None:
    """4 downstream replicas that accept a connection and never answer the handshake (a
    CPU-starved pod, or one whose address blackholes): the pairing check used to ask them
    one after another inside /readyz, PROBE_S each (4.0 s measured, past the kubelet's
    default 1 s probe timeout, so the probe failed by timeout rather than by answer). It
    runs beside the probe now: /readyz answers from its last verdict at once."""
    import socket
    import urllib.error
    import urllib.request

    doc = pipeline_doc("it-pairing-slow", [("p", "identity"), ("d", "identity")])
    doc["spec"]["roles"][1]["replicas"] = 4
    pipeline = parse_pipeline(doc)
    folder = tempfile.mkdtemp(prefix="disagg-pair-")
    topology_file = os.path.join(folder, "topology.json")
    configs = supervisor.plan_local(pipeline, ports.free_ports(), topology_file)
    contract.write_topology(configs[0].topology, topology_file)
    silent = []
    for config in configs[1:]:  # the decode replicas: listening, never answering
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", config.ingress_port))
        sock.listen(16)
        silent.append(sock)
    config = dataclasses.replace(configs[0], peer_key_file=write_key(folder), compat="kv-1")
    role = RoleRuntime(config, handler=_tagging(-1), grace_s=0.5)
    try:
        role.start()
        url = f"http://127.0.0.1:{role.health.port}/readyz"
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(url, timeout=10).read()
            took.append(time.monotonic() - t0)
            assert err.value.code == 503  # no partner: not ready, said at once
        assert max(took) < 0.5, f"/readyz took {took} s"
    finally:
        role.stop(grace_s=0)
        for sock in silent:
            sock.close()
