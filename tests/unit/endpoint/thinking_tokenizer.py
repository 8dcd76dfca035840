"""A reasoning model's tokenizer for the endpoint tests: the character tokenizer with a Qwen3-like chat template.

Like Qwen3's, the template writes an assistant turn's reasoning (`reasoning_content`) as a
`<think>...</think>` block only for assistant turns after the last user message, and for the last
message always (an empty block when it has no reasoning); earlier turns' reasoning is dropped. Its
`enable_thinking=False` switch writes an empty block after the generation prompt. Everything stays
within the character tokenizer's CHARSET, so each character is one token.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from dockyard.models.tokenizer import build_char_tokenizer

THINKING_TEMPLATE: str = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% if tools %}tools:{% for tool in tools %}"
    "{% set fn = tool['function'] if tool['function'] is defined else tool %}"
    " {{ fn['name'] }}({{ ((fn['parameters'] or {})['properties'] or {}) | join(',') }})"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['role'] == 'assistant' and loop.index0 > ns.last_user"
    " and (loop.last or message['reasoning_content']) %}"
    "<think>{{ message['reasoning_content'] or '' }}</think>{% endif %}"
    "{{ message['content'] or '' }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: "
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def build_thinking_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer
