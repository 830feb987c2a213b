"""The chat template, rendered as transformers renders it (``http.chat_template``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssmserve.server.http.chat_template import ChatTemplateError, load_chat_template

MESSAGES = [{"role": "user", "content": "café 日本"}]


def write(directory: Path, config: dict[str, object]) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_the_config_s_template_with_its_special_tokens_and_blocks_trimmed(tmp_path):
    template = (
        "{{ bos_token }}\n  {% for m in messages %}\n"
        "[{{ m['role'] }}] {{ m['content'] | tojson }}\n  {% endfor %}\n"
        "{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}"
    )
    config = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    found = load_chat_template(write(tmp_path / "m", config))
    assert found is not None
    # trim_blocks and lstrip_blocks: a block tag's indented line leaves nothing; tojson
    # keeps UTF-8
    assert found.render(MESSAGES, True) == '<s>\n[user] "café 日本"\n[assistant]</s>'
    assert found.render(MESSAGES, False) == '<s>\n[user] "café 日本"\n</s>'


def test_named_templates_a_jinja_file_and_none(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    found = load_chat_template(write(tmp_path / "named", {"chat_template": named}))
    assert found is not None and found.render(MESSAGES, True) == "D"
    beside = write(tmp_path / "file", {"chat_template": "config"})
    (beside / "chat_template.jinja").write_text("file")
    found = load_chat_template(beside)
    assert found is not None and found.render(MESSAGES, True) == "file"
    assert load_chat_template(write(tmp_path / "none", {"bos_token": "<s>"})) is None
    assert load_chat_template(tmp_path / "missing") is None


def test_raise_exception_and_the_sandbox_refuse_with_a_message(tmp_path):
    refusing = "{{ raise_exception('only user turns, please') }}"
    found = load_chat_template(write(tmp_path / "r", {"chat_template": refusing}))
    assert found is not None
    with pytest.raises(ChatTemplateError, match="only user turns, please"):
        found.render(MESSAGES, True)
    escaping = "{{ messages.__class__.__mro__ }}"
    found = load_chat_template(write(tmp_path / "s", {"chat_template": escaping}))
    assert found is not None
    with pytest.raises(ChatTemplateError, match="refused"):
        found.render(MESSAGES, True)
    mutating = "{% set _ = messages.append(1) %}x"
    found = load_chat_template(write(tmp_path / "m", {"chat_template": mutating}))
    assert found is not None
    with pytest.raises(ChatTemplateError):
        found.render(MESSAGES, True)
    broken = load_chat_template(write(tmp_path / "b", {"chat_template": "{% for %}"}))
    assert broken is not None
    with pytest.raises(ChatTemplateError, match="does not compile"):
        broken.render(MESSAGES, True)
