"""Role runtime and client, in process: real `RoleRuntime`s (ingress, shared-memory pools, relays,
health servers) on loopback, talking to a real `Client`, built from a spec the way
`disagg up` builds them (`supervisor.plan_local` + `contract.write_topology`).

Each topology is started once per module and shared by the tests that use it; tests
leave the pipeline idle (every pool back to 0 bytes used) so the next one starts clean.
Every wait has a deadline; nothing asserts durations tighter than a generous bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch

from disagg_core import contract
from disagg_core.contract import Peer
from disagg_core.spec import parse_pipeline
from disagg_runtime.client import Client, RequestFailed, RequestTimeout
from disagg_runtime.local import ports, supervisor
from disagg_runtime.memory.pool import SHM_DIR, Pool
from disagg_runtime.relay import Ingress, connect
from disagg_runtime.role.health import fetch, scrape
from disagg_runtime.role.runtime import Handler, RoleRuntime
from disagg_runtime.wire import envelope
from tests.integration import pipeline_handlers as ph
from tests.integration.handler_pipelines import pipeline_doc
from tests.payload_checks import assert_bit_exact, raw_bytes, tensors_of
from tests.relay_rig import KEY, write_key
from tests.support import wait_for

WAIT = 15.0  # upper bound for anything that should happen "soon"
KiB = 1 << 10


# -- rig -----------------------------------------------------------------------------------


class Running:
    """In-process roles of one pipeline plus a client, started from a spec document."""

    def __init__(
        self,
        doc: dict[str, Any],
        *,
        handlers: dict[str, Handler] | None = None,
        relay: str = "shm",
    ) -> None:
        self.pipeline = parse_pipeline(doc)
        self.dir = tempfile.mkdtemp(prefix="disagg-it-")
        topology_file = os.path.join(self.dir, "topology.json")
        configs = supervisor.plan_local(self.pipeline, ports.free_ports(), topology_file)
        key_file = write_key(self.dir)
        configs = [dataclasses.replace(c, peer_key_file=key_file) for c in configs]
        contract.write_topology(configs[0].topology, topology_file)
        self.roles: dict[str, RoleRuntime] = {}
        self.client: Client | None = None
        try:
            for config in configs:
                handler = (handlers or {}).get(config.role)
                if handler is None:  # the spec's `pipeline_handlers:<name>`
                    handler = getattr(ph, self.pipeline.role(config.role).handler_attr)
                self.roles[config.role] = RoleRuntime(config, handler=handler, grace_s=5.0)
            for role in self.roles.values():
                role.start()
            topology = configs[0].topology
            entries = [
                Peer(n, (f"127.0.0.1:{self.roles[n].config.ingress_port}",))
                for n in topology.entry_roles
            ]
            self.client = Client(
                entries,
                topology.exit_roles,
                pipeline=self.pipeline.name,
                entry_relay=relay,
                reply_relay=relay,
                pool_size=32 << 20,
                timeout=self.pipeline.transport.request_timeout_seconds,
                key=KEY,
            )
        except BaseException:
            self.close()
            raise

    @property
    def c(self) -> Client:
        assert self.client is not None
        return self.client

    def submit(self, payload: Any, *, timeout: float | None = None) -> Any:
        """Submit and wait, never longer than the request timeout plus a margin."""
        future = self.c.submit_async(payload, timeout=timeout)
        return future.result(timeout=(timeout or self.c.timeout) + 5)

    def url(self, role: str, path: str) -> str:
        return f"http://127.0.0.1:{self.roles[role].config.metrics_port}{path}"

    def samples(self, role: str) -> dict[str, float]:
        status, body = fetch(self.url(role, "/metrics"), 5.0)
        assert status == 200, body
        return scrape(body)

    def used(self) -> dict[str, int]:
        return {name: role.pool.stats().used for name, role in self.roles.items()}

    def wait_idle(self, timeout: float = WAIT) -> None:
        """Every role's pool back to 0 bytes used and nothing queued or running."""
        wait_for(
            lambda: not any(self.used().values()) and all(r.idle() for r in self.roles.values()),
            timeout,
            message=lambda: f"idle roles; pools used: {self.used()}",
        )

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        stoppers = [  # in parallel: each stop waits a few poll intervals for its threads
            threading.Thread(target=role.stop, kwargs={"grace_s": 5.0})
            for role in self.roles.values()
        ]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join(timeout=WAIT)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.dir, "topology.json"))
            os.rmdir(self.dir)


@contextlib.contextmanager
def running(doc: dict[str, Any], **options: Any) -> Iterator[Running]:
    rig = Running(doc, **options)
    try:
        yield rig
    finally:
        rig.close()


def inside(t: torch.Tensor, region: torch.Tensor) -> bool:
    start = region.data_ptr()
    return start <= t.untyped_storage().data_ptr() < start + region.numel()


def mixed_payload() -> dict[str, Any]:
    """Tensors of many dtypes and shapes (some above the inline limit), scalars, nesting."""
    g = torch.Generator().manual_seed(3)
    return {
        "x": torch.randn(ph.BIG, generator=g),
        "factor": 2.0,
        "i": 7,
        "bf16": torch.randn(300, 257, generator=g).to(torch.bfloat16),
        "f8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "nested": [
            torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-8]).half(),
            {"ints": torch.randint(-128, 127, (1000,), dtype=torch.int8, generator=g)},
            {"mask": torch.tensor([True, False, True])},
        ],
        "tup": (torch.arange(10), "text", 3.5, None, True),
        "transposed": torch.randn(64, 80, generator=g).t(),
        "empty": torch.empty(0, 3),
        "big_i64": torch.randint(0, 1 << 40, (40 * KiB,), generator=g),
    }


def counter(samples: dict[str, float], outcome: str) -> float:
    return samples.get(f'disagg_requests_total{{outcome="{outcome}"}}', 0.0)


# -- linear pipeline: a -> b (scale) -> c, over shm and tcp relays -------------------------


@pytest.fixture(scope="module", params=["shm", "tcp"])
def linear(request: pytest.FixtureRequest) -> Iterator[Running]:
    relay = request.param
    doc = pipeline_doc(
        f"it-linear-{relay}",
        [("a", "identity"), ("b", "scale"), ("c", "identity")],
        [{"from": "a", "to": "b"}, {"from": "b", "to": "c"}],
        relay="auto" if relay == "shm" else "tcp",
    )
    with running(doc, relay=relay) as rig:
        yield rig


def test_round_trip_is_bit_exact(linear: Running) -> None:
    payload = mixed_payload()
    want = {**payload, "x": payload["x"] * 2.0, "transposed": payload["transposed"].contiguous()}

    got = linear.submit(payload)

    assert_bit_exact(got, want)
    linear.wait_idle()


def test_roles_advertise_their_load_to_their_senders(linear: Running) -> None:
    """b tells a (its sender) its workers, queue and pool (dispatch.py); a's relay to b
    holds what b said, as does the client's relay to the entry role a."""
    x = torch.ones(ph.BIG)
    assert torch.equal(linear.submit({"x": x, "i": 1})["x"], x * 2)
    report = linear.roles["b"]._load()
    assert report.workers == 4 and not report.draining
    assert report.pool_bytes == linear.roles["b"].pool.allocator.capacity
    assert report.service_s > 0  # it handled one
    a = linear.roles["a"]
    peers = a.peers["b"]
    view = a.relays.view(peers.kind, peers.endpoints()[0])
    assert view is not None and view.load.workers == 4 and view.load.pool_bytes == report.pool_bytes
    entry = linear.c.entries[0]
    view = linear.c.relays.view(entry.kind, entry.endpoints()[0])
    assert view is not None and view.load.workers == 4


def test_results_are_copies_valid_after_the_request(linear: Running) -> None:
    first = linear.submit(mixed_payload())
    snapshot = {k: v.clone() for k, v in first.items() if isinstance(v, torch.Tensor)}

    for t in tensors_of(first):  # not views of any pool: neither the client's nor a role's
        assert not inside(t, linear.c.pool.backing.tensor)
        for role in linear.roles.values():
            assert not inside(t, role.pool.backing.tensor)
    # later requests reuse every slot the first one passed through
    for i in range(4):
        noise = {"x": torch.full((ph.BIG,), -1.0 - i), "i": i, "big": torch.full((ph.BIG,), 9.0)}
        linear.submit(noise)

    for key, value in snapshot.items():
        assert torch.equal(raw_bytes(first[key]), raw_bytes(value)), key
    first["x"].add_(1)  # writable, owned by the caller
    linear.wait_idle()


def test_concurrent_requests_get_their_own_results(linear: Running) -> None:
    done_before = counter(linear.samples("c"), "done")

    def one(i: int) -> tuple[int, Any]:
        x = torch.full((ph.BIG + 512 * i,), float(i))  # a different size each: different slots
        return i, linear.submit({"x": x, "i": i, "tag": f"req-{i}"})

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, range(20)))

    for i, got in results:
        assert got["i"] == i and got["tag"] == f"req-{i}"
        assert got["x"].shape == (ph.BIG + 512 * i,)
        assert torch.equal(got["x"], torch.full_like(got["x"], 2.0 * i))
    linear.wait_idle()
    assert counter(linear.samples("c"), "done") - done_before == 20
    assert linear.c.in_flight == 0


def test_burst_of_async_requests(linear: Running) -> None:
    futures = [
        linear.c.submit_async({"x": torch.full((ph.BIG,), float(i)), "i": i}) for i in range(12)
    ]
    for i, future in enumerate(futures):
        got = future.result(timeout=WAIT)
        assert got["i"] == i and torch.equal(got["x"], torch.full((ph.BIG,), 2.0 * i))
    linear.wait_idle()


def test_health_readiness_and_metrics(linear: Running) -> None:
    linear.submit({"x": torch.ones(ph.BIG), "i": 0})
    linear.wait_idle()
    for name, role in linear.roles.items():
        assert fetch(linear.url(name, "/healthz"))[0] == 200
        assert fetch(linear.url(name, "/readyz"))[0] == 200
        assert fetch(linear.url(name, "/nope"))[0] == 404
        s = linear.samples(name)
        for key in (
            "disagg_pool_occupancy",
            "disagg_pool_bytes_used",
            "disagg_pool_bytes_total",
            "disagg_pool_free_slots",
            "disagg_inflight_requests",
            "disagg_queue_depth",
            "disagg_ingress_lanes",
            'disagg_requests_total{outcome="done"}',
            'disagg_requests_total{outcome="failed"}',
            "disagg_request_seconds_count",
        ):
            assert key in s, f"{name}: {key} missing from /metrics"
        assert s["disagg_pool_bytes_total"] == role.pool.stats().total > 0
        assert s["disagg_pool_bytes_used"] == 0
        assert s["disagg_pool_occupancy"] == 0.0
        assert s["disagg_pool_free_slots"] >= 1
        assert s["disagg_ingress_lanes"] >= 1  # its senders (the client, a role) took lanes
        assert s['disagg_requests_total{outcome="done"}'] >= 1
        assert s["disagg_request_seconds_count"] >= 1
    a, b, c = (linear.samples(n) for n in "abc")
    assert a['disagg_edge_bytes_total{direction="in",edge="client->a"}'] >= ph.BIG * 4
    assert a['disagg_edge_bytes_total{direction="out",edge="a->b"}'] >= ph.BIG * 4
    assert b['disagg_edge_bytes_total{direction="in",edge="a->b"}'] >= ph.BIG * 4
    assert c['disagg_edge_bytes_total{direction="in",edge="b->c"}'] >= ph.BIG * 4


# -- streaming: src -> gen (generator) -> post ----------------------------------------------


@pytest.fixture(scope="module")
def streaming() -> Iterator[Running]:
    doc = pipeline_doc(
        "it-stream",
        [("src", "identity"), ("gen", "stream"), ("post", "identity")],
        [{"from": "src", "to": "gen"}, {"from": "gen", "to": "post"}],
    )
    with running(doc) as rig:
        yield rig


def stream_input(i: int, n: int, **extra: Any) -> dict[str, Any]:
    return {"x": torch.full((ph.BIG,), float(i)), "i": i, "n": n, **extra}


def check_chunks(chunks: list[Any], i: int, n: int) -> None:
    assert [c["k"] for c in chunks] == list(range(n))
    for k, c in enumerate(chunks):
        assert c["i"] == i and torch.equal(c["x"], torch.full((ph.BIG,), float(i + k)))


def test_stream_yields_chunks_in_order_then_ends(streaming: Running) -> None:
    chunks = list(streaming.c.stream(stream_input(1, 6), timeout=10))

    check_chunks(chunks, 1, 6)
    streaming.wait_idle()


def test_submit_on_a_streaming_pipeline_returns_the_chunks(streaming: Running) -> None:
    chunks = streaming.submit(stream_input(2, 4))

    assert isinstance(chunks, list)
    check_chunks(chunks, 2, 4)
    streaming.wait_idle()


def test_concurrent_streams_do_not_mix(streaming: Running) -> None:
    futures = [streaming.c.submit_async(stream_input(10 * i, 5)) for i in range(4)]

    for i, future in enumerate(futures):
        check_chunks(future.result(timeout=WAIT), 10 * i, 5)
    streaming.wait_idle()


def test_stream_failure_ends_the_stream_with_the_error(streaming: Running) -> None:
    got: list[Any] = []
    with pytest.raises(RequestFailed) as info:
        for chunk in streaming.c.stream(stream_input(3, 5, fail_after=2), timeout=10):
            got.append(chunk)

    assert not isinstance(info.value, RequestTimeout)
    assert info.value.role == "gen"
    assert "role gen" in str(info.value) and "boom mid-stream" in str(info.value)
    # the error may overtake chunks still passing through `post`, never reorder them
    assert [c["k"] for c in got] == list(range(len(got))) and len(got) <= 2
    streaming.wait_idle()


def test_chunks_are_handed_over_on_the_thread_that_receives_them(streaming: Running) -> None:
    """One wake-up per message: the ingress's I/O thread hands each chunk over itself (no
    second thread between it and the caller's `on_chunk`), and completes the future."""
    seen: list[str] = []
    _, future = streaming.c.start(
        stream_input(5, 3), on_chunk=lambda _: seen.append(threading.current_thread().name)
    )
    done: list[str] = []
    future.add_done_callback(lambda _: done.append(threading.current_thread().name))

    future.result(timeout=WAIT)
    assert seen == ["disagg-ingress"] * 3
    assert done == ["disagg-ingress"]
    streaming.wait_idle()


def test_empty_stream_submits_to_an_empty_list(streaming: Running) -> None:
    if list(streaming.c.stream(stream_input(4, 0), timeout=10)) != []:
        pytest.fail("stream() of an empty stream yielded chunks")
    assert streaming.submit(stream_input(4, 0)) == []


# -- fan-out / fan-in: src -> left, right, tap; left, right -> join --------------------------


@pytest.fixture(scope="module")
def fan() -> Iterator[Running]:
    doc = pipeline_doc(
        "it-fan",
        [
            ("src", "identity"),
            ("left", "left"),
            ("right", "right"),
            ("tap", "identity"),
            ("join", "join"),
        ],
        [
            {"from": "src", "to": "left"},
            {"from": "src", "to": "right"},
            {"from": "src", "to": "tap"},
            {"from": "left", "to": "join"},
            {"from": "right", "to": "join"},
        ],
    )
    with running(doc) as rig:
        yield rig


def test_fan_out_and_fan_in(fan: Running) -> None:
    futures = {
        i: fan.c.submit_async({"x": torch.full((ph.BIG,), float(i)), "i": i}) for i in range(8)
    }

    for i, future in futures.items():
        got = future.result(timeout=WAIT)
        assert set(got) == {"join", "tap"}  # one result per exit role
        assert got["join"]["i"] == i and got["tap"]["i"] == i
        assert torch.equal(got["join"]["sum"], torch.full((ph.BIG,), (i + 1) + 10.0 * i))
        assert torch.equal(got["tap"]["x"], torch.full((ph.BIG,), float(i)))
    fan.wait_idle()
    join = fan.samples("join")
    assert join['disagg_edge_bytes_total{direction="in",edge="left->join"}'] >= 8 * ph.BIG * 4
    assert join['disagg_edge_bytes_total{direction="in",edge="right->join"}'] >= 8 * ph.BIG * 4


# -- tensor references: a -> mid -> c, with cond.emb marked on a->mid for c ---------------------


@pytest.fixture(scope="module")
def refs() -> Iterator[Running]:
    doc = pipeline_doc(
        "it-refs",
        [("a", "identity"), ("mid", "skip_ref"), ("c", "needs_ref")],
        [
            {"from": "a", "to": "mid", "tensorRefs": [{"path": ph.REF_PATH, "to": "c"}]},
            {"from": "mid", "to": "c"},
        ],
    )
    with running(doc) as rig:
        yield rig


def ref_input(i: int, **extra: Any) -> dict[str, Any]:
    emb = torch.randn(2 * ph.BIG, generator=torch.Generator().manual_seed(i))  # 512 KiB
    return {"x": torch.full((1024,), float(i)), "i": i, "cond": {"emb": emb, "k": i}, **extra}


def test_tensor_ref_skips_the_middle_role(refs: Running) -> None:
    mid_in = refs.samples("mid").get('disagg_edge_bytes_total{direction="in",edge="a->mid"}', 0)
    payload = ref_input(1)

    got = refs.submit(payload)  # skip_ref raises if it sees cond.emb; needs_ref if it is missing

    assert_bit_exact(got, payload)  # back at the same path, bit for bit
    emb_bytes = payload["cond"]["emb"].numel() * 4
    mid = refs.samples("mid")
    c = refs.samples("c")
    assert mid['disagg_edge_bytes_total{direction="in",edge="a->mid"}'] - mid_in < emb_bytes
    assert c['disagg_edge_bytes_total{direction="in",edge="a->c"}'] >= emb_bytes
    assert counter(mid, "failed") == 0 and counter(c, "failed") == 0
    refs.wait_idle()


def test_tensor_refs_of_concurrent_requests_meet_their_own_request(refs: Running) -> None:
    payloads = [ref_input(i, sleep=0.02 * (i % 3)) for i in range(8)]
    futures = [refs.c.submit_async(p) for p in payloads]

    for payload, future in zip(payloads, futures, strict=True):
        assert_bit_exact(future.result(timeout=WAIT), payload)
    refs.wait_idle()


def test_timeout_aborts_and_releases_a_parked_ref(refs: Running) -> None:
    consumer = refs.roles["c"]
    started = time.monotonic()
    future = refs.c.submit_async(ref_input(2, sleep=2.5), timeout=0.8)

    wait_for(lambda: consumer.pool.stats().used > 0, 1.0)  # the ref is parked at c
    with pytest.raises(RequestFailed) as info:
        future.result(timeout=WAIT)
    timed_out = time.monotonic() - started
    # c's join expires at the same deadline as the client and may report first; its error
    # should be a RequestTimeout too (see test_role_timeout_error_is_a_request_timeout)
    assert isinstance(info.value, RequestTimeout) or info.value.error["reason"] == "timeout"
    assert 0.7 <= timed_out < 1.6, f"RequestTimeout after {timed_out:.2f} s for a 0.8 s timeout"
    # the abort reaches c while mid is still sleeping: the parked slot goes at once
    wait_for(lambda: consumer.pool.stats().used == 0, 1.0)
    assert time.monotonic() - started < 2.4
    refs.wait_idle()  # and mid's slot once its handler returns
    assert refs.submit(ref_input(3))["i"] == 3


def test_failure_upstream_releases_a_parked_ref(refs: Running) -> None:
    consumer = refs.roles["c"]
    future = refs.c.submit_async(ref_input(4, sleep=0.3, fail=True))
    wait_for(lambda: consumer.pool.stats().used > 0, 1.0)

    with pytest.raises(RequestFailed) as info:
        future.result(timeout=WAIT)

    assert info.value.role == "mid" and "boom 4" in str(info.value)
    wait_for(lambda: consumer.pool.stats().used == 0, 2.0)
    refs.wait_idle()


def test_a_vanished_reply_pool_fails_the_request_without_killing_the_role() -> None:
    doc = pipeline_doc(
        "it-gone",
        [("a", "identity"), ("mid", "skip_ref"), ("c", "needs_ref")],
        [
            {"from": "a", "to": "mid", "tensorRefs": [{"path": ph.REF_PATH, "to": "c"}]},
            {"from": "mid", "to": "c"},
        ],
    )
    with running(doc) as rig:
        consumer = rig.roles["c"]
        try:
            # the client's reply pool disappears before any role attached it
            os.unlink(os.path.join(SHM_DIR, str(rig.c.pool.name)))
            future = rig.c.submit_async(ref_input(1, fail=True), timeout=1.0)
            with pytest.raises(RequestFailed):
                future.result(timeout=WAIT)

            # mid could not report its failure, but still told c to drop the parked ref (or
            # c's join expired at the deadline): either way c lets go and carries on
            wait_for(lambda: consumer.pool.stats().used == 0, 2.0)
            assert fetch(rig.url("c", "/healthz"))[0] == 200
            assert fetch(rig.url("mid", "/healthz"))[0] == 200
        finally:
            rig.roles.pop("c").stop(grace_s=0.2)


# -- errors and timeouts: a -> f (maybe_fail) -> c;  a -> s (slow) -> c ---------------------------


@pytest.fixture(scope="module")
def failing() -> Iterator[Running]:
    doc = pipeline_doc(
        "it-fail",
        [("a", "identity"), ("f", "maybe_fail"), ("c", "identity")],
        [{"from": "a", "to": "f"}, {"from": "f", "to": "c"}],
    )
    with running(doc) as rig:
        yield rig


def test_failing_handler_fails_only_its_request(failing: Running) -> None:
    before = {n: failing.samples(n) for n in ("f", "c")}
    started = time.monotonic()
    payloads = {
        i: {"x": torch.full((ph.BIG,), float(i)), "i": i, "fail": i % 3 == 0} for i in range(12)
    }
    futures: dict[int, Future[Any]] = {i: failing.c.submit_async(p) for i, p in payloads.items()}

    for i, future in futures.items():
        if i % 3:
            got = future.result(timeout=WAIT)
            assert got["i"] == i and torch.equal(got["x"], torch.full((ph.BIG,), float(i)))
            continue
        with pytest.raises(RequestFailed) as info:
            future.result(timeout=WAIT)
        exc = info.value
        assert not isinstance(exc, RequestTimeout)
        assert exc.role == "f"
        assert "role f" in str(exc) and f"ValueError: boom {i}" in str(exc)
        assert exc.error["type"] == "ValueError" and exc.error["replica"] == "0"
        assert exc.error["reason"] == "handler"
    assert time.monotonic() - started < 5.0  # failures come back at once, not by timeout

    failing.wait_idle()
    f, c = failing.samples("f"), failing.samples("c")
    assert counter(f, "failed") - counter(before["f"], "failed") == 4
    assert counter(f, "done") - counter(before["f"], "done") == 8
    assert (
        f['disagg_request_failures_total{reason="handler"}']
        - before["f"]['disagg_request_failures_total{reason="handler"}']
        == 4
    )
    assert counter(c, "done") - counter(before["c"], "done") == 8
    assert counter(c, "failed") == counter(before["c"], "failed")


def test_failure_message_names_the_role_for_an_always_failing_handler() -> None:
    doc = pipeline_doc("it-boom", [("boomer", "fail")], [])
    with running(doc) as rig:
        with pytest.raises(RequestFailed, match=r"role boomer .*ValueError: boom 5"):
            rig.submit({"x": torch.zeros(4), "i": 5})
        rig.wait_idle()


def test_role_timeout_error_is_a_request_timeout() -> None:
    """A role that reports the deadline passing (a fan-in or tensor-ref join expiring at the
    same moment as the client) must look the same to the caller as the client's own
    timeout; here a fake entry role reports it, deterministically."""
    pool = Pool.create(4 << 20, device="cpu", min_block=64 * KiB)
    ingress = Ingress("tcp://127.0.0.1:0", pool, key=KEY)
    entry = Peer("fake", (ingress.endpoint.removeprefix("tcp://"),))
    client = Client([entry], ["fake"], entry_relay="tcp", pool_size=4 << 20, timeout=10, key=KEY)
    relay = None
    try:
        future = client.submit_async({"i": 1})
        with ingress.recv(timeout=WAIT) as msg:
            meta = envelope.parse(msg.meta)
        error = {
            "role": "fake",
            "replica": "0",
            "reason": "timeout",
            "type": "",
            "message": "request timed out at role fake waiting for up",
        }
        relay = connect("tcp", meta.reply.endpoint, timeout=WAIT, key=KEY)
        failed = meta.with_(kind="error", source="fake", error=error)
        relay.send(None, request_id=meta.rid, meta=failed.to_json())
        with pytest.raises(RequestFailed) as info:  # the report arrived and failed the request
            future.result(timeout=WAIT)
        if info.value.error.get("reason") != "timeout":
            pytest.fail(f"the role's report did not arrive as sent: {info.value.error}")
        assert isinstance(info.value, RequestTimeout)
    finally:
        if relay is not None:
            relay.close()
        client.close()
        ingress.close()
        pool.close()


@pytest.fixture(scope="module")
def slow() -> Iterator[Running]:
    doc = pipeline_doc(
        "it-slow",
        [("a", "identity"), ("s", "slow"), ("c", "identity")],
        [{"from": "a", "to": "s"}, {"from": "s", "to": "c"}],
    )
    with running(doc) as rig:
        yield rig


def test_request_timeout_aborts_everywhere(slow: Running) -> None:
    c_done = counter(slow.samples("c"), "done")
    started = time.monotonic()
    future = slow.c.submit_async({"x": torch.ones(ph.BIG), "i": 1, "sleep": 1.5}, timeout=0.6)

    with pytest.raises(RequestTimeout) as info:
        future.result(timeout=WAIT)

    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 1.4, f"RequestTimeout after {elapsed:.2f} s for a 0.6 s timeout"
    assert isinstance(info.value, TimeoutError)
    slow.wait_idle()  # s frees its slot once the handler returns; nothing parked anywhere
    assert counter(slow.samples("c"), "done") == c_done  # the late result went nowhere
    assert slow.submit({"x": torch.ones(ph.BIG), "i": 2})["i"] == 2


def test_requests_within_the_timeout_run_concurrently(slow: Running) -> None:
    started = time.monotonic()
    futures = [
        slow.c.submit_async({"x": torch.ones(ph.BIG), "i": i, "sleep": 0.5}) for i in range(4)
    ]

    assert [f.result(timeout=WAIT)["i"] for f in futures] == [0, 1, 2, 3]
    assert time.monotonic() - started < 1.9  # concurrency 4: not 4 x 0.5 s one after another
    slow.wait_idle()


# -- draining: RoleRuntime.stop finishes what it holds -----------------------------------------


def test_stop_drains_in_flight_requests_then_releases_the_pool() -> None:
    doc = pipeline_doc("it-drain", [("a", "identity"), ("s", "slow")], [{"from": "a", "to": "s"}])
    with running(doc) as rig:
        s = rig.roles["s"]
        segment = os.path.join(SHM_DIR, str(s.pool.name))
        assert os.path.exists(segment)
        futures = [
            rig.c.submit_async({"x": torch.ones(ph.BIG), "i": i, "sleep": 1.0}) for i in range(2)
        ]
        wait_for(lambda: rig.samples("s")["disagg_inflight_requests"] == 2, 2.0)

        stopper = threading.Thread(target=s.stop, kwargs={"grace_s": 10.0})
        started = time.monotonic()
        stopper.start()
        wait_for(lambda: fetch(rig.url("s", "/readyz"))[0] == 503, 1.0)
        assert fetch(rig.url("s", "/healthz"))[0] == 200  # draining, still live

        assert [f.result(timeout=WAIT)["i"] for f in futures] == [0, 1]
        stopper.join(timeout=WAIT)
        assert not stopper.is_alive()
        assert time.monotonic() - started < 5.0  # left once idle, not at the end of the grace
        assert not os.path.exists(segment)
        del rig.roles["s"]  # stopped already
