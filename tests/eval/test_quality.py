"""`conveyor eval`: perplexity on pydoc_data.topics and greedy agreement, on a tiny model
loaded the way a worker loads it."""

from __future__ import annotations

import math

import pytest

from services.cli import main
from services.eval.quality import (
    PROMPTS,
    agreement,
    corpus_text,
    greedy,
    make_windows,
    perplexity,
)
from services.models.tiny import make_tiny_model
from services.worker.config import WorkerConfig
from services.worker.runner import StageRunner


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), num_layers=2)


def _runner(model_dir, **kwargs) -> StageRunner:
    config = WorkerConfig(str(model_dir), num_threads=1, kv_cache_memory="64MiB", **kwargs)
    return StageRunner.from_config(config)


def test_corpus_is_the_python_documentation():
    text = corpus_text()
    assert len(text) > 300_000 and 'The "assert" statement' in text


def test_make_windows_keeps_only_whole_windows():
    assert make_windows(list(range(10)), 4, 5) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_perplexity_of_quantized_model_stays_near_the_full_one(tiny_dir):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).encode(corpus_text()).ids
    windows = make_windows(ids, 64, 6)
    full = perplexity(_runner(tiny_dir), windows)
    quantized = perplexity(_runner(tiny_dir, quantization="int8"), windows)
    assert full.num_tokens == 6 * 63 and math.isfinite(full.value) and full.value > 1
    assert quantized.value == pytest.approx(full.value, rel=0.02)
    # Batching windows does not change the score (each window is its own sequence).
    assert perplexity(_runner(tiny_dir), windows, batch_size=1).value == pytest.approx(
        full.value, rel=1e-5
    )


def test_greedy_agreement_of_a_model_with_itself_is_total(tiny_dir):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], list(range(20, 40))]
    first = greedy(_runner(tiny_dir), prompts, 8)
    again = greedy(_runner(tiny_dir), prompts, 8)
    assert all(len(tokens) == 8 for tokens in first)
    result = agreement(first, again)
    assert (result.num_identical, result.prefix_fraction, result.token_fraction) == (3, 1.0, 1.0)


def test_agreement_counts_prefixes_and_positions():
    result = agreement([[1, 2, 3, 4], [1, 9, 3, 4]], [[1, 2, 3, 4], [1, 2, 3, 4]])
    assert result.num_identical == 1
    assert result.prefix_fraction == pytest.approx((1.0 + 0.25) / 2)
    assert result.token_fraction == pytest.approx(7 / 8)


def test_eval_cli_prints_perplexity_and_agreement(tiny_dir, capsys):
    assert (
        main(
            [
                "eval",
                "ppl",
                "--model",
                str(tiny_dir),
                "--window",
                "32",
                "--num-windows",
                "2",
                "--quantization",
                "fp8",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("dtype=float32 quantization=fp8 perplexity=")
    assert (
        main(
            [
                "eval",
                "greedy",
                "--model",
                str(tiny_dir),
                "--quantization",
                "int8",
                "--num-tokens",
                "4",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"/{len(PROMPTS)} prefix=" in line


def test_eval_cli_rejects_a_corpus_too_small(tiny_dir, capsys):
    code = main(["eval", "ppl", "--model", str(tiny_dir), "--num-windows", "100000"])
    assert code == 2 and "lower --num-windows" in capsys.readouterr().err


def test_eval_cli_refuses_a_window_longer_than_the_model_in_its_own_terms(tiny_dir, capsys):
    code = main(["eval", "ppl", "--model", str(tiny_dir), "--window", "100000"])
    err = capsys.readouterr().err
    assert code == 2 and "--window=100000 exceeds" in err and "max-model-len" not in err
