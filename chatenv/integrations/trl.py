"""TRL's ``GRPOTrainer`` on chatenv's multi-turn episodes, through TRL's experimental ``rollout_func``.

One call gives the trainer what it needs: ``GRPOTrainer(model, args=..., train_dataset=...,
**grpo_kwargs("chatenv/Arithmetic-v0", max_turns=2))``. Each row of the batch TRL generates for becomes one
episode: its ``prompt`` opens the chat and its other columns (e.g. ``answer``) are the env's reset options, so the
task scores the episode against them. TRL repeats each prompt ``num_generations`` times, one after the other; such a
run is one group of episodes from the same reset (``chatenv.rollout(group_size=G)``).

What TRL gets for each episode (:data:`OUTPUT_KEYS`):

- ``prompt_ids``: the first prompt's ids; ``completion_ids``: every later id of the episode, verbatim (the replies
  *and* the env's messages between them: token-in/token-out, nothing re-tokenized);
- ``env_mask``: 1 on the tokens the assistant sampled (end-of-turn included), 0 on the env's tokens, so only the
  replies are trained on (TRL reads it as its tool mask);
- ``logprobs``: the generation log-probs of the sampled tokens, NaN on the env's tokens (TRL 1.16 leaves NaN out of
  its importance-sampling corrections);
- ``env_reward``: the episode's summed env reward, and ``num_turns``; TRL hands them to the reward functions, and
  :func:`env_reward` returns the first.

TRL calls ``rollout_func(prompts, trainer)`` with the prompts only. A :func:`prompt_dataset` prompt carries its
row's other columns in its first message (:data:`ROW_KEY`, which templates never read and envs never see); other
datasets' rows are found by prompt in the dataset the trainer draws from (a prompt that several rows share with
different columns is refused as ambiguous). Nothing reads TRL's internals. Tested with TRL 1.16. Needs the optional
extra: ``pip install 'chatenv-gym[trl]'``.

Example:
    >>> from chatenv.integrations.trl import env_reward
    >>> env_reward(completions=["<answer>3</answer>", "4"], env_reward=[1.1, 0.0])
    [1.1, 0.0]
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from chatenv.errors import MissingDependencyError
from chatenv.integrations.trl_rows import ROW_KEY, RowIndex, carried_row, find_row, plan, reset_options
from chatenv.rollout import episodes, rollout
from chatenv.sampling import GenerationSettings, SettingError, normalize_generate_kwargs

__all__ = ["OUTPUT_KEYS", "ROW_KEY", "ChatEnvRollout", "env_reward", "grpo_kwargs", "prompt_dataset", "rollout_func"]

#: The keys a rollout returns: the three TRL requires, the mask it reads as its tool mask, and the reward fields it
#: forwards to the reward functions.
OUTPUT_KEYS = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward", "num_turns")

_EXTRA = "pip install 'chatenv-gym[trl]'"

#: TRL's sampling arguments (``GRPOConfig``), named as the settings are
_TRL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(f"the TRL integration needs {module}: {_EXTRA}") from e


def lazy_classes(module: str, factories: dict[str, Callable[[], type]]) -> Callable[[str], type]:
    """A module ``__getattr__`` that builds each named class on first use.

    TRL is an optional extra: the classes derive from its trainers, so they exist only once it is imported.
    """
    made: dict[str, type] = {}

    def __getattr__(name: str) -> type:
        if name not in factories:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if name not in made:
            _require("trl")
            made[name] = factories[name]()
        return made[name]

    return __getattr__


class ChatEnvRollout:
    """A ``rollout_func`` for TRL's ``GRPOTrainer``: one chatenv episode per prompt TRL passes.

    Build it with :func:`rollout_func`. Calling it runs the episodes with :func:`chatenv.rollout` (envs in tokens
    mode, built once and reused) and returns TRL's fields (:data:`OUTPUT_KEYS`), one entry per prompt.

    Attributes:
        last_episodes: The :func:`chatenv.episodes` view of the latest call (one row per prompt, in order): what
            the envs recorded, for inspection (``turn_version``: the policy version of each reply, when the policy
            counts versions).
        last_version: The policy's version when the latest call's episodes were assembled (None if it counts
            none); :mod:`chatenv.integrations.trl_offpolicy` measures staleness against it.
    """

    def __init__(
        self,
        env: str | Callable[[], Any],
        policy: Any = None,
        *,
        max_new_tokens: int | None = None,
        generate_kwargs: Mapping[str, Any] | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
    ):
        env_kwargs = dict(env_kwargs or {})
        if isinstance(env, str):
            if env_kwargs.get("input_mode", "tokens") != "tokens":
                raise ValueError(
                    f"TRL trains on the ids the policy sampled: the envs run in input_mode='tokens', got "
                    f"input_mode={env_kwargs['input_mode']!r}"
                )
            env_kwargs["input_mode"] = "tokens"
        elif not callable(env):
            raise TypeError(f"expected an env id (str) or a factory returning an env, got {type(env).__name__}")
        elif env_kwargs:
            raise ValueError(f"env keyword arguments {sorted(env_kwargs)} apply to an env id, not to a factory")
        if policy is not None and getattr(policy, "input_mode", None) != "tokens":
            raise ValueError(
                f"the policy must use input_mode='tokens' (got {getattr(policy, 'input_mode', None)!r}); TRL trains on "
                "the ids it sampled"
            )
        self.env = env
        self.env_kwargs = env_kwargs
        self.policy = policy
        self.max_new_tokens = _budget(max_new_tokens)
        # the reply budget is this rollout's or TRL's max_completion_length: bounds are checked against it later
        self.settings = normalize_generate_kwargs(generate_kwargs, budget_elsewhere=True)
        self.last_episodes: Any = None
        self.last_version: int | None = None
        self._envs: list[Any] = []
        self._own_policy: Any = None
        self._indexes: list[RowIndex] = []

    def __call__(
        self, prompts: Sequence[Any], trainer: Any, rows: Sequence[Mapping[str, Any]] | None = None
    ) -> dict[str, list[Any] | None]:
        """Run one episode per prompt and return TRL's fields for them.

        Args:
            prompts: What TRL passes: chats (lists of message dicts) or plain strings (one user message).
            trainer: The ``GRPOTrainer`` (its model, tokenizer, arguments and number of generations are read now,
                at every call).
            rows: The dataset rows of the prompts (their other columns become reset options). Default: carried by
                :func:`prompt_dataset` prompts, else found by prompt in the trainer's train (eval) dataset.

        Returns:
            A dict of lists with one entry per prompt, keys :data:`OUTPUT_KEYS`.

        Raises:
            ValueError: For ``rows`` not matching the prompts, a row column named ``messages``, or a prompt whose
                row cannot be found (not in the trainer's dataset, or ambiguous there).
        """
        if not prompts:
            return {key: [] for key in OUTPUT_KEYS}
        rows = self._rows(prompts, trainer) if rows is None else list(rows)
        if len(rows) != len(prompts):
            raise ValueError(f"expected one row per prompt ({len(prompts)}), got {len(rows)}")
        options = [reset_options(p, r) for p, r in zip(prompts, rows)]
        size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        envs = self._env_list(len(options), _tokenizer_of(trainer))
        with self._generating(trainer) as policy:
            td = rollout(envs, policy, episodes=len(options), seed=_step_seed(trainer), **plan(options, size))
            version = getattr(policy, "version", None)
            self.last_version = version if isinstance(version, int) else None
        view = episodes(td)
        self.last_episodes = view
        return _trl_fields(view)

    def _rows(self, prompts: Sequence[Any], trainer: Any) -> list[dict[str, Any]]:
        """The dataset rows of ``prompts``.

        Carried in the prompts (:func:`prompt_dataset`), else looked up by prompt in the trainer's datasets (train,
        then eval).
        """
        carried = [carried_row(p) for p in prompts]
        if all(c is not None for c in carried):
            return [c for c in carried if c is not None]
        evals = trainer.eval_dataset
        found = [trainer.train_dataset, *(evals.values() if isinstance(evals, Mapping) else [evals])]
        datasets = [d for d in found if d is not None]
        if [id(d) for d in datasets] != [id(i.dataset) for i in self._indexes]:
            self._indexes = [RowIndex(d) for d in datasets]
        return [c if c is not None else find_row(self._indexes, p) for c, p in zip(carried, prompts)]

    # ------------------------------------------------------------------------------------------ envs, policy

    def _env_list(self, n: int, tokenizer: Any) -> list[Any]:
        """``n`` envs, made once (env ids get the trainer's tokenizer unless one is given) and reused."""
        while len(self._envs) < n:
            if isinstance(self.env, str):
                kwargs = {"tokenizer": tokenizer, **self.env_kwargs}
                self._envs.append(gym.make(self.env, **kwargs))
            else:
                self._envs.append(self.env())
        return self._envs[:n]

    @contextlib.contextmanager
    def _generating(self, trainer: Any) -> Iterator[Any]:
        """The policy for this call: the one given, or a ``TransformersWrapper`` on the trainer's current model."""
        if self.policy is not None:
            yield self.policy
            return
        from trl.models.utils import unwrap_model_for_generation

        with unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=getattr(trainer.args, "ds3_gather_for_generation", True),
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model:
            training = model.training
            model.eval()  # no dropout while sampling: the log-probs are those of the sampled distribution
            try:
                yield self._policy_on(model, trainer)
            finally:
                model.train(training)

    def _policy_on(self, model: Any, trainer: Any) -> Any:
        """A tokens-mode ``TransformersWrapper`` on ``model`` (kept while the trainer keeps the same model object)."""
        if self._own_policy is None or self._own_policy.model is not model:
            from wrappers.policies import TransformersWrapper

            settings = _trl_settings(trainer.args).with_overrides(**self.settings.as_kwargs())
            if "max_new_tokens" not in settings.explicit:
                budget = self.max_new_tokens or trainer.args.max_completion_length
                settings = settings.with_overrides(max_new_tokens=budget)
            self._own_policy = TransformersWrapper(
                model, tokenizer=_tokenizer_of(trainer), input_mode="tokens", generate_kwargs=settings
            )
        return self._own_policy

    def close(self) -> None:
        """Close the envs this rollout made (it makes new ones if called again)."""
        for env in self._envs:
            env.close()
        self._envs = []


# ---------------------------------------------------------------------------------------------- helpers


def _tokenizer_of(trainer: Any) -> Any:
    processing = trainer.processing_class
    return getattr(processing, "tokenizer", processing)  # a multimodal processor holds its tokenizer


def _step_seed(trainer: Any) -> int:
    """A seed per training step, from TRL's seed (reset options pin the problems; it matters to what they do not).

    Below 2**29, so a step's episode seeds stay below the held-out ones of ``chatenv eval`` (2**30 on).
    """
    entropy = [int(trainer.args.seed), int(trainer.state.global_step)]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0]) >> 3


def _budget(max_new_tokens: Any) -> int | None:
    """``max_new_tokens`` checked as the setting is (None: TRL's ``max_completion_length``, read at each call)."""
    if max_new_tokens is None:
        return None
    try:
        return normalize_generate_kwargs({"max_new_tokens": max_new_tokens}).max_new_tokens
    except SettingError as e:
        raise e.renamed("max_new_tokens") from None


def _trl_settings(args: Any) -> GenerationSettings:
    """TRL's sampling arguments as generation settings (its loss scales logits by the same temperature)."""
    given = {name: getattr(args, name) for name in _TRL_SAMPLING if getattr(args, name, None) is not None}
    try:
        return normalize_generate_kwargs(given)
    except SettingError as e:
        raise e.renamed(f"GRPOConfig.{e.key}") from None


def _trl_fields(view: Any) -> dict[str, list[Any] | None]:
    """TRL's per-completion lists from an episode view."""
    tokens = view["tokens"]
    prompts, completions = tokens.unpadded("prompt"), tokens.unpadded("response")
    masks = view["masks"].unpadded("all_assistant_mask")
    # a policy that returns no log-probs leaves TRL without sampling log-probs (None: it then uses its own)
    log_probs = view["log_probs"].unpadded("response") if "log_probs" in view.keys() else None
    return {
        "prompt_ids": [p.tolist() for p in prompts],
        "completion_ids": [c.tolist() for c in completions],
        "logprobs": None if log_probs is None else [[float(x) for x in lp.tolist()] for lp in log_probs],
        "env_mask": [m[len(p) :].int().tolist() for m, p in zip(masks, prompts)],
        "env_reward": [float(r) for r in view["reward"].tolist()],
        "num_turns": [int(t) for t in view["num_turns"].tolist()],
    }


# ---------------------------------------------------------------------------------------------- public


def rollout_func(
    env: str | Callable[[], Any],
    policy: Any = None,
    *,
    max_new_tokens: int | None = None,
    generate_kwargs: Mapping[str, Any] | None = None,
    **env_kwargs: Any,
) -> ChatEnvRollout:
    """The ``rollout_func`` for TRL's ``GRPOTrainer``: each prompt runs as a multi-turn chatenv episode.

    Args:
        env: A registered env id (made with ``gymnasium.make(env, input_mode="tokens", tokenizer=<the trainer's>,
            **env_kwargs)``) or a factory returning a tokens-mode env.
        policy: A tokens-mode policy wrapper (e.g. a ``VLLMWrapper`` kept in sync by you). Default: a
            ``TransformersWrapper`` on the trainer's model, read at every call (never a stale copy).
        max_new_tokens: Tokens per reply (default: TRL's ``max_completion_length``); an episode's completion holds
            all its replies and the env's messages between them.
        generate_kwargs: Generation settings of the default policy (checked now), over TRL's ``temperature``,
            ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty``.
        **env_kwargs: Arguments for ``gymnasium.make`` (e.g. ``max_turns=2``).

    Returns:
        A :class:`ChatEnvRollout` to pass as ``GRPOTrainer(rollout_func=...)``.

    Raises:
        MissingDependencyError: Without TRL.
        ValueError: For an env id with ``input_mode`` other than tokens, a policy in another mode, or env
            arguments with a factory.
        SettingError: For ``max_new_tokens`` or ``generate_kwargs`` out of range (:mod:`chatenv.sampling`).
    """
    _require("trl")
    return ChatEnvRollout(
        env, policy, max_new_tokens=max_new_tokens, generate_kwargs=generate_kwargs, env_kwargs=env_kwargs
    )


def env_reward(
    completions: Sequence[Any], env_reward: Sequence[float] | None = None, **kwargs: Any
) -> list[float | None]:
    """TRL reward function: the env's summed reward of each episode (the ``env_reward`` field of the rollout).

    TRL calls it with the rollout's extra fields as keyword arguments. It also logs the mean number of turns
    (``env/num_turns``) when TRL passes ``log_metric``.

    Args:
        completions: The completions TRL decoded (one per episode; only their number is used).
        env_reward: The rollout's summed env rewards.
        **kwargs: TRL's other reward arguments (``num_turns``, ``log_metric``, dataset columns, ...).

    Returns:
        One float per completion (None, which TRL reads as "not scored", where a reward is NaN).

    Raises:
        ValueError: Without ``env_reward`` (TRL was not given a chatenv rollout), or with one of the wrong length.
    """
    if env_reward is None:
        raise ValueError("env_reward needs the 'env_reward' field of a chatenv rollout: pass rollout_func(...) to TRL")
    if len(env_reward) != len(completions):
        raise ValueError(f"expected one env reward per completion ({len(completions)}), got {len(env_reward)}")
    turns, log_metric = kwargs.get("num_turns"), kwargs.get("log_metric")
    if turns and callable(log_metric):
        log_metric("env/num_turns", sum(turns) / len(turns))
    return [None if math.isnan(r) else float(r) for r in env_reward]


def grpo_kwargs(env: str | Callable[[], Any], policy: Any = None, **kwargs: Any) -> dict[str, Any]:
    """``GRPOTrainer`` keyword arguments for chatenv episodes: ``rollout_func`` and ``reward_funcs``.

    ``GRPOTrainer(model, args=config, train_dataset=dataset, **grpo_kwargs("chatenv/Arithmetic-v0", max_turns=2))``.
    Add reward functions of your own with ``kwargs["reward_funcs"].append(fn)``.

    Args:
        env: As for :func:`rollout_func`.
        policy: As for :func:`rollout_func`.
        **kwargs: The other arguments of :func:`rollout_func`.

    Returns:
        ``{"rollout_func": rollout_func(env, policy, **kwargs), "reward_funcs": [env_reward]}``.
    """
    return {"rollout_func": rollout_func(env, policy, **kwargs), "reward_funcs": [env_reward]}


def prompt_dataset(env: str | Any, n: int, *, seed: int = 0, **env_kwargs: Any) -> Any:
    """A ``datasets.Dataset`` of ``n`` problems drawn by an env: ``prompt`` and the task's state as columns.

    Row ``i`` is the opening of ``env.reset(seed=seed + i)``; the task's initial state (e.g. ``answer`` for
    arithmetic, ``secret`` for GuessNumber) gives the other columns (its scalar entries), which become the reset
    options of the episodes TRL runs on that row. The prompt's first message also carries them (:data:`ROW_KEY`), so
    the rollout finds a prompt's row without searching the dataset.

    Args:
        env: An env id (made with ``**env_kwargs``) or an env.
        n: Number of rows.
        seed: Seed of the first row.
        **env_kwargs: Arguments for ``gymnasium.make``.

    Returns:
        The dataset.

    Raises:
        MissingDependencyError: Without the ``datasets`` package.
        ValueError: For ``n < 1``.
    """
    datasets = _require("datasets")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    made = isinstance(env, str)
    if made:
        drawn: Any = gym.make(env, **env_kwargs)
    elif env_kwargs:
        raise ValueError(f"env keyword arguments {sorted(env_kwargs)} apply to an env id, not to an env")
    else:
        drawn = env
    rows = []
    try:
        for i in range(n):
            drawn.reset(seed=seed + i)
            base = drawn.unwrapped
            state = base.episode.state if isinstance(base.episode.state, Mapping) else {}
            scalars = {k: v for k, v in state.items() if isinstance(v, (bool, int, float, str))}
            messages = base.messages
            messages[0] = {**messages[0], ROW_KEY: json.dumps(scalars)}
            rows.append({"prompt": messages, **scalars})
    finally:
        if made:
            drawn.close()
    return datasets.Dataset.from_list(rows)
