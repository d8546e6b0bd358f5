"""Models with other weights than SmolLM2's, and their Hugging Face greedy references."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

PERTURBED_LAYERS = (3, 27)
"""Layers a "training step" changes: one in each stage of a 2-stage split."""


def load_hf(model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def training_step(model, layers=PERTURBED_LAYERS, seed: int = 0) -> None:
    """A stand-in for an optimizer step: nudges the attention output and MLP down projection
    of `layers` (enough to change greedy continuations)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for index in layers:
            layer = model.model.layers[index]
            for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                weight.add_(0.05 * torch.randn(weight.shape, generator=generator))


def save_model(model, src_dir: Path, dst_dir: Path) -> Path:
    """`model`'s weights as a model directory (safetensors), with `src_dir`'s tokenizer."""
    model.save_pretrained(dst_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src_dir / name).exists():
            shutil.copy(src_dir / name, dst_dir / name)
    return dst_dir


def hf_greedy(model, prompts: list[list[int]], max_new: int):
    """HF greedy: (tokens, per-step logits) per prompt (for `compare_greedy`)."""
    tokens, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                eos_token_id=None,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logits.append([step[0].float() for step in out.logits])
    return tokens, logits
