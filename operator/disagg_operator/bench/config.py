"""The bench's settings, targets and errors (shared by its modules)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Final

from disagg_operator.bench.workload import Json, text_to_video_spec

TARGET_P50_S: Final = 1.0
TARGET_BURST_S: Final = 60.0
TARGET_RSS_MIB: Final = 200.0  # issue 4: up to 100 pipelines
TARGET_RSS_LARGE_MIB: Final = 250.0  # issue 20: 1,000 pipelines
LARGE_BURST: Final = 100  # bursts above this get the larger memory target
RETRY: Final = 0.2  # seconds between tries while the API server catches up (a new CRD)


def target_rss_mib(pipelines: int) -> float:
    return TARGET_RSS_MIB if pipelines <= LARGE_BURST else TARGET_RSS_LARGE_MIB


class BenchError(Exception):
    """The bench could not measure (no API server, the operator died, a timeout, ...)."""


class WaitTimeout(BenchError):
    """Something the bench waited for did not happen in time."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    kubeconfig: str  # a path, or several joined by os.pathsep (as in KUBECONFIG)
    samples: int = 20
    pipelines: int = 100
    namespace: str | None = None  # None: a fresh namespace, deleted at the end
    external_operator: bool = False
    spec: Json = field(default_factory=text_to_video_spec)
    timeout: float = 120.0  # seconds for any one wait
    steady: float = 30.0  # seconds of steady state measured after the burst (0: none)
    cleanup_timeout: float = 600.0  # seconds the clean-up may take
    operator_log: str | None = None
    python: str = sys.executable
