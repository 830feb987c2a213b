"""A model's chat template: ``tokenizer_config.json``'s ``chat_template``, rendered as
transformers renders it.

transformers (``apply_chat_template``) compiles the template in Jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks`` and the
``loopcontrols`` extension, gives it ``raise_exception`` and ``strftime_now`` as globals
and a ``tojson`` filter that keeps non-ASCII characters, and renders it with
``messages``, ``add_generation_prompt`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...). The same is done here, so a model's template gives
the prompt text it was trained on. The text is then encoded without the special tokens
the tokenizer's post-processor would add (the template writes them itself), as
transformers does.

The template is the file ``chat_template.jinja`` beside the tokenizer when there is one
(newer transformers save it there), else ``tokenizer_config.json``'s ``chat_template``:
a string, or a list of named templates of which ``default`` is used. A model with
neither has no chat: ``/v1/chat/completions`` refuses it with a 400 that says so.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ssmserve.server.errors import SsmserveError, clip

log = logging.getLogger(__name__)

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
#: The special tokens a template may name, as transformers passes them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplateError(SsmserveError):
    """A template that cannot be compiled, or that raised while rendering (its
    ``raise_exception``: the messages are not what it accepts): INVALID_ARGUMENT."""


class NoChatTemplateError(SsmserveError):
    """The model has no chat template (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]
    where: str  # the file it came from, for messages

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any
    ) -> str:
        """The prompt text of ``messages`` (raises ChatTemplateError)."""
        import jinja2

        try:
            template = _compiled(self.source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"the chat template of {self.where} does not compile: {clip(exc, 200)}"
            ) from None
        values = {**extra, **self.special_tokens}
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **values
            )
        except jinja2.TemplateError as exc:  # raise_exception's, or a sandbox refusal
            raise ChatTemplateError(
                f"the model's chat template refused these messages: {clip(exc, 300)}"
            ) from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the model's chat template failed on these messages "
                f"({type(exc).__name__}: {clip(exc, 200)}); check their roles and contents"
            ) from None


def load_chat_template(model_path: Path) -> ChatTemplate | None:
    """The chat template of the model at ``model_path`` (a directory, or a GGUF file whose
    directory holds the tokenizer files), or None when it has none."""
    directory = model_path if model_path.is_dir() else model_path.parent
    config_path = directory / CONFIG_FILE
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            log.warning("%s cannot be read (%s): the model has no chat template", config_path, exc)
            return None
        config = loaded if isinstance(loaded, dict) else {}
    special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
    template_path = directory / TEMPLATE_FILE
    if template_path.is_file():
        source = template_path.read_text(encoding="utf-8")
        return ChatTemplate(source, special, str(template_path))
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers takes "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, special, str(config_path))


def _token_text(value: object) -> str:
    """A special token as the config writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


_ENVIRONMENT: Any = None


@functools.lru_cache(maxsize=64)
def _compiled(source: str) -> Any:
    return _environment().from_string(source)


def _environment() -> Any:
    """The sandboxed Jinja environment transformers compiles chat templates in."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENVIRONMENT = env
    return _ENVIRONMENT
