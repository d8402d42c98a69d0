"""The connector's scheduler half: which requests send or load, and when blocks are freed.

Prefill engine: a finished request whose `kv_transfer_params` ask for remote decode keeps
its blocks (`request_finished` returns True: the free is delayed) and becomes a `Send` in
the next step's metadata; its response's `kv_transfer_params` tell the gateway what the
decode engine will be sent. The blocks are freed when the worker reports the send done
(`get_finished` -> `update_connector_output`); `pending_push` keeps the engine stepping
until then, even with nothing else to run.

Decode engine: a request carrying a prefill's `kv_transfer_params` matches all its prompt
tokens past the locally cached prefix, loaded asynchronously (vLLM parks it until the
worker reports the load); once its blocks are allocated it becomes a `Load`. vLLM itself
recomputes the prompt's last token, whose logits the first decoded token needs.

Malformed params are refused per request (logged, naming the field). On a prefill engine
the refusal, like a decode endpoint it may not send to (peers.py), is the response's
`kv_transfer_params.error` (a request error for the gateway); on a decode engine the
request runs without a transfer (recomputed).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg_runtime.engines.vllm import params as kvp
from disagg_runtime.engines.vllm.layout import blocks_for
from disagg_runtime.engines.vllm.peers import DecodePeers
from disagg_runtime.engines.vllm.receiving import Load
from disagg_runtime.engines.vllm.sending import Send

log = logging.getLogger(__name__)


@dataclass
class StepOrders:
    """Scheduler -> worker, once per step (vLLM's KVConnectorMetadata payload)."""

    sends: list[Send] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # decode: loads whose request went


class SchedulerSide:
    """The state between a request's arrival, allocation, step and finish."""

    def __init__(self, engine_id: str, block_size: int, peers: DecodePeers | None = None) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        # the decode ingresses a prefill may send to (default: none, every send refused)
        self.peers = peers or DecodePeers(open_=False)
        self._orders = StepOrders()
        self._local: dict[str, int] = {}  # decode: locally cached tokens, by request
        self._sending: set[str] = set()  # prefill: sends not yet reported done
        self._loading: set[str] = set()  # decode: loads ordered, not yet reported done

    # -- decode ---------------------------------------------------------------------------

    def matched(
        self, req_id: str, params: Mapping[str, Any] | None, prompt: int, computed: int
    ) -> tuple[int, bool]:
        """(tokens to load, asynchronously) for a request with `computed` cached tokens."""
        order = _parsed(kvp.load_from, params, req_id)
        if order is None:
            return 0, False
        if order.tokens != prompt:
            log.error(
                "request %s: the prefill engine computed %d prompt tokens, this engine has %d"
                " (a different tokenizer or prompt?): recomputing",
                req_id,
                order.tokens,
                prompt,
            )
            return 0, False
        self._local[req_id] = computed
        count = prompt - computed
        return (count, True) if count > 0 else (0, False)

    def allocated(
        self,
        req_id: str,
        params: dict[str, Any] | None,
        block_ids: Sequence[int],
        external: int,
    ) -> None:
        """Blocks are allocated for `external` tokens to load: order the load."""
        if external == 0 or params is None:
            return
        order = _parsed(kvp.load_from, params, req_id)
        if order is None:
            return
        skip = self._local.pop(req_id, 0) // self.block_size
        want = blocks_for(order.tokens, self.block_size)
        self._orders.loads.append(Load(req_id, order, tuple(block_ids[skip:want]), skip))
        self._loading.add(req_id)
        params["do_remote_prefill"] = False  # loaded once, not again when rescheduled

    def loaded(self, req_ids: set[str] | None) -> None:
        """The worker reported these loads done (landed or failed)."""
        self._loading -= req_ids or set()

    def gone(self, req_id: str) -> None:
        """A decode request finished (or was aborted) while its load was pending: the
        worker forgets it, so a late arrival or the lease's expiry never touches blocks
        vLLM has given to another request since."""
        self._local.pop(req_id, None)
        if req_id in self._loading:
            self._loading.discard(req_id)
            self._orders.aborts.append(req_id)

    # -- prefill --------------------------------------------------------------------------

    def finished(
        self,
        req_id: str,
        params: Mapping[str, Any] | None,
        prompt: int,
        block_ids: Sequence[int],
        aborted: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        """(delay the free, kv_transfer_params for the response) of a finished request."""
        self._local.pop(req_id, None)
        if aborted:
            return False, None
        try:
            order = kvp.send_to(params)
        except kvp.ParamsError as exc:
            log.error("request %s: %s: not sent", req_id, exc)
            return False, kvp.refused(str(exc))
        if order is None:
            return False, None
        allowed = self.peers.check(order.decode)
        if allowed.reason is not None:
            log.error("request %s: %s", req_id, allowed.reason)
            return False, kvp.refused(allowed.reason)
        ids = tuple(block_ids[: blocks_for(prompt, self.block_size)])
        if len(ids) < blocks_for(prompt, self.block_size):
            why = f"the prompt's {prompt} tokens finished with only {len(ids)} blocks"
            log.error("request %s: %s", req_id, why)
            return False, kvp.refused(why)
        self._orders.sends.append(Send(req_id, order, ids, prompt))
        self._sending.add(req_id)
        return True, kvp.decode_params(order, prompt, self.engine_id)

    def sent(self, req_ids: set[str] | None) -> None:
        """The worker reported these sends done: vLLM frees their blocks now."""
        self._sending -= req_ids or set()

    @property
    def pending_push(self) -> bool:
        return bool(self._sending)

    def take(self) -> StepOrders:
        """This step's orders (and a fresh list for the next)."""
        orders, self._orders = self._orders, StepOrders()
        return orders


def _parsed(parse: Any, params: Mapping[str, Any] | None, req_id: str) -> Any:
    try:
        return parse(params)
    except kvp.ParamsError as exc:
        log.error("request %s: %s: serving it without a KV transfer", req_id, exc)
        return None
