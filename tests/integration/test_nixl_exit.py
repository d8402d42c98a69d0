"""A process that starts a NIXL agent exits cleanly on an RDMA node (libibverbs1 and
ibverbs-providers installed; .ci/run installs them): before the fix in
relay/backends/nixl_libs.py, every such process died with SIGSEGV at exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.relay_rig import NIXL_MISSING
from tests.support import REPO

PROVIDERS = "/etc/libibverbs.d"


def _rdma_userspace_missing() -> str | None:
    if not os.path.isdir(PROVIDERS) or not os.listdir(PROVIDERS):
        return f"no verbs providers in {PROVIDERS} (apt-get install ibverbs-providers)"
    if not any(
        os.path.exists(os.path.join(d, "libibverbs.so.1"))
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64")
    ):
        return "no system libibverbs.so.1 (apt-get install libibverbs1)"
    return None


RDMA_MISSING = _rdma_userspace_missing()
pytestmark = [
    pytest.mark.skipif(NIXL_MISSING is not None, reason=f"no nixl: {NIXL_MISSING}"),
    pytest.mark.skipif(
        RDMA_MISSING is not None, reason=f"the crash needs RDMA userspace: {RDMA_MISSING}"
    ),
]

# one payload through the nixl relay, sender and receiver in this process, then a plain exit
RELAY_ROUND_TRIP = textwrap.dedent(
    """
    import queue, torch
    from disagg_runtime.memory.pool import MiB, Pool
    from disagg_runtime.relay import Ingress, auth, connect
    key = auth.new_key()
    got = queue.Queue()
    pool = Pool.create(8 * MiB, device="cpu")
    ingress = Ingress("tcp://127.0.0.1:0", pool, key=key, on_message=got.put)
    relay = connect("nixl", ingress.endpoint, key=key, timeout=30.0)
    relay.send({"x": torch.full((2 * MiB,), 7, dtype=torch.uint8)}, request_id="r")
    msg = got.get(timeout=30)
    assert int(msg.payload["x"].sum()) == 7 * 2 * MiB
    msg.release()
    relay.close()
    ingress.close()
    pool.close()
    print("moved", flush=True)
    """
)

BARE_AGENT = textwrap.dedent(
    """
    import nixl._api as api
    config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    api.nixl_agent("bare", config)
    print("made", flush=True)
    """
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )


def test_a_process_that_moved_bytes_through_nixl_exits_zero() -> None:
    done = _run(RELAY_ROUND_TRIP)
    assert "moved" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"


def test_the_bare_wheel_still_crashes_here_without_the_fix() -> None:
    """The control: this machine reproduces the crash, so the test above can fail. When a
    nixl wheel no longer crashes, this skips: nixl_libs.py can then go."""
    done = _run(BARE_AGENT)
    assert "made" in done.stdout, done.stderr[-2000:]
    if done.returncode == 0:
        pytest.skip("this nixl wheel exits cleanly without the workaround")
    assert done.returncode == -signal.SIGSEGV
