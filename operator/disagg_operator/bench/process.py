"""The operator under test as a child process: started, health-checked, its memory and CPU
read from /proc, its /metrics scraped, stopped (SIGTERM, then SIGKILL), its log counted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time
from typing import Final, TextIO

import aiohttp

from disagg_operator.bench.config import RETRY, BenchConfig, BenchError

MIB: Final = 1024 * 1024
STOP_GRACE: Final = 20.0  # seconds the operator gets to stop on SIGTERM


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process in MiB (empty where /proc does not tell)."""
    found: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024 / MIB  # kB
    return found


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of a process so far (None where /proc does not tell)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
        fields = text.rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return None


class OperatorProcess:
    """`disagg operator` for one namespace, as a child process."""

    def __init__(self, config: BenchConfig, namespace: str) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.argv = [
            config.python,
            "-m",
            "disagg_runtime.cli",
            "operator",
            "--standalone",
            f"--namespace={namespace}",
            f"--liveness-port={self.port}",
            f"--metrics-port={self.metrics_port}",
            "--log-level=warning",
        ]
        self.env = {**os.environ, "KUBECONFIG": config.kubeconfig}
        for variable in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
            self.env.pop(variable, None)  # the kubeconfig, not an in-cluster account
        if config.operator_log:
            self.log_path = pathlib.Path(config.operator_log)
        else:
            fd, name = tempfile.mkstemp(prefix="disagg-bench-operator-", suffix=".log")
            os.close(fd)
            self.log_path = pathlib.Path(name)
        self.keep_log = config.operator_log is not None
        self._log: TextIO | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.errors_logged = 0  # ERROR lines in its log (known after stop)

    def start(self) -> None:
        self._log = self.log_path.open("w")
        # its own session: a ^C at the terminal reaches the bench, which deletes its pipelines
        # while the operator still runs, then stops it
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdout=self._log, stderr=self._log, start_new_session=True
        )

    async def healthy(self, timeout: float) -> None:
        """Until /healthz answers 200 (BenchError if the process ends or time runs out)."""
        url = f"http://127.0.0.1:{self.port}/healthz"
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                self.check()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url) as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise BenchError(f"the operator was not healthy within {timeout:g} s")
                await asyncio.sleep(RETRY)

    def check(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise BenchError(
                f"the operator exited with {self.process.returncode}:\n{self.log_tail()}"
            )

    def memory(self) -> dict[str, float]:
        return {} if self.process is None else memory_mib(self.process.pid)

    def cpu_seconds(self) -> float | None:
        return None if self.process is None else cpu_seconds(self.process.pid)

    async def metrics(self) -> str | None:
        """Its Prometheus text (None when it does not answer)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        timeout = aiohttp.ClientTimeout(total=10)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url) as response,
            ):
                if response.status == 200:
                    return await response.text()
        return None

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        return ""

    async def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after STOP_GRACE; the exit status."""
        process = self.process
        code: int | None = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.to_thread(process.wait, STOP_GRACE)
                except subprocess.TimeoutExpired:
                    process.kill()
                    await asyncio.to_thread(process.wait)
            code = process.returncode
        if self._log is not None:
            self._log.close()
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
            self.errors_logged = sum(" ERROR " in line for line in text.splitlines())
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)
        return code
