"""The LLM demo pipeline: `prefill` (a KV cache as the payload) -> `decode_tokens` (a stream)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from disagg_runtime.demo.kit import (
    DEFAULT_NEW_TOKENS,
    LLM_DIM,
    LLM_HEAD_DIM,
    LLM_HEADS,
    LLM_LAYERS,
    LLM_MAX_PROMPT,
    LLM_VOCAB,
    MAX_NEW_TOKENS,
    Payload,
    _as_dict,
    _block,
    _carried,
    _check_ids,
    _describe,
    _embedding,
    _generator,
    _int,
    _linear,
    _positions,
    _seed,
    _tensor,
)


def _lm_logits(h: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(h, (LLM_DIM,))
    return h @ _linear("lm.head", LLM_DIM, LLM_VOCAB) * 2.0


def _sample(
    logits: torch.Tensor, gen: torch.Generator, temperature: float = 1.0, top_p: float = 1.0
) -> int:
    """Temperature 0 is greedy; top_p < 1 keeps the smallest set of likeliest tokens whose
    probability reaches top_p (nucleus sampling)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        ordered, index = torch.sort(probs, descending=True)
        keep = torch.cumsum(ordered, dim=0) - ordered < top_p
        probs = torch.zeros_like(probs).scatter_(0, index[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


_ONSETS = ("", "b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "n", "s", "r", "l", "th", "m", "x", "ng", "st", "ck", "rd", "sh", "ft", "mp", "nt")
BOS_ID = 1
MAX_STOP = 4


def token_text(token: int) -> str:
    """The demo's trivial vocabulary: token id -> " " + a syllable (16 x 8 x 16 = 2048)."""
    onset, rest = _ONSETS[token % 16], token // 16
    return f" {onset}{_VOWELS[rest % 8]}{_CODAS[(rest // 8) % 16]}"


def _prompt_ids(p: Payload, name: str) -> torch.Tensor:
    """A text prompt's ids: BOS, then its UTF-8 bytes (the demo needs no tokenizer)."""
    if "messages" in p:
        messages = p["messages"]
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        )
        if not ok:
            raise ValueError(
                f"{name}: payload['messages'] must be a non-empty list of "
                "{'role': str, 'content': str}"
            )
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    else:
        prompt = p.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"{name}: payload needs 'input_ids', 'prompt' (str) or 'messages'")
        text = prompt
    raw = text.encode()[: LLM_MAX_PROMPT - 1]
    return torch.tensor([BOS_ID, *raw], dtype=torch.int64)


def _sampling(p: Payload, name: str) -> Payload:
    """temperature, top_p and stop, checked (defaults: 1.0, 1.0, none)."""
    out: Payload = {}
    for key, low, high, default in (("temperature", 0.0, 2.0, 1.0), ("top_p", 0.0, 1.0, 1.0)):
        value = p.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= value <= high
            or (key == "top_p" and value == 0)
        ):
            raise ValueError(f"{name}: payload[{key!r}] must be a number in [{low}, {high}]")
        out[key] = float(value)
    stop = p.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise ValueError(f"{name}: payload['stop'] must be up to {MAX_STOP} non-empty strings")
    out["stop"] = list(stop)
    return out


def prefill(payload: object) -> Payload:
    """Prefill: run the prompt through a small causal transformer once; hand the KV cache,
    the first sampled token and the sampling seed to decode."""
    name = "prefill"
    p = _as_dict(payload, name)
    out = _carried(name, p)
    if "input_ids" in p:
        ids = _tensor(p, "input_ids", name, ndim=1, kind="int64", min_size={0: 1})
    else:
        ids = _prompt_ids(p, name)
    if len(ids) > LLM_MAX_PROMPT:
        raise ValueError(f"{name}: payload['input_ids'] is longer than {LLM_MAX_PROMPT} tokens")
    _check_ids(ids, "input_ids", name, LLM_VOCAB)
    if "prompt" in p and not isinstance(p["prompt"], str):
        raise ValueError(f"{name}: payload['prompt'] must be a str; got {_describe(p['prompt'])}")
    if "max_tokens" in p and "max_new_tokens" not in p:
        p = {**p, "max_new_tokens": p["max_tokens"]}
    new_tokens = _int(
        p, "max_new_tokens", name, default=DEFAULT_NEW_TOKENS, lo=1, hi=MAX_NEW_TOKENS
    )
    sampling = _sampling(p, name)
    given_seed = p.get("seed")
    if given_seed is not None and type(given_seed) is not int:
        raise ValueError(f"{name}: payload['seed'] must be an int; got {given_seed!r}")

    x = _embedding("lm.embed", LLM_VOCAB, LLM_DIM)[ids] + _positions(len(ids), LLM_DIM)
    cache = []
    for layer in range(LLM_LAYERS):
        x, k, v = _block(x, f"lm.layer{layer}", LLM_HEADS, causal=True)
        cache.append(torch.stack((k, v)))
    seed = _seed("lm", ids) if given_seed is None else given_seed & 0x7FFFFFFF
    logits = _lm_logits(x[-1])
    first = _sample(logits, _generator(seed), sampling["temperature"], sampling["top_p"])
    out.update(
        kv=torch.stack(cache).to(torch.bfloat16),
        next_token=first,
        seed=seed,
        prompt_len=len(ids),
        max_new_tokens=new_tokens,
        **sampling,
    )
    return out


def decode_tokens(payload: object) -> Iterator[Payload]:
    """Decode: stream ``max_new_tokens`` chunks ``{"token": int64 (1,), "step": k}``, each
    token sampled from the model attending over the KV cache. The payload is checked and
    the cache copied before the generator is returned, so errors raise at the call and
    the stream holds no view of the input."""
    name = "decode_tokens"
    p = _as_dict(payload, name)
    carried = _carried(name, p)
    kv = _tensor(
        p,
        "kv",
        name,
        ndim=5,
        kind="float",
        shape={0: LLM_LAYERS, 1: 2, 2: LLM_HEADS, 4: LLM_HEAD_DIM},
        min_size={3: 1},
    )
    first = _int(p, "next_token", name, default=None, lo=0, hi=LLM_VOCAB - 1)
    seed = _int(p, "seed", name, default=None, lo=0, hi=2**31 - 1)
    new_tokens = _int(
        p, "max_new_tokens", name, default=DEFAULT_NEW_TOKENS, lo=1, hi=MAX_NEW_TOKENS
    )
    sampling = _sampling(p, name)
    prompt_len = _int(p, "prompt_len", name, default=kv.shape[3], lo=1, hi=LLM_MAX_PROMPT)
    # Copies: the stream outlives this call and must not hold views of the receive pool.
    keys = [kv[layer, 0].to(torch.float32, copy=True) for layer in range(LLM_LAYERS)]
    values = [kv[layer, 1].to(torch.float32, copy=True) for layer in range(LLM_LAYERS)]
    return _stream(
        keys, values, first, seed, new_tokens, carried, sampling=sampling, prompt_len=prompt_len
    )


def _stream(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    token: int,
    seed: int,
    new_tokens: int,
    carried: Payload,
    *,
    sampling: Payload,
    prompt_len: int,
) -> Iterator[Payload]:
    gen = _generator(seed + 1)
    position = keys[0].shape[1]
    stops: list[str] = sampling["stop"]
    text = ""
    for step in range(new_tokens):
        piece = token_text(token)
        finish = "length" if step == new_tokens - 1 else None
        cut = min((i for i in ((text + piece).find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            piece, finish = (text + piece)[len(text) : cut] if cut > len(text) else "", "stop"
        text += piece
        chunk = {
            "token": torch.tensor([token], dtype=torch.int64),
            "step": step,
            "text": piece,
            "token_ids": [token],
            "finish_reason": finish,
            **carried,
        }
        if step == 0:
            chunk["prompt_tokens"] = prompt_len
        yield chunk
        if finish is not None:
            return
        x = _embedding("lm.embed", LLM_VOCAB, LLM_DIM)[token].unsqueeze(0)
        x = x + _positions(1, LLM_DIM, start=position)
        for layer in range(LLM_LAYERS):
            past = (keys[layer], values[layer])
            x, keys[layer], values[layer] = _block(
                x, f"lm.layer{layer}", LLM_HEADS, causal=True, past=past
            )
        token = _sample(_lm_logits(x[0]), gen, sampling["temperature"], sampling["top_p"])
        position += 1
