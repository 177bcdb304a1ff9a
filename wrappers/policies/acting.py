"""From env observations to the actions an env accepts: what :meth:`LLMWrapperBase.act` does for every backend.

The observations are read by the policy's input mode (:mod:`chatenv.modes`), turned into the policy's input
tensordict (with the envs' token views when given, or carried by text observations), generated from, and the
responses turned back into actions by the same mode: reply messages, reply text, or the generated ids verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tensordict import TensorDictBase

from chatenv.modes import attached_views, get_mode

if TYPE_CHECKING:
    from wrappers.policies.base import LLMWrapperBase

__all__ = ["act"]


def act(
    policy: LLMWrapperBase, observations: Any, token_views: Sequence[tuple[Any, Any]] | None = None
) -> tuple[Any, TensorDictBase]:
    """Generate actions for env observations with ``policy`` (see :meth:`LLMWrapperBase.act`)."""
    if not policy.generate:
        raise ValueError("act() generates actions; this policy scores (generate=False)")
    mode = get_mode(policy.input_mode)
    if token_views is None and mode.name == "text":
        token_views = attached_views(observations)  # an env's text observations carry its token view
    single, batch = mode.split_batch(observations)
    if not batch:
        raise ValueError("act() got no observations; give one observation or a non-empty list of them")
    if token_views is not None and single and len(token_views) != 1:
        token_views = [token_views]  # one observation's (ids, mask), not a list of one view
    td = mode.policy_input(
        batch,
        input_key=policy.input_key,
        pad_token_id=policy.pad_token_id,
        token_views=token_views,
        tokens_key=policy.tokens_key,
        masks_key=policy.masks_key,
    )
    out = policy(td)
    tokens = out.get(policy.tokens_key)
    if policy.num_samples is not None and not policy.pad_output:
        responses = [r for b in range(tokens.batch_size[0]) for r in tokens[b].unpadded("response")]
    else:
        flat = tokens.reshape(-1) if policy.num_samples is not None else tokens
        responses = flat.unpadded("response")
    actions: list = [mode.action(r, policy.chat_tokenizer) for r in responses]
    if policy.num_samples is not None:
        n = policy.num_samples
        actions = [actions[i : i + n] for i in range(0, len(actions), n)]
    return (actions[0] if single else actions), out
