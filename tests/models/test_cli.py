"""`conveyor models ...` prints the model directory last, and errors as one line."""

from __future__ import annotations

import json

from services import cli
from services.models import fetch


def test_models_make_tiny_prints_directory(tmp_path, capsys):
    rc = cli.main(["models", "make-tiny", str(tmp_path / "t"), "--layers", "3", "--untied"])
    assert rc == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "t")
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["tie_word_embeddings"] is False


def test_models_list_shows_cache_state(tmp_path, capsys):
    assert cli.main(["models", "list", "--dir", str(tmp_path)]) == 0
    assert "smollm2-135m\tnot cached" in capsys.readouterr().out
    done = tmp_path / "smollm2-135m"
    done.mkdir()
    (done / fetch.COMPLETE_MARKER).write_text("x")
    assert cli.main(["models", "list", "--dir", str(tmp_path)]) == 0
    assert f"cached at {done}" in capsys.readouterr().out


def test_models_fetch_cached_prints_directory(smollm2_dir, capsys):
    rc = cli.main(
        ["models", "fetch", "smollm2-135m", "--dir", str(smollm2_dir.parent), "--no-progress"]
    )
    assert rc == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(smollm2_dir)


def test_models_fetch_unknown_name_fails_with_message(tmp_path, capsys):
    assert cli.main(["models", "fetch", "nope", "--dir", str(tmp_path)]) == 1
    assert "known models: smollm2-135m" in capsys.readouterr().err
