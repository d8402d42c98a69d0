"""Wan text-to-video (diffusers `WanPipeline`) as three roles, each holding one component.

    client ── {"prompt", "negative_prompt", "seed", "num_frames", "height", "width",
               "steps", "guidance_scale", "max_sequence_length"}
      ──> TextEncoder (tokenizer + UMT5 text encoder): {"prompt_embeds",
          "negative_prompt_embeds" (when guidance_scale > 1), "params"}
      ──> Denoiser (transformer + scheduler): latent noise from `seed`, the scheduler's
          denoising loop: {"latents", "params"}
      ──> VaeDecoder (AutoencoderKLWan): frames as uint8, (frames, height, width, 3)

Each role runs diffusers' own code for its part (`WanPipeline.encode_prompt`, the pipeline's
loop with `output_type="latent"`, the pipeline's un-normalize + `vae.decode` +
`postprocess_video`), built with only its own component loaded, so the result is what the
one-process pipeline produces with the same seed. `handlerArgs`: `model` (a directory in the
`WanPipeline.save_pretrained` layout: tokenizer/ text_encoder/ transformer/ vae/
scheduler/), `dtype` (float32 (default), bfloat16, float16).

The denoiser's pipeline (scheduler state, guidance settings) and the Wan VAE (its causal
convolution caches live on the module) are not thread-safe: those roles run one request at
a time under a lock, whatever their `concurrency` (which still sets how many wait).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import torch

from disagg_runtime.models import cfg_split
from disagg_runtime.role.handler import SetupContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULTS: dict[str, Any] = {
    "negative_prompt": "",
    "seed": 0,
    "num_frames": 9,
    "height": 32,
    "width": 32,
    "steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 32,
}
LIMITS = {
    "num_frames": (1, 1025),
    "height": (16, 4096),
    "width": (16, 4096),
    "steps": (1, 1000),
    "max_sequence_length": (1, 4096),
}


def params_of(payload: Any) -> dict[str, Any]:
    """The request's parameters with defaults, each checked (ValueError names the field)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("prompt"), str):
        raise ValueError("prompt: expected a mapping with a prompt string")
    params = {**DEFAULTS, **{k: v for k, v in payload.items() if k in DEFAULTS}}
    params["prompt"] = payload["prompt"]
    for key, (low, high) in LIMITS.items():
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{key}: expected an integer in [{low}, {high}], got {value!r}")
    if not isinstance(params["seed"], int) or params["seed"] < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {params['seed']!r}")
    if not isinstance(params["guidance_scale"], int | float):
        raise ValueError("guidance_scale: expected a number")
    if not isinstance(params["negative_prompt"], str):
        raise ValueError("negative_prompt: expected a string")
    return params


def _part(ctx: SetupContext, sub: str) -> tuple[str, torch.dtype]:
    root = ctx.args.get("model")
    if not isinstance(root, str) or not os.path.isdir(os.path.join(root, sub)):
        raise FileNotFoundError(f"handlerArgs.model: {root!r} has no {sub}/ (WanPipeline layout)")
    name = ctx.args.get("dtype", "float32")
    if name not in DTYPES:
        raise ValueError(f"handlerArgs.dtype: expected one of {sorted(DTYPES)}, got {name!r}")
    return os.path.join(root, sub), DTYPES[name]


def _pipeline(**parts: Any) -> Any:
    """A WanPipeline holding only `parts` (the others None)."""
    from diffusers import WanPipeline

    components: dict[str, Any] = {
        "tokenizer": None,
        "text_encoder": None,
        "vae": None,
        "scheduler": None,
        "transformer": None,
    }
    return WanPipeline(**{**components, **parts})


class TextEncoder:
    """Prompt -> text embeddings (and the negative prompt's, for classifier-free guidance)."""

    def setup(self, ctx: SetupContext) -> None:
        from transformers import AutoTokenizer, UMT5EncoderModel

        root = _part(ctx, "tokenizer")[0]
        path, dtype = _part(ctx, "text_encoder")
        encoder = UMT5EncoderModel.from_pretrained(path, dtype=dtype).to(ctx.device).eval()
        self.pipe = _pipeline(tokenizer=AutoTokenizer.from_pretrained(root), text_encoder=encoder)

    @torch.inference_mode()
    def __call__(self, payload: Any) -> dict[str, Any]:
        params = params_of(payload)
        cfg = params["guidance_scale"] > 1.0
        embeds, negative = self.pipe.encode_prompt(
            prompt=params["prompt"],
            negative_prompt=params["negative_prompt"],
            do_classifier_free_guidance=cfg,
            num_videos_per_prompt=1,
            max_sequence_length=params["max_sequence_length"],
            device=self.pipe.text_encoder.device,
        )
        out: dict[str, Any] = {"prompt_embeds": embeds.cpu(), "params": params}
        if negative is not None:
            out["negative_prompt_embeds"] = negative.cpu()
        return out


class Denoiser:
    """Text embeddings -> denoised latents: the scheduler loop over the transformer."""

    def setup(self, ctx: SetupContext) -> None:
        from diffusers import (
            AutoencoderKLWan,
            FlowMatchEulerDiscreteScheduler,
            WanTransformer3DModel,
        )

        path, dtype = _part(ctx, "transformer")
        transformer = WanTransformer3DModel.from_pretrained(path, torch_dtype=dtype)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(_part(ctx, "scheduler")[0])
        self.pipe = _pipeline(transformer=transformer.to(ctx.device).eval(), scheduler=scheduler)
        self.pipe.set_progress_bar_config(disable=True)
        self.lock = threading.Lock()
        self.device = torch.device(ctx.device)
        # the latent grid follows the VAE's scale factors: its config, not its weights
        vae = AutoencoderKLWan.load_config(_part(ctx, "vae")[0])
        self.pipe.vae_scale_factor_temporal = vae.get("scale_factor_temporal", 4)
        self.pipe.vae_scale_factor_spatial = vae.get("scale_factor_spatial", 8)
        self.split: cfg_split.CfgSplit | None = None
        if ctx.world_size > 1:  # a replica of 2 ranks: cond on rank 0, uncond on rank 1
            self.split = cfg_split.CfgSplit(self.pipe.transformer, ctx)
            ctx.log.info("guidance split over 2 ranks: this is rank %d", ctx.rank)

    def __call__(self, payload: Any) -> dict[str, Any]:
        params = payload["params"]
        negative = payload.get("negative_prompt_embeds")
        with self.lock:
            if self.split is not None:
                guided = negative is not None and params["guidance_scale"] > 1.0
                self.split.negative = negative if guided else None
            latents = self._denoise(payload["prompt_embeds"], negative, params)
        return {"latents": latents.cpu(), "params": params}

    def _denoise(self, embeds: torch.Tensor, negative: Any, params: dict[str, Any]) -> Any:
        return self.pipe(
            prompt_embeds=embeds.to(self.device),
            negative_prompt_embeds=None if negative is None else negative.to(self.device),
            num_frames=params["num_frames"],
            height=params["height"],
            width=params["width"],
            num_inference_steps=params["steps"],
            guidance_scale=params["guidance_scale"],
            generator=torch.Generator(device="cpu").manual_seed(params["seed"]),
            output_type="latent",
            return_dict=False,
        )[0]


class VaeDecoder:
    """Latents -> uint8 frames (frames, height, width, 3)."""

    def setup(self, ctx: SetupContext) -> None:
        from diffusers import AutoencoderKLWan

        path, dtype = _part(ctx, "vae")
        self.vae = AutoencoderKLWan.from_pretrained(path, torch_dtype=dtype).to(ctx.device).eval()
        self.pipe = _pipeline(vae=self.vae)
        self.lock = threading.Lock()

    @torch.inference_mode()
    def __call__(self, payload: Any) -> torch.Tensor:
        with self.lock:
            return self._decode(payload["latents"])

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        latents = latents.to(vae.device, dtype=vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(
            latents.device, latents.dtype
        )
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")
        return to_uint8(frames)[0]


def to_uint8(frames: Any) -> torch.Tensor:
    """Frames in [0, 1] (numpy, as diffusers returns them) -> uint8 tensor."""
    return torch.from_numpy(frames).mul(255).round().clamp(0, 255).to(torch.uint8)


def sample_input(handler: str, i: int) -> dict[str, Any]:
    """What `disagg up` sends to the text encoder."""
    return {"prompt": f"a fox jumps over a dog, take {i}", "seed": i, "num_frames": 5}


def monolithic(model: str, request: Mapping[str, Any]) -> torch.Tensor:
    """The same request through the one-process WanPipeline (the reference for tests)."""
    from diffusers import WanPipeline

    params = params_of(dict(request))
    pipe = WanPipeline.from_pretrained(model)
    frames = pipe(
        prompt=params["prompt"],
        negative_prompt=params["negative_prompt"],
        num_frames=params["num_frames"],
        height=params["height"],
        width=params["width"],
        num_inference_steps=params["steps"],
        guidance_scale=params["guidance_scale"],
        max_sequence_length=params["max_sequence_length"],
        generator=torch.Generator(device="cpu").manual_seed(params["seed"]),
        output_type="np",
    ).frames
    return to_uint8(frames)[0]
