"""`ModelConfig`: the architecture of a Llama-family model, read from a HF `config.json`.

Supported: LlamaForCausalLM, MistralForCausalLM (no sliding window), Qwen2ForCausalLM
(bias on q/k/v only). RoPE parameters are read from `rope_scaling` + `rope_theta`
(transformers 4.x) or from `rope_parameters` (transformers 5.x).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(slots=True)
class RopeScaling:
    """How RoPE frequencies are rescaled for long context (`None` on ModelConfig: plain RoPE)."""

    rope_type: str
    """"llama3" or "linear"."""
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelConfig:
    """Architecture of one Llama-family decoder-only model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2, or `attention_bias` on Llama)."""
    o_bias: bool = False
    """Bias on the output projection (`attention_bias` on Llama; never on Qwen2)."""
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    """Every id that ends generation: config.json's `eos_token_id` (one id or a list),
    then those generation_config.json adds (Llama 3 Instruct lists <|eot_id|> there only)."""

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def num_layer_params(self) -> int:
        """Weights of one decoder layer (attention + SwiGLU MLP), biases and norms aside."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (2 * q_size + 2 * kv_size)
        return attention + 3 * self.hidden_size * self.intermediate_size

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `<model_dir>/config.json` (and the EOS ids of generation_config.json);
        raises ModelLoadError naming the file and problem."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} does not exist: a model directory needs a config.json")
        raw = _read_json(path)
        generation_path = Path(model_dir) / "generation_config.json"
        if generation_path.is_file():
            generation = _read_json(generation_path)
            try:
                eos_ids = [
                    *_eos_ids(raw.get("eos_token_id")),
                    *_eos_ids(generation.get("eos_token_id")),
                ]
            except (TypeError, ValueError) as exc:
                raise ModelLoadError(
                    f"{path} or {generation_path} has a malformed eos_token_id: {exc}"
                ) from exc
            raw = {**raw, "eos_token_id": eos_ids}
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from the parsed JSON of a HF config."""
        arch = _architecture(raw, source)
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            theta, scaling = _rope(raw, source)
            attention_bias = bool(raw.get("attention_bias", False))
            is_qwen2 = arch == "Qwen2ForCausalLM"
            config = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=True if is_qwen2 else attention_bias,
                o_bias=False if is_qwen2 else attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source} lacks the required field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source} has a malformed field: {exc}") from exc
        config._validate(source)
        return config

    def _validate(self, source: str) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_hidden_layers < 1:
            raise ModelLoadError(f"{source}: num_hidden_layers={self.num_hidden_layers} < 1")


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[raw["model_type"]]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            if arch == "MistralForCausalLM" and raw.get("sliding_window"):
                logger.warning("%s: sliding_window is ignored (full attention)", source)
            return arch
    raise ModelLoadError(
        f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {_ROPE_TYPES}"
        )
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return raw


def _eos_ids(value: Any) -> tuple[int, ...]:
    """One id or a list of ids, duplicates dropped, first occurrence's order kept."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(int(v) for v in values))
