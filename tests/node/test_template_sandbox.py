"""Chat templates are bounded in steps, time and size (``moeswarm.node._template_sandbox``)."""

from __future__ import annotations

import pytest

from moeswarm.errors import ConfigError
from moeswarm.node.service import ChatTemplate

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 100
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_real_template_renders_a_long_chat_within_its_budget() -> None:
    text = ChatTemplate(CHATML).render(MESSAGES)
    assert text.count("<|im_start|>") == len(MESSAGES) + 1 and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("source", "why"), [
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% for a in 'x' * 4000000 %}{% endfor %}", "steps"),
    ("{{ 'x' * 1000000000 }}", "built a value"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "built a value"),
    ("{{ 9 ** 9999999 }}", "power"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "characters"),
])
def test_a_hostile_template_is_stopped_with_a_config_error(source: str, why: str) -> None:
    with pytest.raises(ConfigError, match="went over its limits") as caught:
        ChatTemplate(source).render(MESSAGES[:1])
    assert why in str(caught.value)
