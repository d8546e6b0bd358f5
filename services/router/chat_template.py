"""Render a model's Jinja chat template the way `transformers` does.

transformers (utils/chat_template_utils.py) compiles templates in an
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
`loopcontrols` extension, a `tojson` filter that does not HTML-escape, and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`. It renders with `messages`,
`tools`, `documents`, `add_generation_prompt` and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...). We mirror that so that a prompt built here tokenizes to
the same ids as one built with `AutoTokenizer.apply_chat_template(..., tokenize=False)`.
Chat templates come from model files, i.e. untrusted code: hence the sandbox.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Any

from services.common.errors import InvalidRequest

logger = logging.getLogger(__name__)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would change prompts.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class():
    import jinja2

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore attributes (no reaching CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace: {name!r}"
                )

    return TemplateNamespace


@lru_cache(maxsize=16)
def compile_template(source: str):
    """Compile a chat template in the sandbox transformers uses (cached by source)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env.from_string(source)


def _normalize_messages(messages: list[dict]) -> list[dict]:
    """Copy the messages, dropping None values as transformers does (`content=None`)."""
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(
                f"chat message {index} must be an object with 'role' and 'content'"
            )
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def render_chat_template(
    source: str,
    messages: list[dict],
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with the chat template `source`.

    Args:
        source: the Jinja template text (tokenizer_config.json `chat_template`).
        messages: [{"role": ..., "content": ...}, ...].
        special_tokens: template variables such as {"bos_token": "<s>", "eos_token": "</s>"}.
        add_generation_prompt: end with the assistant turn header.
        tools: JSON schemas of tools, for templates that render them.

    Raises:
        InvalidRequest: the template refused the messages (`raise_exception`) or failed.
    """
    import jinja2

    template = compile_template(source)
    variables = {**special_tokens, **kwargs}
    try:
        return template.render(
            messages=_normalize_messages(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidRequest(f"the model's chat template rejected the messages: {exc}") from exc
    except (TypeError, KeyError, AttributeError) as exc:
        raise InvalidRequest(
            f"the model's chat template could not render the messages ({exc}); "
            "each message needs a string 'role' and 'content'"
        ) from exc
