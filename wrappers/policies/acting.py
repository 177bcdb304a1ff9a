"""From env observations to the actions an env accepts: what :meth:`LLMWrapperBase.act` does for every backend.

The observations are read by the policy's input mode (:mod:`chatenv.modes`), turned into the policy's input
tensordict (with the envs' token views when given, or carried by text observations), generated from, and the
responses turned back into actions by the same mode: reply messages, reply text, or the generated ids verbatim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tensordict import TensorDictBase

from chatenv.modes import attached_views, get_mode

__all__ = ["ObservationActing"]


class ObservationActing:
    """The env-facing side of a policy: :meth:`act` (a mixin of :class:`~wrappers.policies.base.LLMWrapperBase`).

    It uses only the policy's public options (``generate``, ``input_mode``, ``input_key``, output keys, pad id,
    ``num_samples``, ``pad_output``), its chat tokenizer, and calling it on a tensordict.
    """

    generate: bool
    input_mode: str
    input_key: Any
    tokens_key: Any
    masks_key: Any
    num_samples: int | None
    pad_output: bool
    pad_token_id: int
    chat_tokenizer: Any
    __call__: Callable[..., TensorDictBase]

    def act(
        self, observations: Any, token_views: Sequence[tuple[Any, Any]] | None = None
    ) -> tuple[Any, TensorDictBase]:
        """Generate actions for env observations, without building tensordicts by hand.

        Without ``token_views``, history mode renders and tokenizes the chats (content encoded as plain text), and
        text mode uses the token view an env's text observation carries (:class:`~chatenv.modes.PromptText`), so
        content that spells markup stays content. Only a plain ``str`` made elsewhere is tokenized with special
        tokens recognised (markup spelled in it becomes markup). Pass the envs' token views to generate after
        exactly the ids each env holds.

        Args:
            observations: One observation or a batch (list) of them, as the env returns them: in history mode
                a list of message dicts per observation, in text mode the prompt text, in tokens mode the prompt
                ids (a list, array or tensor of ints).
            token_views: Per observation, the env's own ``(ids, assistant_mask)`` (``env.token_view()``; one pair
                for a single observation): generation starts after exactly these ids, and the prompt's assistant
                mask is the env's (see :meth:`chatenv.modes.InputMode.policy_input`).

        Returns:
            ``(actions, tensordict)``: the actions the env accepts (history: the reply message dict; text: the
            reply text, or a cut reply as ``{"role": "assistant", "content": ..., "is_complete": False}``;
            tokens: the generated ids as an int64 numpy array), one per observation (a list of ``num_samples``
            per observation with ``num_samples``), and the output tensordict with tokens, masks and log-probs. A
            single observation gives a single action.

        Raises:
            TypeError: For observations of another input mode (the message names the mode that reads them), or
                token ids that are not integers or not one 1-D sequence (float ids are never rounded).
            ValueError: For no observations, an empty one, ids outside the vocabulary, a prompt that leaves no room
                for ``max_new_tokens`` in the model's context, views that do not match the observations, or a
                scoring policy. A refused call changes nothing (not even the per-call seed sequence).
        """
        if not self.generate:
            raise ValueError("act() generates actions; this policy scores (generate=False)")
        mode = get_mode(self.input_mode)
        if token_views is None and mode.name == "text":
            token_views = attached_views(observations)  # an env's text observations carry its token view
        single, batch = mode.split_batch(observations)
        if not batch:
            raise ValueError("act() got no observations; give one observation or a non-empty list of them")
        if token_views is not None and single and len(token_views) != 1:
            token_views = [token_views]  # one observation's (ids, mask), not a list of one view
        td = mode.policy_input(
            batch,
            input_key=self.input_key,
            pad_token_id=self.pad_token_id,
            token_views=token_views,
            tokens_key=self.tokens_key,
            masks_key=self.masks_key,
        )
        out = self(td)
        tokens = out.get(self.tokens_key)
        if self.num_samples is not None and not self.pad_output:
            responses = [r for b in range(tokens.batch_size[0]) for r in tokens[b].unpadded("response")]
        else:
            flat = tokens.reshape(-1) if self.num_samples is not None else tokens
            responses = flat.unpadded("response")
        actions: list = [mode.action(r, self.chat_tokenizer) for r in responses]
        if self.num_samples is not None:
            n = self.num_samples
            actions = [actions[i : i + n] for i in range(0, len(actions), n)]
        return (actions[0] if single else actions), out
