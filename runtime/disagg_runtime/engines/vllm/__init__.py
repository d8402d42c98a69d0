"""vLLM as a role: a KV connector that moves a prefill engine's prompt blocks to a decode
engine through disagg's relays (shm on one node, tcp between pods), authenticated with the
pipeline's peer key like every other peer.

    gateway ──(1) prompt, max_tokens=1, kv_transfer_params={do_remote_decode, decode}──▶ prefill
    prefill ──(2) whole KV blocks of the prompt, one relay payload per request ──────▶ decode
    gateway ◀─(3) {do_remote_prefill, transfer, tokens, layout} (prefill's response)
    gateway ──(4) the request again with those kv_transfer_params ────────────────────▶ decode

- `layout`: the KV-cache geometry both ends must share (checked per transfer) and the pure
  block arithmetic (runs of block ids, what a request loads);
- `params`: `kv_transfer_params` parsed and bounded (they come from the network);
- `peers`: which decode ingresses a prefill engine may open connections to;
- `stats`: per-request transfer stats (vLLM's KV-connector stats hook, /metrics);
- `scheduling`: the scheduler half; `sending`/`receiving` (over `side`): the worker halves;
- `connector`: the `KVConnectorBase_V1` subclass vLLM loads (`kv_connector_module_path`).

Only `connector` imports vLLM; the rest is importable (and unit-tested) without it.
"""
