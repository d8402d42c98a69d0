"""The operator's liveness (/healthz) fails when it is stuck, and only then: a healthy operator
answers 200 with what it checked; one whose reconciles cannot end (its API requests hang)
answers 500, and so does one whose watches went silent (kopf's watch requests hang). The
emulator's faults, limited by User-Agent, make each of the two hang apart."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from disagg_operator.app import liveness, main
from tests.integration import operator_support as s
from tests.k8s.faults import Faults
from tests.k8s.server import EmulatorThread
from tests.support import free_port

pytestmark = pytest.mark.asyncio
STALL = 2.0  # seconds stuck before liveness fails (300 by default)
HANG = 60.0  # seconds each faulted request is held: longer than the test
# kopf re-asks its probe handlers at most every 10 s (a success is cached that long)
FAILS_WITHIN = 60.0


def healthz(port: int) -> tuple[int, str]:
    """The status and body of /healthz (0: no answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def assert_one_line_per_failure(caplog: pytest.LogCaptureFixture) -> None:
    """Each failed probe is kopf's one line with the reason; no traceback from aiohttp."""
    failed = [r for r in caplog.records if "stuck:" in r.getMessage()]
    assert failed and all(r.exc_info is None for r in failed)
    assert not [r for r in caplog.records if r.name == liveness.SERVER_LOGGER]


def operator_for(k8s: EmulatorThread, port: int) -> main.Operator:
    # BOOKMARKs well within the stall limit, as a cluster's (about one a minute) are within
    # the default 300 s: a quiet but healthy watch is heard from
    k8s.call(setattr, k8s.emulator, "bookmark_interval", STALL / 4)
    config = main.OperatorConfig(
        namespaces=(s.NS,),
        liveness_port=port,
        liveness_stall=STALL,
        metrics_port=0,
        standalone=True,
        connection=k8s.connection_info(),
    )
    return main.build(config)


async def answers(port: int, status: int, timeout: float) -> str:
    """Poll /healthz until it answers `status`; its body."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    seen: tuple[int, str] = (0, "")
    while loop.time() < deadline:
        seen = await asyncio.to_thread(healthz, port)
        if seen[0] == status:
            return seen[1]
        await asyncio.sleep(0.5)
    raise AssertionError(f"/healthz never answered {status} in {timeout} s; last {seen}")


async def test_healthy_operator_answers_what_it_checked(k8s: EmulatorThread, disagg_crd):
    k8s.apply_file(disagg_crd)
    port = free_port()
    async with s.run(operator_for(k8s, port)):
        doc = s.example()
        await s.call(k8s.create, doc, s.NS)
        name = doc["metadata"]["name"]
        await s.until(k8s, lambda: len(s.children(k8s, name)) == s.planned_children(doc), "apply")
        await asyncio.sleep(STALL * 2)  # longer than the stall limit: idle is not stuck
        report = json.loads(await answers(port, 200, s.WAIT))[liveness.PROBE_ID]
    assert report["work_pending"] == 0
    heard = report["watches_heard_s_ago"]
    assert set(heard) == {
        "disaggregatedpipelines",
        "statefulsets",
        "deployments",  # the gateway's
        "secrets",
        "networkpolicies",
        "pods",
    }


async def test_reconciles_that_cannot_end_fail_liveness(k8s: EmulatorThread, disagg_crd, caplog):
    k8s.apply_file(disagg_crd)
    port = free_port()
    async with s.run(operator_for(k8s, port)):
        await answers(port, 200, s.WAIT)
        # the operator's own requests hang; kopf's (its watches) go on
        hang = Faults(latency=(HANG, HANG), user_agents=("disagg-operator",))
        await s.call(k8s.call, setattr, k8s.emulator, "faults", hang)
        await s.call(k8s.create, s.example(), s.NS)
        body = await answers(port, 500, FAILS_WITHIN)
        await s.call(k8s.call, setattr, k8s.emulator, "faults", None)
    assert body  # kopf's error page; the reason is in the operator's log
    assert "without one ending" in caplog.text
    assert_one_line_per_failure(caplog)


async def test_silent_watches_fail_liveness(k8s: EmulatorThread, disagg_crd, caplog):
    k8s.apply_file(disagg_crd)
    port = free_port()
    operator = operator_for(k8s, port)
    operator.settings.watching.server_timeout = 1  # the server ends each watch after 1 s
    async with s.run(operator):
        await answers(port, 200, s.WAIT)
        # kopf's requests hang, so its watches are not renewed; the operator's own go on
        hang = Faults(latency=(HANG, HANG), user_agents=("kopf",))
        await s.call(k8s.call, setattr, k8s.emulator, "faults", hang)
        await answers(port, 500, FAILS_WITHIN)
        await s.call(k8s.call, setattr, k8s.emulator, "faults", None)
    assert "has been silent for" in caplog.text
    assert_one_line_per_failure(caplog)
