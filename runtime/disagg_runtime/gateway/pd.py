"""OpenAI requests over engine roles, as pure functions: the route a pipeline's engines
give (`route_of`, in the contract: the operator writes it for the gateway), the bodies
sent to the prefill and decode engines, the engines' streamed chunks -> the gateway's
chunks, and an engine's error -> the client's error. The I/O (httpx, the scraper) is in `engines`.

A P/D request is two: the prefill engine gets the request with `max_tokens: 1` and
`kv_transfer_params: {do_remote_decode, transfer, decode, relay}` (docs/vllm.md); its
answer's `kv_transfer_params` go with the original request to that decode engine, which
streams the answer. A lone engine (no kv edge) gets the request once.
"""

from __future__ import annotations

import json
from typing import Any, Final

from disagg_core.contract import EngineRoute as EngineRoute  # re-exported
from disagg_core.contract import route_of as route_of
from disagg_runtime.gateway.errors import RETRY_AFTER_S, HttpError, bounded

FORWARDED: Final = ("max_tokens", "temperature", "top_p", "seed", "stop")
MAX_ERROR_BYTES: Final = 64 * 1024  # of an engine's error body, read to quote it


def is_chat(payload: dict[str, Any]) -> bool:
    return "messages" in payload


def engine_body(payload: dict[str, Any], model: str) -> dict[str, Any]:
    """What the engine gets for a parsed request (gateway/openai.py's payload)."""
    body: dict[str, Any] = {"model": model}
    if is_chat(payload):
        body["messages"] = payload["messages"]
    else:
        body["prompt"] = payload["prompt"]
    body.update({k: payload[k] for k in FORWARDED if k in payload})
    return body


def prefill_body(body: dict[str, Any], *, transfer: str, decode: str, relay: str) -> dict[str, Any]:
    """The prefill stage: one token, and the order to send the prompt's KV to `decode`."""
    params = {"do_remote_decode": True, "transfer": transfer, "decode": decode, "relay": relay}
    return {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}


def handed_off(answer: Any, role: str) -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill answer (what the decode engine loads)."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or not params:
        raise HttpError(
            502,
            f"engine role {role!r} answered the prefill without kv_transfer_params: is its "
            "KV connector configured (a kv edge)?",
            kind="role_failed",
            role=role,
        )
    if params.get("do_remote_prefill") is False:
        # the connector refused the hand-off (e.g. a decode endpoint not in its `decodes`):
        # decoding without the KV would recompute the prompt silently, so it is not tried
        why = str(params.get("error") or "no reason given")[:500]
        raise HttpError(
            502,
            f"engine role {role!r} refused the KV hand-off: {why}",
            kind="role_failed",
            role=role,
        )
    return params


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The answering stage, streamed with token ids and usage (the gateway counts them)."""
    out = {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def chunk_of(event: str, role: str) -> dict[str, Any] | None:
    """One SSE `data:` of an engine's stream -> the gateway's chunk (gateway/openai.py:
    text, token_ids, finish_reason, prompt_tokens); None for the end (`[DONE]`). An
    error event raises the client's error."""
    if event.strip() == "[DONE]":
        return None
    try:
        obj = json.loads(event)
    except ValueError as exc:
        raise HttpError(
            502, f"engine role {role!r} streamed malformed JSON: {exc}", kind="role_failed"
        ) from None
    if not isinstance(obj, dict):
        raise HttpError(502, f"engine role {role!r} streamed a non-object", kind="role_failed")
    if "error" in obj or obj.get("object") == "error":
        raise engine_error(role, int(_error_fields(obj).get("code") or 500), obj)
    chunk: dict[str, Any] = {"text": "", "token_ids": []}
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        chunk["prompt_tokens"] = usage["prompt_tokens"]
    choices = obj.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        chunk["text"] = text if isinstance(text, str) else ""
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            chunk["token_ids"] = ids
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            chunk["finish_reason"] = reason
    return chunk


def _error_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """vLLM's error body: `{"error": {...}}` (the OpenAI shape) or the older flat one."""
    inner = obj.get("error")
    return inner if isinstance(inner, dict) else obj


def engine_error(role: str, status: int, body: Any) -> HttpError:
    """An engine's refusal as the client's answer: its 4xx passes through (the request was
    wrong: status, message and param as the engine gave them), anything else is 502."""
    fields = _error_fields(body) if isinstance(body, dict) else {}
    message = fields.get("message")
    if not isinstance(message, str):
        message = bounded(str(body)) if body else f"HTTP {status}"
    param = fields.get("param") if isinstance(fields.get("param"), str) else None
    if 400 <= status < 500 and status not in (408, 429):
        kind = fields.get("type") if isinstance(fields.get("type"), str) else "invalid_input"
        return HttpError(status, message, kind=str(kind), param=param, role=role)
    if status == 429:
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        return HttpError(429, message, kind="overloaded", headers=retry, role=role)
    return HttpError(502, f"engine role {role!r} failed: {message}", kind="role_failed", role=role)


def parse_error_body(raw: bytes) -> Any:
    try:
        return json.loads(raw[:MAX_ERROR_BYTES])
    except ValueError:
        return raw[:MAX_ERROR_BYTES].decode("utf-8", "replace")
