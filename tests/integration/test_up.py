"""Role processes and `disagg up`: real `disagg role` processes on loopback, started by
`LocalPipeline` or by the `disagg up` command, signalled and killed like in production.

Role processes import `pipeline_handlers` by name: the tests put this folder on
PYTHONPATH. Every shared-memory check is by pipeline-name prefix or by pid, so segments
of anything else running on the machine do not matter. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg_core.spec import load_pipeline_file
from disagg_runtime import cli
from disagg_runtime.client import Client, RequestFailed
from disagg_runtime.local.supervisor import LocalPipeline, RoleProcess, remove_segments_of
from disagg_runtime.memory.pool import SHM_DIR, SHM_PREFIX
from disagg_runtime.role.health import fetch, scrape
from tests.support import wait_for

HERE = Path(__file__).resolve().parent
PIPELINES = HERE / "pipelines"
BIG = 64 * 1024  # float32 elements per request tensor, as in pipeline_handlers.BIG
WAIT = 20.0


def role_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


def disagg() -> list[str]:
    """The installed console script, else the module (same code)."""
    script = Path(sys.executable).with_name("disagg")
    return [str(script)] if script.exists() else [sys.executable, "-m", "disagg_runtime.cli"]


def segments(prefix: str = "", pid: int | None = None) -> set[str]:
    names = {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX + prefix)}
    if pid is not None:
        names = {n for n in names if re.search(rf"-{pid}-\d+$", n)}
    return names


def samples(port: int) -> dict[str, float]:
    try:
        status, body = fetch(f"http://127.0.0.1:{port}/metrics", 2.0)
    except OSError:
        return {}
    return scrape(body) if status == 200 else {}


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def role_children(parent: int) -> dict[int, dict[str, str]]:
    """{pid: DISAGG_* environment} of the `disagg role` processes whose parent is `parent`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == parent and b"disagg_runtime.cli" in cmdline and b"role" in cmdline:
            env = dict(e.decode().partition("=")[::2] for e in environ if e.startswith(b"DISAGG_"))
            found[int(entry)] = env
    return found


def ready(port: str | int) -> bool:
    with contextlib.suppress(OSError):
        return fetch(f"http://127.0.0.1:{port}/readyz", 1.0)[0] == 200
    return False


@contextlib.contextmanager
def local_pipeline(
    file: str, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> Iterator[tuple[LocalPipeline, Client]]:
    """A started, ready LocalPipeline and a client; everything stopped afterwards."""
    monkeypatch.setenv("PYTHONPATH", role_env()["PYTHONPATH"])  # children get os.environ
    local = LocalPipeline(load_pipeline_file(PIPELINES / file), grace_s=5.0, **options)
    client: Client | None = None
    try:
        local.start()
        local.wait_ready(timeout=30)
        client = local.client(timeout=WAIT)
        yield local, client
    finally:
        if client is not None:
            client.close()
        local.stop()
        shutil.rmtree(local.workdir, ignore_errors=True)  # role logs and topology file


def process_of(local: LocalPipeline, role: str) -> RoleProcess:
    return next(rp for rp in local.processes if rp.config.role == role)


def slow_input(i: int, sleep: float) -> dict[str, Any]:
    return {"x": torch.full((BIG,), float(i)), "i": i, "sleep": sleep}


# -- LocalPipeline: SIGTERM drains, SIGKILL fails in-flight requests ----------------------------


@pytest.mark.timeout(60)
def test_sigterm_drains_in_flight_requests_then_exits_clean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with local_pipeline("up-slow.yaml", monkeypatch) as (local, client):
        rp = process_of(local, "slow")
        pid = rp.proc.pid
        assert segments(pid=pid), "the role's pool is not in /dev/shm"
        futures = [client.submit_async(slow_input(i, 1.0)) for i in range(3)]
        wait_for(lambda: samples(rp.config.metrics_port).get("disagg_inflight_requests") == 3, 5)

        rp.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for i, future in enumerate(futures):  # what was in flight at `slow` still completes
            got = future.result(timeout=WAIT)
            assert got["i"] == i and torch.equal(got["x"], torch.full((BIG,), float(i)))
        assert rp.proc.wait(timeout=10) == 0
        assert time.monotonic() - signalled < 10  # drained, well inside its 30 s grace
        assert not segments(pid=pid), "the drained role left its pool in /dev/shm"
        assert "draining" in rp.log_tail(30)
    assert not segments("itest-up-slow-")


@pytest.mark.timeout(60)
def test_killed_role_fails_in_flight_requests_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    holder: list[Client] = []

    def died(rp: RoleProcess, code: int) -> None:  # what `disagg up` does (up.run_cli)
        if holder:
            holder[0].fail_all(f"role {rp.label} died (exit code {code})", role=rp.config.role)

    with local_pipeline("up-slow.yaml", monkeypatch, on_death=died) as (local, client):
        holder.append(client)
        rp = process_of(local, "slow")
        pid = rp.proc.pid
        futures = [client.submit_async(slow_input(i, 5.0)) for i in range(3)]
        wait_for(lambda: samples(rp.config.metrics_port).get("disagg_inflight_requests") == 3, 5)

        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for future in futures:
            with pytest.raises(RequestFailed) as info:
                future.result(timeout=WAIT)
            assert info.value.role == "slow"
            assert "slow/0 died" in str(info.value)
        assert time.monotonic() - killed < 3.0  # at once, not at the 20 s request timeout
        assert [d for d in local.deaths if d.startswith(f"slow/0 (pid {pid})")], local.deaths
    assert not segments(pid=pid)  # a killed process cannot unlink its pool: stop() did
    assert not segments("itest-up-slow-")
    assert all(p.proc.poll() is not None for p in local.processes)


# -- disagg up ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_up_json_summary(tmp_path: Path) -> None:
    """...and the same run's --report: one HTML file with the four charts."""
    file = PIPELINES / "up-linear.yaml"
    page = tmp_path / "report.html"
    args = ["up", str(file), "--requests", "20", "--concurrency", "4", "--json"]
    args += ["--report", str(page)]

    proc = subprocess.run(
        [*disagg(), *args], env=role_env(), capture_output=True, text=True, timeout=90
    )

    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert s["requests"] == 20 and s["completed"] == 20 and s["failed"] == 0
    assert 0 < s["p50_ms"] <= s["p99_ms"]
    assert s["throughput_rps"] > 0
    assert s["bytes_moved"] >= 3 * 20 * BIG * 4  # client->src, src->mid, mid->sink at least
    assert s["died"] == []
    assert [(e["from"], e["to"], e["relay"], e["messages"]) for e in s["edges"]] == [
        ("mid", "sink", "shm", 20),
        ("src", "mid", "tcp", 20),  # the edge's relay from the spec, not `auto`
    ]
    assert all(e["bytes"] >= 20 * BIG * 4 for e in s["edges"])
    assert set(s["roles"]) == {"src", "mid", "sink"}
    assert {n: r["replicas"] for n, r in s["roles"].items()} == {"src": 1, "mid": 2, "sink": 1}
    for name, r in s["roles"].items():
        assert r["completed"] == 20 and r["failed"] == 0, (name, r)
        assert r["mean_ms"] >= 0
    assert not segments("itest-up-linear-")
    html = page.read_text()
    for chart in ("latency", "throughput", "replicas", "split"):
        assert f'<img id="{chart}"' in html, chart
    assert html.count("data:image/png;base64,") == 4
    assert f"report written to {page}" in proc.stderr


def test_up_on_an_invalid_file_names_every_problem() -> None:
    file = str(PIPELINES / "invalid.yaml")

    proc = subprocess.run(
        [*disagg(), "up", file], env=role_env(), capture_output=True, text=True, timeout=30
    )

    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert f"{file}: spec.edges[0].to: unknown role 'nowhere'" in lines
    replicas = re.compile(rf"{re.escape(file)}: spec\.roles\[0\]\.replicas: .+")
    assert any(replicas.fullmatch(line) for line in lines), lines


def test_up_reports_whole_file_problems_like_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = str(tmp_path / "list.yaml")
    Path(file).write_text("- just\n- a list\n")

    up_status = cli.main(["up", file])  # the command's code, in process (no roles start)
    up_err = capsys.readouterr().err
    validate_status = cli.main(["validate", file])
    validate_out = capsys.readouterr().out

    assert up_status == validate_status == 1
    assert up_err.splitlines() == validate_out.splitlines()


CRASH_TIMEOUT = 2.0  # --timeout of the crash run: what a request left hanging would cost


@pytest.fixture(scope="module")
def crash_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """`disagg up` on a pipeline whose middle role exits (code 1) on request 5, run once
    (its run directory, kept for the logs, in a temporary XDG_RUNTIME_DIR)."""
    file = PIPELINES / "up-crash.yaml"
    args = ["up", str(file), "--requests", "16", "--concurrency", "4", "--json"]
    args += ["--grace", "1", "--timeout", str(CRASH_TIMEOUT)]
    env = role_env()
    env["XDG_RUNTIME_DIR"] = str(tmp_path_factory.mktemp("xdg"))
    return subprocess.run([*disagg(), *args], env=env, capture_output=True, text=True, timeout=60)


def test_up_reports_a_role_that_dies_mid_run(crash_run: subprocess.CompletedProcess[str]) -> None:
    assert crash_run.returncode == 1, crash_run.stderr
    s = json.loads(crash_run.stdout)
    assert len(s["died"]) == 1 and s["died"][0].startswith("dier/0 "), s["died"]
    assert "exited with code 1" in s["died"][0]
    assert s["failed"] >= 1 and s["completed"] + s["failed"] == s["requests"]
    assert any("role dier/0 died (exit code 1)" in e for e in s["errors"]), s["errors"]
    assert s["requests"] < 16  # nothing more was sent once the role died
    assert not segments("itest-up-crash-")  # the dead role's pool included
    logs = Path(s["logs"])  # the run directory stays for its logs, but is no run any more
    assert (logs / "dier-0.log").exists() and not (logs / "run.json").exists()
    assert not (logs / "peer-key").exists()  # the logs stay, not the pipeline's key
    assert str(logs) in crash_run.stderr  # and it says where they are


def test_up_fails_every_request_of_a_dead_pipeline_with_the_role_at_once(
    crash_run: subprocess.CompletedProcess[str],
) -> None:
    s = json.loads(crash_run.stdout)  # not JSON: an error, not this bug

    # the supervisor's notice, or the sender's own when its connection to dier broke first
    named = ("role dier/0 died", "could not send on: dier at ")
    assert all(any(n in e for n in named) for e in s["errors"]), s["errors"]
    assert s["elapsed_s"] < CRASH_TIMEOUT


@pytest.mark.timeout(60)
def test_up_gives_each_role_its_startup_seconds_to_become_ready() -> None:
    """Without --ready-timeout a role gets what its startup probe would allow on a cluster
    (startupSeconds), and the error names the role and that limit."""
    file = PIPELINES / "up-slow-start.yaml"
    started = time.monotonic()
    run = subprocess.run(
        [*disagg(), "up", str(file), "--requests", "1", "--grace", "1"],
        env=role_env(),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert run.returncode != 0
    assert "loader/0 (2 s)" in run.stderr and "startupSeconds" in run.stderr, run.stderr
    assert "fast/0" not in run.stderr.split("not ready in time")[-1]
    assert time.monotonic() - started < 40  # not the minute the import takes
    assert not segments("itest-up-slow-start-")


@pytest.mark.timeout(90)
def test_ctrl_c_stops_every_role_and_leaves_nothing() -> None:
    file = PIPELINES / "up-ctrlc.yaml"
    proc = subprocess.Popen(
        [*disagg(), "up", str(file), "--duration", "30", "--grace", "5"],
        env=role_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # the runner may ignore SIGINT (background job); `disagg up` must get the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    children: dict[int, dict[str, str]] = {}
    try:
        wait_for(lambda: len(children.update(role_children(proc.pid)) or children) == 2, 30)
        ports = [env["DISAGG_METRICS_PORT"] for env in children.values()]
        wait_for(lambda: all(ready(p) for p in ports), 30)
        # the client exists (its reply pool is named for the launcher): requests are flowing
        wait_for(lambda: bool(segments(f"itest-up-ctrlc-client-{proc.pid}-")), 10)
        wait_for(
            lambda: all(
                samples(int(p)).get('disagg_requests_total{outcome="done"}', 0) > 0 for p in ports
            ),
            10,
        )

        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        _, err = proc.communicate(timeout=15)

        assert proc.returncode == 130, err
        assert time.monotonic() - interrupted < 15
        assert "interrupted" in err
        wait_for(lambda: not any(alive(pid) for pid in children), 5)
        assert not segments("itest-up-ctrlc-")
        assert not segments(pid=proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        for pid in children:  # only if the test failed: leave nothing behind either way
            with contextlib.suppress(ProcessLookupError):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            remove_segments_of(pid)
        remove_segments_of(proc.pid)


def test_sigkilled_up_is_cleaned_up_by_the_next_run(tmp_path: Path) -> None:
    """`disagg up` SIGKILLed mid-run leaves its client pool and (here: a stopped role that
    cannot act on the SIGTERM its launcher's death sends) a role process and its pool. The
    next `disagg up` finds the run directory, kills the role, unlinks every segment and
    says so in one line; afterwards nothing of either run is left."""
    env = role_env()
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # the run directories of this test only
    runs = tmp_path / "disagg-runs"
    file = str(PIPELINES / "up-kill.yaml")
    first = subprocess.Popen(
        [*disagg(), "up", file, "--duration", "120"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children: dict[int, dict[str, str]] = {}
    try:
        wait_for(lambda: len(children.update(role_children(first.pid)) or children) == 2, 60)
        wait_for(lambda: all(ready(e["DISAGG_METRICS_PORT"]) for e in children.values()), 60)
        wait_for(lambda: bool(segments(f"itest-up-kill-client-{first.pid}-")), 30)
        (run,) = runs.iterdir()
        record = json.loads((run / "run.json").read_text())
        assert record["supervisor"] == first.pid
        assert {p["pid"] for p in record["processes"]} == set(children)
        sink = next(pid for pid, e in children.items() if e["DISAGG_ROLE"] == "sink")

        os.kill(sink, signal.SIGSTOP)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        time.sleep(1.0)  # the SIGTERM of the launcher's death is pending in the stopped sink
        assert alive(sink)
        assert segments(pid=sink)  # a live (stopped) owner: nobody else may unlink it

        second = subprocess.run(
            [*disagg(), "up", file, "--requests", "4"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert second.returncode == 0, second.stderr
        lines = [line for line in second.stderr.splitlines() if "cleaned up after" in line]
        assert len(lines) == 1, second.stderr
        assert f"cleaned up after 1 killed run(s) ({run.name})" in lines[0]
        assert f"sink/0 (pid {sink})" in lines[0]
        assert "shared-memory segment(s)" in lines[0]
        assert not alive(sink)
        assert not segments("itest-up-kill-")  # both runs' pools, the client's included
        assert not any(runs.iterdir())  # both run directories
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=5)
        for pid in children:  # only if the test failed: leave nothing behind either way
            with contextlib.suppress(ProcessLookupError):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            remove_segments_of(pid)
        remove_segments_of(first.pid)
