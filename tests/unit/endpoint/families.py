"""Character tokenizers whose chat templates write assistant tool calls in each family's format.

    family_tokenizer(name) ──> build_char_tokenizer(+ uppercase and JSON escapes, + the family's special
        tokens) with a template of that family: `role: content` lines, the assistant's calls in the
        family's format, `<eos>` ending an assistant turn

The templates are this project's own, written to the formats' public descriptions; each renders the
feature `dockyard.agents.tool_formats` detects its format by. `completion(tokenizer, messages, reply)`
is what a policy would sample for `reply` after `messages`: the rendered conversation with the reply
less the rendered prompt with its generation prompt.
"""

from __future__ import annotations

import string

from transformers import PreTrainedTokenizerFast

from dockyard.agents.tool_formats import deepseek_v3, harmony, llama3_json, mistral
from dockyard.models.tokenizer import build_char_tokenizer

EXTRA_CHARS = string.ascii_uppercase + "\\'`;#?@$\t"

_TOOLS = (
    "{% if tools %}tools:{% for tool in tools %} {{ (tool.function or tool).name }}{% endfor %}{{ '\\n' }}{% endif %}"
)
_ARGS = "call.function.arguments | tojson"


def _lines(calls: str, content_with_calls: bool = True) -> str:
    """A template of `role: content` lines whose assistant turns end with their calls, then <eos>
    (a family whose calls are the whole message renders no content beside them)."""
    content = "{{ message.content or '' }}"
    if not content_with_calls:
        content = "{% if not message.tool_calls %}" + content + "{% endif %}"
    return (
        _TOOLS + "{% for message in messages %}"
        "{% if message.role == 'assistant' %}assistant: " + content + ""
        "{% if message.tool_calls %}" + calls + "{% endif %}<eos>"
        "{% else %}{{ message.role }}: {{ message.content or '' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )


TEMPLATES = {
    "hermes": _lines(
        "{% for call in message.tool_calls %}<tool_call>"
        "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
    ),
    "qwen3_coder": _lines(
        "{% for call in message.tool_calls %}\n<tool_call>\n<function={{ call.function.name }}>\n"
        "{% for key, value in call.function.arguments.items() %}<parameter={{ key }}>\n"
        "{% if value is string %}{{ value }}{% else %}{{ value | tojson }}{% endif %}{{ '\\n' }}</parameter>\n"
        "{% endfor %}</function>\n</tool_call>{% endfor %}"
    ),
    "llama3_json": _lines(
        llama3_json.PYTHON_TAG + "{% for call in message.tool_calls %}"
        "{{ {'name': call.function.name, 'parameters': call.function.arguments} | tojson }}"
        "{% if not loop.last %}; {% endif %}{% endfor %}",
        content_with_calls=False,
    ),
    "mistral": _lines(
        mistral.TOOL_CALLS + "[{% for call in message.tool_calls %}"
        "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
        "{% if not loop.last %}, {% endif %}{% endfor %}]"
    ),
    "mistral_named": _lines(
        "{% for call in message.tool_calls %}"
        + mistral.TOOL_CALLS
        + "{{ call.function.name }}"
        + mistral.ARGS
        + "{{ "
        + _ARGS
        + " }}{% endfor %}"
    ),
    "deepseek_v3": _lines(
        deepseek_v3.CALLS_BEGIN
        + "{% for call in message.tool_calls %}"
        + deepseek_v3.CALL_BEGIN
        + "function"
        + deepseek_v3.SEP
        + "{{ call.function.name }}\n```json\n{{ "
        + _ARGS
        + " }}\n```"
        + deepseek_v3.CALL_END
        + "{% endfor %}"
        + deepseek_v3.CALLS_END
    ),
    # Harmony: every message is <|start|>role...; the generation prompt opens the assistant's first one.
    "harmony": (
        "{% for message in messages %}{% if message.role == 'assistant' %}<|start|>assistant"
        "{% set ns = namespace(opened=true) %}"
        "{% if message.content %}<|channel|>final<|message|>{{ message.content }}<|end|>"
        "{% set ns.opened = false %}{% endif %}"
        "{% for call in message.tool_calls or [] %}{% if not ns.opened %}<|start|>assistant{% endif %}"
        "{% set ns.opened = false %}<|channel|>commentary to=functions.{{ call.function.name }} "
        "<|constrain|>json<|message|>{{ " + _ARGS + " }}<|call|>{% endfor %}"
        "{% else %}<|start|>{{ message.role }}<|message|>{{ message.content or '' }}<|end|>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
    ),
}
SPECIALS = {
    "llama3_json": llama3_json.MARKERS,
    "mistral": mistral.MARKERS,
    "mistral_named": mistral.MARKERS,
    "deepseek_v3": deepseek_v3.MARKERS,
    "harmony": harmony.MARKERS,
}


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    tokenizer = build_char_tokenizer(EXTRA_CHARS, SPECIALS.get(family, ()))
    tokenizer.chat_template = TEMPLATES[family]
    return tokenizer


def completion(tokenizer: PreTrainedTokenizerFast, messages: list[dict], reply: dict, tools: list[dict]) -> str:
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*messages, reply], tools=tools, tokenize=False)
    assert full.startswith(prompt), "the template renders the prompt as a prefix of the conversation"
    return full[len(prompt) :]
