"""`disagg role` with a short drain: what tests/integration/test_drain.py runs as a replica
process (the contract from the environment, like a pod; the grace period from argv)."""

from __future__ import annotations

import logging
import sys

from disagg_core.contract import from_environ
from disagg_runtime.role.runtime import RoleRuntime

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    RoleRuntime(from_environ(), grace_s=float(sys.argv[1])).run()
