"""Inference engines run as roles (vLLM: `engines/vllm/`), above the relays they move KV
through and beside the gateway that routes to them."""
