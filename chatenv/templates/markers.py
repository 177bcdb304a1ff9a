"""Control markers: the special-token strings a tokenizer holds and the marker strings a template source spells.

:func:`special_strings` lists a tokenizer's special tokens (the candidates
:func:`~chatenv.templates.derive.derive_profile` looks for after a reply); :func:`template_markers` reads the
control markers off a template's source, and :func:`tokenizer_for_template` adds them to a copy of a tokenizer so
that a template file can be checked without its model's tokenizer.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

__all__ = ["special_strings", "template_markers", "tokenizer_for_template"]

_Tokenizer = TypeVar("_Tokenizer")


def special_strings(tokenizer: Any) -> list[str]:
    """The strings of a tokenizer's special tokens (added tokens marked special, and the named ones)."""
    out = set()
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok.content if hasattr(tok, "content") else tok))
    out.update(str(t) for t in getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted(out)


# Control markers a template writes: <|...|>, <|...>, <...|>, <｜...｜> (DeepSeek), <start_of_turn>-style words,
# [gMASK]-style words. Bracketed words without those shapes (<think>, <tool_call>) are ordinary added tokens.
_MARKER = re.compile(
    r"<\|[^<>|\s'\"\\]{1,40}\|>|<\|[^<>|\s'\"\\]{1,40}>|<[^<>|\s'\"\\]{1,40}\|>|<｜[^<>｜'\"\\]{1,40}｜>"
    r"|<(?:start|end)_of_[a-z_]{2,30}>|<(?:bos|eos|sop|eop)>|</?s>|\[[A-Za-z_]{2,20}\]"
)
_TAG = re.compile(r"</?[A-Za-z_][A-Za-z_]{1,30}>")


def template_markers(source: str) -> tuple[list[str], list[str]]:
    """The control markers a template's source spells, as ``(special, plain_tags)``.

    ``special`` are strings shaped like control tokens (``<|im_end|>``, ``<turn|>``, ``<｜User｜>``,
    ``<end_of_turn>``, ``[gMASK]``); ``plain_tags`` are XML-like tags (``<think>``, ``<tool_call>``) that real
    tokenizers usually hold as ordinary added tokens.
    """
    special = sorted(set(_MARKER.findall(source)))
    tags = sorted(set(_TAG.findall(source)) - set(special))
    return special, tags


def tokenizer_for_template(source: str, base: _Tokenizer) -> _Tokenizer:
    """A copy of ``base`` (a fast tokenizer) that renders with ``source`` and holds its markers as tokens.

    The template's control markers (:func:`template_markers`) become special tokens and its XML-like tags ordinary
    added tokens, as in the models' own tokenizers; ``chat_template`` is set to ``source``. This is how a template
    file is checked without its model's tokenizer (``chatenv check --template FILE``); the ids differ from the
    model's, the structure (which token ends a turn, what is content) is the same.
    """
    import copy

    from tokenizers import AddedToken

    copied = copy.deepcopy(base)
    tok: Any = copied  # a Hugging Face tokenizer, changed in place
    special, tags = template_markers(source)
    if special:
        tok.add_special_tokens(
            {"additional_special_tokens": [AddedToken(s, special=True, normalized=False) for s in special]},
            replace_extra_special_tokens=False,
        )
    if tags:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    tok.chat_template = source
    return copied
