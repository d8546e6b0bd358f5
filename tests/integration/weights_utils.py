"""Models with other weights than SmolLM2's, and their Hugging Face greedy references."""

from __future__ import annotations

import itertools
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.proto.conveyor.v1 import common_pb2, scheduler_pb2
from tests.worker.utils import compare_greedy

_ids = itertools.count()

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


MAX_NEW = 10
TIE_MARGIN = 0.01


@dataclass
class Weights:
    """Three sets of weights and HF's greedy continuations of `prompts` under each."""

    prompts: list[list[int]]
    original: tuple
    trained_dir: Path
    """A model directory: the original after one training step."""
    trained: tuple
    pushed_state: dict[str, torch.Tensor]
    """The trained model after a second step, as a trainer holds it (its state dict)."""
    pushed: tuple


def make_weights(smollm2_dir: Path, prompts: list[list[int]], out_dir: Path) -> Weights:
    model = load_hf(smollm2_dir)
    original = hf_greedy(model, prompts, MAX_NEW)
    training_step(model, seed=0)
    trained_dir = save_model(model, smollm2_dir, out_dir)
    trained = hf_greedy(model, prompts, MAX_NEW)
    training_step(model, seed=1)
    pushed = hf_greedy(model, prompts, MAX_NEW)
    assert original[0] != trained[0] != pushed[0], "the training steps must change the output"
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return Weights(prompts, original, trained_dir, trained, state, pushed)


class Stream:
    """One request's stream, read on a thread: tokens, the weight version of each, the end."""

    def __init__(self, stack, prompt: list[int], max_tokens: int = MAX_NEW):
        self.request = scheduler_pb2.SubmitRequest(
            request_id=f"w-{next(_ids)}-{time.time_ns()}",
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        self.tokens: list[int] = []
        self.versions: list[int] = []
        self.finish_reason = 0
        self.error = ""
        self.first_token = threading.Event()
        self._stub = stack.stub
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for delta in self._stub.Submit(self.request, timeout=300):
            self.tokens.extend(delta.token_ids)
            self.versions.extend([delta.weight_version] * len(delta.token_ids))
            self.finish_reason, self.error = delta.finish_reason, delta.error or self.error
            if self.tokens:
                self.first_token.set()

    def wait_first_token(self) -> Stream:
        assert self.first_token.wait(300), "no token within 300 s"
        return self

    def join(self) -> Stream:
        self._thread.join(300)
        assert not self._thread.is_alive(), "the stream did not end within 300 s"
        return self


def generate(stack, prompt: list[int], max_tokens: int = MAX_NEW) -> Stream:
    return Stream(stack, prompt, max_tokens).join()


def assert_matches(stack, prompts, reference, version: int) -> None:
    """Each prompt's greedy output equals HF's `reference`, all from weights `version`."""
    ref_tokens, ref_logits = reference
    for prompt, ref, logits in zip(prompts, ref_tokens, ref_logits, strict=True):
        stream = generate(stack, prompt, len(ref))
        compare_greedy(stream.tokens, ref, logits, TIE_MARGIN)
        assert set(stream.versions) == {version}
