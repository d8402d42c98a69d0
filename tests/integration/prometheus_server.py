"""A real Prometheus server (Debian's `prometheus` package) for the observability tests: its
own config, data directory and loopback port, stopped and removed afterwards; and the
few HTTP API calls the tests make (instant queries, alerts)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

BINARY = "prometheus"
PROMTOOL = "promtool"


def missing() -> str | None:
    """Why the server cannot run here, or None."""
    for tool in (BINARY, PROMTOOL):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install prometheus)"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Prometheus:
    """`prometheus` scraping `jobs` ({job: [(host:port, labels)]}) every second and
    evaluating `rules` (a rules file's text) every second."""

    def __init__(
        self, workdir: Path, jobs: dict[str, list[tuple[str, dict[str, str]]]], rules: str
    ) -> None:
        self.workdir = workdir
        (workdir / "rules.yaml").write_text(rules)
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "800ms",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(workdir / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": job,
                    "honor_labels": True,
                    "static_configs": [{"targets": [t], "labels": labels} for t, labels in targets],
                }
                for job, targets in jobs.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                BINARY,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus not ready")

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` gives now (NaN samples dropped: no data)."""
        data = self.api("query", query=expr)
        return [r for r in data["result"] if r["value"][1] not in ("NaN", "+Inf", "-Inf")]

    def firing(self) -> dict[str, dict[str, str]]:
        """The alerts firing now, by name, with their labels."""
        return {
            a["labels"]["alertname"]: a["labels"]
            for a in self.api("alerts")["alerts"]
            if a["state"] == "firing"
        }

    def diagnose(self) -> str:
        """Targets' health and rules' state, for a failing test's message."""
        targets = [
            (t["labels"].get("job"), t["scrapeUrl"], t["health"], t.get("lastError", ""))
            for t in self.api("targets")["activeTargets"]
        ]
        ruled = [
            (r["name"], r.get("health"), r.get("state", ""), r.get("lastError", ""))
            for g in self.api("rules")["groups"]
            for r in g["rules"]
        ]
        return f"targets {targets}; rules {ruled}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.log.close()
