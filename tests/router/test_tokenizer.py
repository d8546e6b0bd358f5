"""Router tokenizer: round trips, special ids, and chat templates identical to transformers."""

from __future__ import annotations

import json
import os

import pytest

from services.common.errors import InvalidRequest, ModelLoadError
from services.models.tiny import make_tiny_model
from services.router.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROUND_TRIP_TEXTS = [
    "plain ASCII, with punctuation!",
    "  leading spaces and trailing  ",
    "héllo wörld, ça va? Grüße aus München",
    "日本語のテキスト。你好，世界。한국어",
    "emoji 🙂👍🏽🚀👨‍👩‍👧 and a flag 🇫🇷",
    "tabs\tand\nnew\r\nlines",
    "",
]

CONVERSATIONS = {
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi! 🙂"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": 'Name three colours <b>bold</b> & "quoted".'},
    ],
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tok") / "tiny", num_layers=1)


@pytest.fixture(params=["smollm2", "tiny"])
def model_dir(request, tiny_dir):
    return request.getfixturevalue("smollm2_dir") if request.param == "smollm2" else tiny_dir


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(model_dir, text):
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_special_ids_for_smollm2(smollm2_dir):
    tok = Tokenizer.from_dir(smollm2_dir)
    assert tok.eos_token_id == 2 and tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert tok.vocab_size == 49152
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.is_special(2) and not tok.is_special(ids[1])
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(model_dir, name):
    transformers = pytest.importorskip("transformers")
    messages = CONVERSATIONS[name]
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tok = Tokenizer.from_dir(model_dir)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n")
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert without == theirs.apply_chat_template(messages, tokenize=False)
    assert tok.encode(rendered, add_special_tokens=False) == theirs.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def _write_model_files(path, template):
    make_tiny_model(path, num_layers=1)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return path


def test_chat_template_raise_exception_becomes_invalid_request(tmp_path):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}ok"
    tok = Tokenizer.from_dir(_write_model_files(tmp_path / "m", template))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequest, match="first turn must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_template_tojson_and_bos_variables(tmp_path):
    template = "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"
    tok = Tokenizer.from_dir(_write_model_files(tmp_path / "m", template))
    rendered = tok.apply_chat_template([{"role": "user", "content": "<é>"}])
    assert rendered == '<|im_start|>[{"role": "user", "content": "<é>"}]<|im_end|>'


def test_chat_template_sandbox_blocks_python_internals(tmp_path):
    template = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer.from_dir(_write_model_files(tmp_path / "m", template))
    with pytest.raises(InvalidRequest, match="unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_tokenizer_missing_file_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_tokenizer_corrupt_file_names_it(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"')
    with pytest.raises(ModelLoadError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)


def test_tokenizer_without_template_says_so(tmp_path):
    path = make_tiny_model(tmp_path / "m", num_layers=1)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no chat template"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])
