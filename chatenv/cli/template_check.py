"""``chatenv check --template FILE_OR_TOKENIZER_DIR``: certify a chat template and print what was derived."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["check_template", "describe", "load_template_tokenizer"]


def load_template_tokenizer(path: str) -> tuple[Any, str]:
    """A tokenizer for ``path`` and how it was made.

    A folder is a Hugging Face tokenizer folder (loaded offline, with its own chat template). A file is a Jinja chat
    template: it is checked on the embedded SmolLM2 tokenizer with the template's control markers added as special
    tokens (:func:`~chatenv.templates.derive.tokenizer_for_template`), so ids differ from the model's own but the
    structure (what ends a turn, what is content) is the same.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
    """
    if os.path.isdir(path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True), f"tokenizer folder {path}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no template file or tokenizer folder at {path!r}")
    from chatenv.envs.base import shared_default_tokenizer
    from chatenv.templates.derive import tokenizer_for_template

    with open(path, encoding="utf-8") as f:
        source = f.read()
    return tokenizer_for_template(source, shared_default_tokenizer()), f"template file {path} on SmolLM2's tokenizer"


def describe(chat_tokenizer: Any) -> list[str]:
    """Lines saying what the envs use from a template: stops, prompt, formats, how the past is rewritten."""
    template = chat_tokenizer.template
    tok = chat_tokenizer.tokenizer
    stops = ", ".join(f"{tok.decode([i])!r} ({i})" for i in chat_tokenizer.stop_ids)
    lines = [
        f"template:            {template.name or 'the tokenizer’s own'} ({template.description})",
        f"stop ids:            {stops}",
        f"generation header:   {chat_tokenizer.generation_header!r}",
        f"windowed tails:      {chat_tokenizer.windowed}",
        f"tool-call format:    {template.tool_format or 'none'}",
    ]
    profile = template.profile
    if profile is None:
        lines.append("assistant spans:     from the template's {% generation %} markers")
        return lines
    reasoning = profile.reasoning
    lines += [
        "assistant spans:     derived (from the generation prompt to the end-of-turn token)",
        f"content given as:    {'text blocks' if profile.content_blocks else 'str'}",
        f"system message:      {'accepted' if profile.system else 'refused by the template'}",
        f"reply prefix:        {profile.reply_prefix!r}",
        f"end sequence:        {''.join(profile.end_sequence)!r} (a reply ends at its first token; a model may sample "
        "the rest, which is not written again)"
        if profile.end_sequence
        else "end sequence:        the stop token alone",
        "reasoning:           "
        + (
            "none"
            if reasoning is None
            else f"key={reasoning.key!r} open={reasoning.open!r} close={reasoning.close!r} prompt={reasoning.prompt}"
        ),
    ]
    if profile.prefix_stable:
        lines.append("past turns:          never rewritten (prefix-stable): token-exact equality with a fresh render")
    else:
        lines.append("past turns:          rewritten; sampled ids stay verbatim and each step records template_drift:")
        lines += [f"  - {r}" for r in profile.rewrites]
        lines.append(f"  counterexample chat: {json.dumps(list(profile.counterexample or []), ensure_ascii=False)}")
    return lines


def check_template(path: str, seed: int = 0) -> int:
    """Derive, verify and report; then run :func:`chatenv.check` on a ChatEnv with the template. Exit code."""
    from chatenv import ChatEnv
    from chatenv.checker import check
    from chatenv.errors import TemplateError
    from chatenv.tokenization import ChatTokenizer

    try:
        tok, origin = load_template_tokenizer(path)
        ct = ChatTokenizer(tok)
    except (FileNotFoundError, OSError, TemplateError) as e:
        print(f"REFUSED {path}\n{e}")
        return 1
    print(f"checking {origin}")
    for line in describe(ct):
        print(line)
    profile = ct.template.profile
    system = "Answer briefly." if profile is None or profile.system else None
    report = check(
        lambda: ChatEnv("arithmetic", tokenizer=tok, input_mode="tokens", task_kwargs={"system_prompt": system}),
        seed=seed,
        raise_on_failure=False,
    )
    report.env = f"ChatEnv(arithmetic) with {path}"
    print(report)
    return 0 if report.ok else 1
