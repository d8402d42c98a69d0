"""The three setups `disagg bench vllm` measures, each a set of local processes started
once, served from, and stopped before the next one starts (two engines take ~4 GB):

    disagg   `disagg up FILE --serve --fail-fast`: disagg's gateway, its prefill and decode
             engines and the DisaggConnector between them (what a user runs)
    nixl     two vLLM servers with vLLM's NixlConnector (`kv_both`, `kv_buffer_device:
             cpu`, UCX), behind the toy proxy protocol of bench/vllm/proxy.py
    single   one vLLM server, no disaggregation (the reference for outputs and speed)

Every engine takes the same arguments: the pipeline file's prefill role's `engine.args`
and env (contract/engine.py's `engine_args`, the derivation `disagg up` uses), so the
three differ only in how prefill and decode are split.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from disagg_core.contract import ENV
from disagg_core.contract.engine import VLLM_SERVER, engine_args, served_model
from disagg_core.spec import Pipeline
from disagg_runtime.local.ports import HOST, free_ports
from disagg_runtime.local.supervisor import _die_with_parent

START_S = 300.0
# the connectors' per-request hand-off histograms: (engine, metric) of each setup
DISAGG_METRICS = ("vllm:disagg_kv_send_seconds", "vllm:disagg_kv_load_seconds")
NIXL_METRICS = ("vllm:nixl_xfer_time_seconds", "vllm:nixl_post_time_seconds")
BYTES_METRICS = {"disagg": "vllm:disagg_kv_send_bytes", "nixl": "vllm:nixl_bytes_transferred"}


@dataclass
class Proc:
    """A process in its own group (its children stop with it), its output in `log`."""

    label: str
    argv: list[str]
    log: str
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(_die_with_parent, os.getpid()),  # never orphaned
            )

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError), open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
        return ""

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.label} exited with code {self.proc.returncode} (log {self.log}):\n"
                f"{self.tail()}"
            )

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):  # what outlived its leader
            os.killpg(self.proc.pid, signal.SIGKILL)


def wait_for(check: Callable[[], bool], procs: list[Proc], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        for p in procs:
            p.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench vllm: {what} not within {timeout_s:.0f} s")
        time.sleep(0.5)


def healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code == 200
    return False


def _health_of(url: str) -> Callable[[], bool]:
    return lambda: healthy(url + "/health")


def base_env(pipeline: Pipeline) -> dict[str, str]:
    """The environment engines get under `disagg up`: no disagg contract, the role's env."""
    contract = {var.name for var in ENV}
    env = {k: v for k, v in os.environ.items() if k not in contract}
    role = pipeline.role(pipeline.engine_roles[0])
    env.update({e.name: e.value for e in role.env if e.value_from is None})
    env["PYTHONUNBUFFERED"] = "1"
    return env


def engine_argv(pipeline: Pipeline, python: str, port: int) -> list[str]:
    """One engine's command line with the pipeline's engine arguments, no connector."""
    role = pipeline.role(pipeline.engine_roles[0])
    assert role.engine is not None
    return [
        python,
        "-m",
        VLLM_SERVER,
        "--model",
        role.engine.model,
        "--served-model-name",
        served_model(pipeline, role),
        "--host",
        HOST,
        "--port",
        str(port),
        *engine_args(dict(role.engine.args)),
    ]


@dataclass
class Setup:
    """What the bench needs of a running setup: where to send requests, which engines'
    /metrics hold the hand-off histograms, and how to stop it."""

    name: str
    workdir: str
    procs: list[Proc] = field(default_factory=list)
    url: str = ""  # the OpenAI base, http://HOST:PORT/v1
    engines: list[str] = field(default_factory=list)  # http://HOST:PORT of each engine
    metrics: tuple[str, ...] = ()

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def check(self) -> None:
        for p in self.procs:
            p.check()


def single(pipeline: Pipeline, python: str, workdir: str) -> Setup:
    port = next(free_ports())
    engine = Proc(
        "single engine",
        engine_argv(pipeline, python, port),
        os.path.join(workdir, "single.log"),
        base_env(pipeline),
    )
    setup = Setup(
        "single", workdir, [engine], f"http://{HOST}:{port}/v1", [f"http://{HOST}:{port}"]
    )
    engine.start()
    wait_for(lambda: healthy(setup.engines[0] + "/health"), [engine], "the engine", START_S)
    return setup


def nixl(pipeline: Pipeline, python: str, workdir: str) -> Setup:
    """Prefill and decode with vLLM's NixlConnector, and the toy proxy in front."""
    ports = free_ports()
    setup = Setup("nixl", workdir, metrics=NIXL_METRICS)
    kv = json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    )
    for name in ("prefill", "decode"):
        port = next(ports)
        env = base_env(pipeline) | {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(next(ports)),
        }
        argv = [*engine_argv(pipeline, python, port), "--kv-transfer-config", kv]
        setup.procs.append(
            Proc(f"nixl {name}", argv, os.path.join(workdir, f"nixl-{name}.log"), env)
        )
        setup.engines.append(f"http://{HOST}:{port}")
    proxy_port = next(ports)
    proxy = Proc(
        "nixl proxy",
        [
            sys.executable,
            "-m",
            "disagg_runtime.bench.vllm.proxy",
            "--prefill",
            setup.engines[0],
            "--decode",
            setup.engines[1],
            "--port",
            str(proxy_port),
        ],
        os.path.join(workdir, "nixl-proxy.log"),
        dict(os.environ),
    )
    setup.procs.append(proxy)
    setup.url = f"http://{HOST}:{proxy_port}/v1"
    try:
        for p in setup.procs:
            p.start()
        for url in setup.engines:
            wait_for(_health_of(url), setup.procs, url, START_S)
        wait_for(lambda: "proxy listening" in proxy.tail(), setup.procs, "the proxy", 30)
    except BaseException:
        setup.stop()
        raise
    return setup


def disagg(file: str, python: str, workdir: str, environ: dict[str, str]) -> Setup:
    """`disagg up FILE --serve`: its gateway's URL, and its engines' from its run record."""
    port = next(free_ports())
    up = Proc(
        "disagg up",
        [
            sys.executable,
            "-m",
            "disagg_runtime.cli",
            "up",
            file,
            "--serve",
            "--fail-fast",
            "--port",
            str(port),
            "--engine-python",
            python,
        ],
        os.path.join(workdir, "disagg-up.log"),
        dict(os.environ) | environ,
    )
    setup = Setup("disagg", workdir, [up], f"http://{HOST}:{port}/v1", metrics=DISAGG_METRICS)
    up.start()
    try:
        wait_for(lambda: "serving " in up.tail(), [up], "disagg up --serve", START_S)
        found = re.search(r"\(logs in (\S+)\)", up.tail(200))
        if found is None:
            raise RuntimeError(f"disagg up named no run directory:\n{up.tail()}")
        setup.engines = engine_urls(found.group(1))
    except BaseException:
        setup.stop()
        raise
    return setup


def engine_urls(run_dir: str) -> list[str]:
    """The engines' HTTP base URLs of a `disagg up` run, prefill first: each process its
    run record names, its `--port` read from its command line."""
    with open(os.path.join(run_dir, "run.json")) as f:
        record = json.load(f)
    urls = []
    for entry in sorted(
        record.get("processes", []), key=lambda e: not str(e["label"]).startswith("prefill")
    ):
        with open(f"/proc/{int(entry['pid'])}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        urls.append(f"http://{HOST}:{argv[argv.index('--port') + 1]}")
    if not urls:
        raise RuntimeError(f"no engine processes in {run_dir}/run.json")
    return urls
