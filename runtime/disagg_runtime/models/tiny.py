"""Tiny random models, made offline (`disagg models tiny llm|t2v --out DIR`).

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a built-in text,
the weights are random (seeded, so two builds are equal), and everything is written with
`save_pretrained`, so the standard `from_pretrained(DIR)` loads it as it would real weights.

    llm  DIR/            a LlamaForCausalLM (hidden 64, 2 layers, 4 heads, 2 KV heads) + tokenizer
    vllm DIR/            the same at hidden 256 (head_dim 64: vLLM's CPU attention kernels
                         take head_dim 32, 64, 80, ..., not llm's 16), fp32
    t2v  DIR/            a WanPipeline layout: tokenizer/ text_encoder/ (UMT5, d_model 32)
                         transformer/ (WanTransformer3DModel, 2 x 8 heads) vae/ (AutoencoderKLWan,
                         base_dim 8, z_dim 16) scheduler/ (FlowMatchEulerDiscrete) model_index.json
"""

from __future__ import annotations

import pathlib
from typing import Any

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A disaggregated pipeline splits a model "
    "into roles: prefill runs the prompt, decode streams tokens, the encoder embeds text, "
    "the denoiser refines latents, the decoder turns latents into frames. Tensors move "
    "through shared memory, TCP or CUDA IPC. Hello world! 0123456789 (){}[]<>.,;:?!'\"-_+=*/"
)
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE trained on CORPUS, wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def llm(
    out: str | pathlib.Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
) -> pathlib.Path:
    """A random LlamaForCausalLM and its tokenizer in `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = pathlib.Path(out)
    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def vllm_llm(out: str | pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """A random Llama vLLM's CPU engine loads (head_dim 64) and its tokenizer in `out`."""
    return llm(out, hidden=256, layers=2, heads=4, kv_heads=2, seed=seed)


def t2v(out: str | pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """A random WanPipeline (text encoder, transformer, VAE, scheduler, tokenizer) in `out`."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    out = pathlib.Path(out)
    tok = tokenizer()
    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tok),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    ).eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        rope_max_seq_len=32,
    ).eval()
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = WanPipeline(
        tokenizer=tok, text_encoder=encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    pipe.save_pretrained(out)
    return out
