"""A Hugging Face causal LM split into a prefill role and a decode role.

    client ── {"prompt" | "messages" | "input_ids", max_tokens, temperature, top_p, seed,
               stop} ──> Prefill: tokenize, run the prompts (a batch: left-padded, one
    forward), pick each first token
        ──> {"keys": [layer: (1, kv_heads, T, head_dim)], "values": [...], "input_ids",
             "first_token", "rng" (sampling: the generator's state), "params"} ──> Decode:
    rebuild the model's DynamicCache, continue token by token, stream chunks
        {"text": str, "token_ids": [int, ...], "finish_reason": None | "stop" | "length"}
    (the first one also says "prompt_tokens": the prompt's length, for OpenAI's `usage`)

`handlerArgs`: `model` (a directory `from_pretrained` loads: weights and tokenizer),
`dtype` (compute dtype: float32 (default), bfloat16, float16), `kvDtype` (the cache on the
wire; default the compute dtype), `maxPromptTokens` (default 4096), `threads` (torch's
intra-op threads in this process; default torch's own: on a busy CPU, 1 avoids paying a
thread fork/join per operator).

Sampling: `temperature` absent or 0 is greedy; otherwise the logits go through
transformers' own temperature and top-p warpers and `torch.multinomial` with a generator
seeded by `seed` (random if absent). Prefill draws the first token and hands the
generator's state to decode, so a seeded request draws what `torch.manual_seed(seed);
model.generate(do_sample=True, top_k=0, ...)` draws in one process. Stop strings end the
text before the first match (`finish_reason` "stop"), as the end-of-sequence token does;
`max_tokens` counts every generated token, the first included ("length").
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from disagg_runtime.models import hf_tp
from disagg_runtime.role.handler import SetupContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4


class RequestError(ValueError):
    """A malformed request; the message names the field."""


@dataclass(frozen=True)
class Params:
    """The sampling and stopping parameters of one request (OpenAI's names)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
        }


def parse_params(payload: Mapping[str, Any]) -> Params:
    """Sampling parameters of a request, each checked; RequestError names a bad field."""

    def number(key: str, default: float, low: float, high: float) -> float:
        value = payload.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(f"{key}: expected a number, got {type(value).__name__}")
        if not low <= value <= high:
            raise RequestError(f"{key}: must be in [{low:g}, {high:g}], got {value}")
        return float(value)

    max_tokens = payload.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(f"max_tokens: expected a positive integer, got {max_tokens!r}")
    seed = payload.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise RequestError(f"seed: expected a non-negative integer, got {seed!r}")
    stop = payload.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list | tuple)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise RequestError(f"stop: expected up to {MAX_STOP_STRINGS} non-empty strings")
    top_p = number("top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p: must be greater than 0")
    return Params(
        max_tokens=max_tokens,
        temperature=number("temperature", 0.0, 0.0, 100.0),
        top_p=top_p,
        seed=seed,
        stop=tuple(stop),
    )


def prompt_ids(tokenizer: Any, payload: Mapping[str, Any]) -> list[int]:
    """The prompt's token ids from `prompt` (text), `messages` (chat) or `input_ids`."""
    if "input_ids" in payload:
        ids = payload["input_ids"]
        ids = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else ids
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise RequestError("input_ids: expected a list of integers")
        return ids
    if "messages" in payload:
        messages = payload["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        ):
            raise RequestError("messages: expected a list of {role, content} objects")
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        else:  # no template: a plain transcript
            lines = [f"{m.get('role', 'user')}: {m['content']}" for m in messages]
            text = "\n".join([*lines, "assistant:"])
    else:
        text = payload.get("prompt")
        if not isinstance(text, str):
            raise RequestError("prompt: expected a string (or messages, or input_ids)")
    return list(tokenizer(text).input_ids)


def sample(logits: torch.Tensor, params: Params, generator: torch.Generator | None) -> int:
    """The next token from one row of logits (1, vocab), as `generate` picks it."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    scores = logits.to(dtype=torch.float32)
    if params.greedy:
        return int(scores.argmax(dim=-1).item())
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    probs = torch.nn.functional.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator).item())


def new_generator(params: Params) -> torch.Generator | None:
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed)


# ---- the KV cache as tensors -----------------------------------------------------------------
def flatten_cache(cache: Any, row: int, start: int, dtype: torch.dtype) -> dict[str, Any]:
    """Row `row` of a batched cache from position `start` on (dropping left padding), as
    per-layer key and value tensors in `dtype`."""
    keys, values = [], []
    for layer in cache.layers:
        keys.append(layer.keys[row : row + 1, :, start:].to(dtype).contiguous())
        values.append(layer.values[row : row + 1, :, start:].to(dtype).contiguous())
    return {"keys": keys, "values": values}


def rebuild_cache(config: Any, keys: Sequence[Any], values: Sequence[Any], dtype: Any) -> Any:
    """The model's DynamicCache from per-layer tensors. Zero-copy where the dtype and device
    already match: plain layers adopt the tensors (views of the receive pool, valid until the
    request's messages are released after decode), and the first decode step's `torch.cat`
    makes the cache its own, as every step of `generate` does. Other layer kinds (sliding
    windows) are filled through `update`, which copies."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if len(keys) != len(values) or len(keys) != config.num_hidden_layers:
        raise RequestError(
            f"kv: expected {config.num_hidden_layers} layers of keys and values, "
            f"got {len(keys)} and {len(values)}"
        )
    cache = DynamicCache(config=config)
    for layer, key, value in zip(cache.layers, keys, values, strict=True):
        key, value = key.to(dtype), value.to(dtype)
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(key, value)
            layer.keys, layer.values = key, value
        else:
            layer.update(key, value)
    return cache


# ---- roles -------------------------------------------------------------------------------------
class _Model:
    """Loads tokenizer and model from `handlerArgs.model` in setup."""

    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.kv_dtype = torch.float32
        self.max_prompt = 4096
        self.ctx: SetupContext | None = None  # a replica of several ranks: tensor parallel

    def setup(self, ctx: SetupContext) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = ctx.args.get("model")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise FileNotFoundError(f"handlerArgs.model: {path!r} is not a model directory")
        self.dtype = _dtype(ctx.args, "dtype", torch.float32)
        self.kv_dtype = _dtype(ctx.args, "kvDtype", self.dtype)
        self.max_prompt = int(ctx.args.get("maxPromptTokens", 4096))
        if "threads" in ctx.args:
            torch.set_num_threads(int(ctx.args["threads"]))
        self.device = torch.device(ctx.device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if hf_tp.parallel(ctx):
            self.ctx = ctx
            self.model = hf_tp.load(path, self.dtype, ctx).eval()
            ctx.log.info("tensor parallel over %d ranks (rank %d)", ctx.world_size, ctx.rank)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
            self.model = model.to(self.device).eval()
        ctx.state["model"] = self.model
        ctx.log.info("loaded %s (%s) on %s", path, self.dtype, self.device)

    def close(self) -> None:
        self.model = None


def _dtype(args: Mapping[str, Any], key: str, default: torch.dtype) -> torch.dtype:
    name = args.get(key)
    if name is None:
        return default
    if name not in DTYPES:
        raise ValueError(f"handlerArgs.{key}: expected one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


class Prefill(_Model):
    """Runs prompts (batched) and hands each request's KV cache and first token on."""

    def __call__(self, payload: Any) -> Any:
        output = self.batch([payload])[0]
        if isinstance(output, Exception):
            raise output
        return output

    def batch(self, payloads: list[Any]) -> list[Any]:
        outputs: list[Any] = [None] * len(payloads)
        ready: list[tuple[int, list[int], Params]] = []
        for index, payload in enumerate(payloads):
            try:
                if not isinstance(payload, dict):
                    raise RequestError("expected a mapping with prompt or messages")
                ids = prompt_ids(self.tokenizer, payload)
                if not 1 <= len(ids) <= self.max_prompt:
                    raise RequestError(f"prompt: {len(ids)} tokens, need 1..{self.max_prompt}")
                ready.append((index, ids, parse_params(payload)))
            except RequestError as exc:  # fails this request alone
                outputs[index] = exc
        if ready:
            for index, output in zip((r[0] for r in ready), self._prefill(ready), strict=True):
                outputs[index] = output
        return outputs

    @torch.inference_mode()
    def _prefill(self, ready: list[tuple[int, list[int], Params]]) -> list[dict[str, Any]]:
        width = max(len(ids) for _, ids, _ in ready)
        pad = self.tokenizer.pad_token_id or 0
        rows = [[pad] * (width - len(ids)) + ids for _, ids, _ in ready]
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids, _ in ready])
        kwargs: dict[str, Any] = {"use_cache": True}
        if len(ready) > 1:  # left padding: mask it, and count positions from each prompt's start
            kwargs["attention_mask"] = mask.to(self.device)
            kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0).to(self.device)
        out = self.model(input_ids=torch.tensor(rows, device=self.device), **kwargs)
        cache = _cache_of(out)
        results = []
        for row, (_, ids, params) in enumerate(ready):
            generator = new_generator(params)
            first = sample(out.logits[row : row + 1, -1, :].cpu(), params, generator)
            result = flatten_cache(cache, row, width - len(ids), self.kv_dtype)
            if self.ctx is not None:  # this rank's heads -> every head
                result["keys"] = hf_tp.gather_heads(result["keys"], self.ctx)
                result["values"] = hf_tp.gather_heads(result["values"], self.ctx)
            result["keys"] = [k.cpu() for k in result["keys"]]
            result["values"] = [v.cpu() for v in result["values"]]
            result["input_ids"] = torch.tensor(ids, dtype=torch.int64)
            result["first_token"] = first
            result["params"] = params.to_json()
            if generator is not None:
                result["rng"] = generator.get_state()
            results.append(result)
        return results


class Decode(_Model):
    """Continues from a handed-over cache and streams text chunks."""

    def __call__(self, payload: Any) -> Iterator[dict[str, Any]]:
        if not isinstance(payload, dict) or "keys" not in payload:
            raise RequestError("expected a prefill output (keys, values, first_token, params)")
        params = parse_params(payload.get("params") or {})
        keys = [k.to(self.device) for k in payload["keys"]]
        values = [v.to(self.device) for v in payload["values"]]
        if self.ctx is not None:  # every head -> this rank's
            keys, values = hf_tp.local_heads(keys, self.ctx), hf_tp.local_heads(values, self.ctx)
        cache = rebuild_cache(self.model.config, keys, values, self.dtype)
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            generator.set_state(payload["rng"].clone())
        prompt = payload.get("input_ids")
        prompt_tokens = int(prompt.numel()) if isinstance(prompt, torch.Tensor) else 0
        chunks = self._stream(cache, int(payload["first_token"]), params, generator)
        return _counting_prompt(chunks, prompt_tokens)

    def _stream(
        self, cache: Any, token: int, params: Params, generator: torch.Generator | None
    ) -> Iterator[dict[str, Any]]:
        text = _Text(self.tokenizer, params.stop)
        eos = _eos_ids(self.model)
        generated = 0
        while True:
            generated += 1
            if token in eos:  # its id is sent, its text is not
                yield text.finish("stop", eos=token)
                return
            text.add(token)
            if text.stopped:
                yield text.finish("stop")
                return
            if generated >= params.max_tokens:
                yield text.finish("length")
                return
            chunk = text.release()
            if chunk is not None:
                yield chunk
            token = self._step(cache, token, params, generator)

    @torch.inference_mode()
    def _step(
        self, cache: Any, token: int, params: Params, generator: torch.Generator | None
    ) -> int:
        ids = torch.tensor([[token]], device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True)
        return sample(out.logits[:, -1, :].cpu(), params, generator)


def _counting_prompt(
    chunks: Iterator[dict[str, Any]], prompt_tokens: int
) -> Iterator[dict[str, Any]]:
    """`chunks`, the first one saying how many tokens the prompt had."""
    for n, chunk in enumerate(chunks):
        yield {**chunk, "prompt_tokens": prompt_tokens} if n == 0 else chunk


def _eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


class _Text:
    """Incremental detokenization with stop strings: text is released only once it can no
    longer become part of a stop string or of an unfinished UTF-8 character."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.pending: list[int] = []  # token ids not yet sent
        self.sent = 0  # characters of the text already sent
        self.stopped = False
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self._final = ""
        self._full = ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        self.pending.append(token)
        self._full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (self._full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._final = self._full[self.sent : cut]

    def release(self) -> dict[str, Any] | None:
        """A chunk of what is safe to send now, or None."""
        if self._full.endswith("\ufffd"):
            return None  # the middle of a character
        end = max(self.sent, len(self._full) - self.holdback)
        if end == self.sent:
            return None
        chunk: dict[str, Any] = {"text": self._full[self.sent : end], "token_ids": self.pending}
        chunk["finish_reason"] = None
        self.sent, self.pending = end, []
        return chunk

    def finish(self, reason: str, *, eos: int | None = None) -> dict[str, Any]:
        """The last chunk: the text not sent yet (up to a stop string), the ids not sent."""
        if not self.stopped:
            self._final = self._full[self.sent :]
        ids = self.pending + ([] if eos is None else [eos])
        return {"text": self._final, "token_ids": ids, "finish_reason": reason}


def sample_input(handler: str, i: int) -> dict[str, Any]:
    """What `disagg up` sends to the prefill role."""
    topics = ("the quick brown fox", "a disaggregated pipeline", "prefill and decode", "tensors")
    return {"prompt": f"Request {i}: {topics[i % len(topics)]}", "max_tokens": 8}
