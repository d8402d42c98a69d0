"""`disagg up examples/vllm-pd.yaml --serve` against one vLLM engine, through the `openai`
client: greedy fp32 answers through the gateway's P/D routing (prefill engine, KV over
the connector, decode engine) equal one engine's, streaming and not, for prompts of one
to several blocks; an error at the prefill stage reaches the client as an OpenAI error
with its status; concurrent requests reach the decode engine together (its continuous
batching is kept). The engines start once for the module: ~3 engines, ~6 GB.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from disagg_runtime.bench.vllm.run import PROMPTS
from tests.support import EXAMPLES
from tests.vllm import engines as E
from tests.vllm.test_vllm_pd import MAX_TOKENS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-vllm"  # spec.gateway.model of the example


class Served:
    """`disagg up FILE --serve` as a process; its engines found among its children."""

    def __init__(self, tmp: pathlib.Path, model: pathlib.Path) -> None:
        self.port = E.free_port()
        self.log = tmp / "up.log"
        env = os.environ | {
            "DISAGG_TINY_VLLM": str(model),
            "DISAGG_VLLM_PYTHON": str(E.PYTHON),
            "PYTHONPATH": str(E.ROOT),
        }
        argv = [sys.executable, "-m", "disagg_runtime.cli", "up", str(EXAMPLES / "vllm-pd.yaml")]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [*argv, "--serve", "--port", str(self.port), "--grace", "20"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + E.START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"disagg up exited:\n{self.tail()}"
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"not ready in {E.START_S} s:\n{self.tail()}")

    def engine_port(self, kv_role: str) -> int:
        """The HTTP port of the engine whose connector plays `kv_role` (from its argv)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            text = [a.decode(errors="replace") for a in argv]
            server = "vllm.entrypoints.openai.api_server" in text
            if server and any(kv_role in a for a in text) and _ppid(pid) == str(self.proc.pid):
                return int(text[text.index("--port") + 1])
        raise AssertionError(f"no {kv_role} engine under pid {self.proc.pid}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        return int(self.proc.returncode)


def _ppid(pid: str) -> str:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[1]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, E.Engine]]:
    E.require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-gateway")
    model = E.tiny_model(tmp / "model")
    served = Served(tmp, model)
    one = E.start("reference", model, tmp)
    try:
        E.wait_ready(one)
        served.wait_ready()
        yield served, one
    finally:
        one.stop()
        code = served.stop()
        leftovers = _engines_left(model)
        assert code == 0, served.tail()
        assert not leftovers, f"engines left running: {leftovers}"


def _engines_left(model: pathlib.Path) -> list[str]:
    """Processes of the served engines (their argv names the module's model) still alive."""
    left = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(model).encode() in cmd and MODEL.encode() in cmd:
                left.append(f"{pid}: {cmd[:120]!r}")
    return left


@pytest.fixture(scope="module")
def reference(rig: tuple[Served, E.Engine]) -> dict[str, tuple[str, int]]:
    _, one = rig
    out = {}
    for p in PROMPTS:
        r = httpx.post(
            one.url + "/completions",
            json={
                "model": str(one_model(one)),
                "prompt": p,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        out[p] = (body["choices"][0]["text"], body["usage"]["completion_tokens"])
    return out


def one_model(engine: E.Engine) -> str:
    r = httpx.get(engine.url + "/models", timeout=10)
    return str(r.json()["data"][0]["id"])


def client(served: Served) -> Any:
    import openai

    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_answers_equal_one_engine(
    rig: tuple[Served, E.Engine], reference: dict[str, tuple[str, int]]
) -> None:
    served, _ = rig
    c = client(served)
    got = {}
    for p in PROMPTS:
        answer = c.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        got[p] = (answer.choices[0].text, answer.usage.completion_tokens)
        assert answer.choices[0].finish_reason == "length"
    assert got == reference


def test_streamed_answers_equal_one_engine(
    rig: tuple[Served, E.Engine], reference: dict[str, tuple[str, int]]
) -> None:
    served, _ = rig
    c = client(served)
    got = {}
    for p in PROMPTS:
        stream = c.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, tokens, reasons = "", 0, []
        for event in stream:
            if event.choices:
                text += event.choices[0].text
                reasons.append(event.choices[0].finish_reason)
            if event.usage:
                tokens = event.usage.completion_tokens
        got[p] = (text, tokens)
        assert reasons[-1] == "length"
    assert got == reference


def test_an_error_at_the_prefill_stage_is_an_openai_error(rig: tuple[Served, E.Engine]) -> None:
    import openai

    served, _ = rig
    with pytest.raises(openai.BadRequestError) as caught:
        client(served).completions.create(model=MODEL, prompt="hello " * 700, max_tokens=4)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert isinstance(error, dict) and "maximum context length" in error["message"]
    assert error["role"] == "prefill"
    with pytest.raises(openai.NotFoundError):  # the gateway's own check, before any engine
        client(served).completions.create(model="other", prompt="x", max_tokens=1)


def test_concurrent_requests_reach_the_decode_engine_together(
    rig: tuple[Served, E.Engine],
) -> None:
    served, _ = rig
    metrics = f"http://127.0.0.1:{served.engine_port('kv_consumer')}/metrics"
    seen: list[tuple[float, float]] = []  # (running, waiting) at the decode engine
    done = threading.Event()

    def gauge(text: str, name: str) -> float:
        found = re.search(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.]+)", text, re.M)
        return float(found.group(1)) if found else 0.0

    def watch() -> None:
        while not done.is_set():
            text = httpx.get(metrics, timeout=5).text
            seen.append((gauge(text, "num_requests_running"), gauge(text, "num_requests_waiting")))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    c = client(served)

    def one(i: int) -> str:
        answer = c.completions.create(
            model=MODEL, prompt=f"request {i} " * 5, max_tokens=96, temperature=0
        )
        return str(answer.choices[0].finish_reason)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        reasons = list(pool.map(one, range(8)))
    done.set()
    watcher.join(timeout=10)
    assert reasons == ["length"] * 8
    # together: the gateway hands them on at once, not one after another (waiting counts
    # those whose KV is still landing); batched: the engine decodes several in one step.
    # How many run at once beyond that depends on how fast the KV lands against how fast a
    # 96-token decode ends on this machine's cores (CI, loaded: 2 of 8).
    changes = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
    at_engine = max((r + w for r, w in seen), default=0.0)
    assert at_engine >= 4, f"at most {at_engine} requests at the decode engine: {changes}"
    batched = max((r for r, _ in seen), default=0.0)
    assert batched >= 2, f"the decode engine never batched: {changes}"
