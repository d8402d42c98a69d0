"""Hugging Face model handlers (the `models` extra: transformers, safetensors, diffusers).

Nothing here is imported by the runtime unless a role's handler names it: `hf_llm` (a causal
LM split into prefill and decode, the KV cache handed over), `diffusers_t2v` (Wan
text-to-video as text encoder, denoiser and VAE decoder roles), `tiny` (random tiny models
and a locally trained tokenizer, saved with `save_pretrained`, for tests and examples).
"""
