"""Character-level tokenizer for the tiny recipe.

``build_char_tokenizer`` returns a ``PreTrainedTokenizerFast`` in which every
character of ``CHARSET`` is exactly one token and decoding concatenates
tokens, so ``decode(encode(s)) == s`` for any string over ``CHARSET``. Any
other character maps to ``<unk>``. Special tokens are ``<pad>`` (id 0),
``<eos>`` (id 1), ``<bos>`` (id 2) and ``<unk>`` (id 3); no special token is
added on encode, callers append ``<eos>`` where they need it. Ids are fixed
by ``CHARSET``, and the tokenizer survives ``save_pretrained`` +
``AutoTokenizer.from_pretrained`` unchanged, alone or next to the config of a
model type that does not force its own tokenizer class (``llama`` and
``qwen3`` do not; ``qwen2`` does and swaps in a byte-level tokenizer).

Its chat template (CHAT_TEMPLATE) renders each message as ``role: content``
and a newline, and the generation prompt as ``assistant: ``, all within
``CHARSET``, so conversations tokenize one character per token like any text.
Tools render compactly, since every character is a token: one leading line
``tools: f(x) submit(answer)`` of each tool's name and its parameter names (the
keys of ``function.parameters.properties``, comma-separated; descriptions and
types are not rendered). An assistant's tool calls render as
``<tool_call>{json}</tool_call>`` after its content (the Hermes format the
policy endpoint parses); lowercase tool names and arguments stay within CHARSET.
``build_char_tokenizer(extra_chars, special_tokens)`` appends more characters
and special tokens after these (the ids above never change): tests build each
model family's tool-call tokenizer so.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, BOS, UNK)

# Everything the expression tasks and plausible completions use, plus the rest
# of the lowercase alphabet and some punctuation so a sampled completion like
# "abs(x)" or "x**2" stays representable.
# Appended later (ids of the characters before them never change): what tool-call JSON needs.
CHARSET: str = string.digits + string.ascii_lowercase + " \n=()+-*/%<>!&|^~,.:_[]" + '{}"'


# Tools (when given) come first as one `tools: name(param,...) ...` line (OpenAI-format tools, or bare
# function schemas); an assistant message's tool calls follow its content as Hermes-style
# `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
CHAT_TEMPLATE: str = (
    "{% if tools %}tools:{% for tool in tools %}"
    "{% set fn = tool['function'] if tool['function'] is defined else tool %}"
    " {{ fn['name'] }}({{ ((fn['parameters'] or {})['properties'] or {}) | join(',') }})"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] or '' }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer(extra_chars: str = "", special_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A fresh character-level tokenizer over ``CHARSET``; ``extra_chars`` and ``special_tokens`` (e.g. a
    model family's tool-call tokens, whole tokens that decoding with ``skip_special_tokens`` drops) come
    after it, so the ids of the default tokenizer never change."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET + extra_chars:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One token per character, newlines and spaces included.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
