"""vLLM's token routes on the capture endpoint: prompts as ids, replies as ids, every segment token-exact.

:mod:`.routes` (``/v1/chat/completions/tokens``, ``/v1/completions``, ``/inference/v1/generate``, SGLang's
``/generate``, ``/tokenize``, ``/detokenize``), :mod:`.request` (their requests), :mod:`.completions` and
:mod:`.sglang` (those two routes), :mod:`.output`
(their replies), :mod:`.prompt` (client prompt ids checked against the session's), :mod:`.extras`
(``return_token_ids``, ``return_tokens_as_token_ids``, ``skip_special_tokens`` on the chat routes). The package
imports nothing at import time, so the chat dialect can use :mod:`.extras`.
"""

from __future__ import annotations

__all__: list[str] = []
