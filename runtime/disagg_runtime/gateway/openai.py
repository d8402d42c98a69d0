"""The OpenAI-compatible API, as pure functions: request bodies -> the entry role's payload,
the pipeline's chunks -> completion objects. The HTTP side is in `app`.

The gateway does no tokenization. The entry role gets

    {"prompt": str} or {"messages": [{"role": str, "content": str}, ...]}
    + "max_tokens", "temperature", "top_p", "seed", "stop" where the client gave them

and the pipeline streams chunks `{"text": str, "token_ids": [int, ...] (or an int64 tensor),
"finish_reason": "stop" | "length" | null}`; a chunk may say `"prompt_tokens": n` (for
`usage`). `stop` is also applied here, on the text: the answer ends before the first stop
sequence (text that may begin one is held back until it cannot), and the rest of the
request is aborted, so a pipeline that ignores `stop` still honours it.

usage: completion_tokens = the token ids streamed (chunks without `token_ids` count one
each); prompt_tokens = the largest `prompt_tokens` a chunk reported (0 if none did).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg_runtime.gateway.native import InputError

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 256  # per sequence: bounds the text held back and the work per chunk
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class ModelNotFound(LookupError):
    """The request names a model this gateway does not serve."""


@dataclass(frozen=True)
class Sampling:
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()


def parse_completion(doc: Any, model: str, max_tokens: int = 0) -> tuple[dict[str, Any], Sampling]:
    """`/v1/completions` body -> (entry payload, how to answer)."""
    body = _object(doc)
    _model(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InputError("$.prompt", "expected a string (one prompt per request)")
    payload: dict[str, Any] = {"prompt": prompt}
    return _sampling(body, payload, default_max=DEFAULT_COMPLETION_TOKENS, most=max_tokens)


def parse_chat(doc: Any, model: str, max_tokens: int = 0) -> tuple[dict[str, Any], Sampling]:
    """`/v1/chat/completions` body -> (entry payload, how to answer)."""
    body = _object(doc)
    _model(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError("$.messages", "expected a non-empty list of messages")
    out = [_message(m, f"$.messages[{i}]") for i, m in enumerate(messages)]
    if "max_completion_tokens" in body and "max_tokens" not in body:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    return _sampling(body, {"messages": out}, default_max=None, most=max_tokens)


def _object(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise InputError("$", "expected a JSON object")
    return doc


def _model(body: Mapping[str, Any], model: str) -> None:
    name = body.get("model")
    if not isinstance(name, str):
        raise InputError("$.model", "required: the model name (see /v1/models)")
    if name != model:
        raise ModelNotFound(f"The model {name!r} does not exist; this gateway serves {model!r}")


def _message(raw: Any, path: str) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise InputError(path, "expected an object with 'role' and 'content'")
    role = raw.get("role")
    if role not in MESSAGE_ROLES:
        raise InputError(f"{path}.role", f"expected one of {', '.join(MESSAGE_ROLES)}")
    content = raw.get("content")
    if isinstance(content, list):  # content parts: only text is understood here
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InputError(f"{path}.content[{k}]", "only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise InputError(f"{path}.content[{k}].text", "expected a string")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise InputError(f"{path}.content", "expected a string or a list of text parts")
    return {"role": str(role), "content": content}


def _sampling(
    body: Mapping[str, Any], payload: dict[str, Any], *, default_max: int | None, most: int = 0
) -> tuple[dict[str, Any], Sampling]:
    """`most`: the model's largest max_tokens (0: not known; the pipeline checks it)."""
    max_tokens = body.get("max_tokens", default_max)
    if max_tokens is not None:
        if not _int(max_tokens) or max_tokens < 1:
            raise InputError("$.max_tokens", "expected an integer >= 1")
        if most and max_tokens > most:
            raise InputError("$.max_tokens", f"at most {most} for this model, got {max_tokens}")
        payload["max_tokens"] = max_tokens
    for key, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(key)
        if value is None:
            continue
        if not _number(value) or not low <= value <= high or (key == "top_p" and value == 0):
            raise InputError(
                f"$.{key}",
                f"expected a number in {'(' if key == 'top_p' else '['}{low:g}, {high:g}]",
            )
        payload[key] = float(value)
    seed = body.get("seed")
    if seed is not None:
        if not _int(seed):
            raise InputError("$.seed", "expected an integer")
        payload["seed"] = seed
    stop = _stop(body.get("stop"))
    if stop:
        payload["stop"] = list(stop)
    n = body.get("n", 1)
    if n != 1:
        raise InputError("$.n", "only n = 1 is supported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InputError("$.stream", "expected true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InputError("$.stream_options", "expected an object")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise InputError("$.stream_options.include_usage", "expected true or false")
    return payload, Sampling(stream=stream, include_usage=usage, stop=stop)


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise InputError("$.stop", f"expected a string or a list of up to {MAX_STOP} strings")
    for i, s in enumerate(items):
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise InputError(
                f"$.stop[{i}]", f"expected a string of 1 to {MAX_STOP_CHARS} characters"
            )
    return tuple(items)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return _int(value) or (isinstance(value, float) and math.isfinite(value))


# ---- answers ----------------------------------------------------------------------------------
@dataclass
class Completion:
    """The text of one answer as chunks arrive: stop sequences, token counts, finish."""

    stop: tuple[str, ...] = ()
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    stopped: bool = False  # a stop sequence matched: nothing more is wanted
    _held: str = ""
    _chunks: int = field(default=0, repr=False)

    def feed(self, chunk: Any) -> str:
        """Take one chunk; the text that may be sent now (possibly "")."""
        if not isinstance(chunk, dict):
            raise ValueError(f"an OpenAI pipeline streams dict chunks, got {type(chunk).__name__}")
        if self.stopped:
            return ""
        self._chunks += 1
        self.completion_tokens += _count(chunk.get("token_ids"))
        prompt = chunk.get("prompt_tokens")
        if isinstance(prompt, int) and not isinstance(prompt, bool):
            self.prompt_tokens = max(self.prompt_tokens, prompt)
        reason = chunk.get("finish_reason")
        if isinstance(reason, str):
            self.finish_reason = reason
        piece = chunk.get("text")
        return self._release(piece if isinstance(piece, str) else "")

    def _release(self, piece: str) -> str:
        """Linear in the chunk and the stop sequences: `find` scans the held text and the new
        piece once, and the hold-back is each sequence's KMP state at the end (`_overlap`)."""
        buf = self._held + piece
        cut = min((i for i in (buf.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped, self.finish_reason = "", True, "stop"
            return self._emit(buf[:cut])
        hold = max((_overlap(buf, s) for s in self.stop), default=0)
        self._held = buf[len(buf) - hold :] if hold else ""
        return self._emit(buf[: len(buf) - hold])

    def _emit(self, text: str) -> str:
        self.text += text
        return text

    def finish(self) -> str:
        """The held-back text (the stream ended without completing a stop sequence)."""
        held, self._held = self._held, ""
        if self.finish_reason is None:
            self.finish_reason = "stop"
        return self._emit(held)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _overlap(text: str, stop: str) -> int:
    """The length of the longest proper prefix of `stop` that ends `text`, in
    O(len(stop)): the Knuth-Morris-Pratt automaton of `stop` run over the last
    len(stop) - 1 characters of `text` (a longer tail cannot matter)."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    k = 0
    for ch in text[-(len(stop) - 1) :] if len(stop) > 1 else "":
        while k and ch != stop[k]:
            k = fail[k - 1]
        if ch == stop[k]:
            k += 1
    return k  # < len(stop): the tail is shorter than `stop`


def _count(token_ids: Any) -> int:
    if token_ids is None:
        return 1
    if _int(token_ids):
        return 1
    if hasattr(token_ids, "numel"):
        return int(token_ids.numel())
    if isinstance(token_ids, (list, tuple)):
        return len(token_ids)
    return 1


@dataclass(frozen=True)
class Answer:
    """Ids and stamps shared by every object of one answer."""

    model: str
    chat: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _base(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, done: Completion) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": None,
                "finish_reason": done.finish_reason,
            }
            obj = self._base("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": done.text,
                "logprobs": None,
                "finish_reason": done.finish_reason,
            }
            obj = self._base("text_completion")
        return {**obj, "choices": [choice], "usage": done.usage()}

    def delta(self, text: str, *, first: bool = False, finish: str | None = None) -> dict[str, Any]:
        """One streamed object: a piece of text, and/or the finish reason."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, done: Completion) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": done.usage()}


def models(model: str, created: int) -> dict[str, Any]:
    """`/v1/models`."""
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "disagg"}],
    }


def error(message: str, *, kind: str, code: str | None = None, param: str | None = None) -> Any:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
