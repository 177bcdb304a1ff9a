"""``chatenv eval``: a model's success on held-out problems, greedy and sampled, with pass@k and success by turn.

Held-out seeds never meet the training ones, by construction: ``chatenv train`` draws the problems of group ``g``
from seed ``--seed + g`` and refuses a run whose seeds would reach :data:`HELD_OUT_SEED` (2**30), while held-out
problem ``i`` resets with seed ``HELD_OUT_SEED + --seed + i``. Disjoint seeds are not disjoint problems in a small
task space: one-digit additions have 100 problems, so held-out seeds repeat problems among themselves and problems
a training run saw. ``chatenv eval`` cannot know what a model was trained on; it reports the number of distinct
problems (different opening chats) among its episodes. ``chatenv train --eval-every`` also counts the held-out
problems it trained on and gives the success on the others. Every result records the seeds it used.

Each ``--temperature`` is one evaluation of ``--episodes`` problems: ``0`` decodes greedily (one reply per problem:
greedy replies repeat), a temperature above 0 samples ``--samples k`` episodes per problem (the same reset) and
reports pass@1 and pass@k (:func:`chatenv.rollout.evaluation.pass_at_k`). Success counts as in ``chatenv rollout``
(the task's ``correct`` component, else task reward >= ``--success-threshold``); success and task reward are also
given by turn (answered correctly by the first reply, by the second, ...). The table is printed and, with ``--out``,
written as JSON with every episode's seed, success, rewards and chat.

``chatenv train --eval-every N`` runs the same evaluation (:class:`HeldOut`) on the policy being trained.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from chatenv.cli import fail
from chatenv.cli.common import add_model_arguments, build_policy, settings_problem, task_kwargs

__all__ = [
    "HELD_OUT_SEED",
    "HeldOut",
    "add_eval_arguments",
    "add_eval_parser",
    "held_out_seeds",
    "run_eval",
    "training_seeds_problem",
]

#: the first held-out seed: training problems use seeds below it, held-out problems seeds from it on
HELD_OUT_SEED = 1 << 30

#: the most envs stepped together by default (one batched generation per turn over all of them)
MAX_ENVS = 128


def held_out_seeds(seed: int, problems: int) -> list[int]:
    """The reset seeds of ``problems`` held-out problems for ``--seed seed`` (each at least :data:`HELD_OUT_SEED`).

    Example:
        >>> held_out_seeds(3, 2) == [HELD_OUT_SEED + 3, HELD_OUT_SEED + 4]
        True

    Raises:
        ValueError: For a negative seed (it would reach into the training seeds).
    """
    if seed < 0:
        raise ValueError(f"the held-out seeds need --seed >= 0, got {seed}")
    return [HELD_OUT_SEED + seed + i for i in range(problems)]


def training_seeds_problem(seed: int, groups: int) -> str | None:
    """What is wrong with training on seeds ``seed .. seed + groups - 1`` (None: all are below the held-out ones)."""
    if seed < 0 or seed + groups > HELD_OUT_SEED:
        return (
            f"--seed must be in [0, {HELD_OUT_SEED - groups}] for {groups} problems: training problems use seeds "
            f"below {HELD_OUT_SEED}, the held-out problems of --eval-every seeds from it on; got --seed {seed}"
        )
    return None


def add_eval_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``eval`` subcommand and its options to the ``chatenv`` parser."""
    run = sub.add_parser("eval", help="success, pass@k and success by turn on held-out problems (greedy, sampled)")
    run.add_argument(
        "--env",
        action="append",
        default=None,
        help="registered turn-level env id (repeat for several; default chatenv/Arithmetic-v0)",
    )
    run.add_argument(
        "--task-kwargs",
        action="append",
        default=None,
        help="task options as JSON: once for every env, or once per --env in their order (default for "
        "Arithmetic-v0: chatenv train's one-digit additions with two tries; for other envs: none)",
    )
    run.add_argument("--max-turns", type=int, default=None, help="assistant turns per episode (default: the task's)")
    add_model_arguments(run)
    run.add_argument("--episodes", type=int, default=96, help="held-out problems per env and temperature (default 96)")
    run.add_argument(
        "--temperature",
        dest="temperatures",
        type=float,
        nargs="+",
        default=[0.0, 0.7],
        help="one evaluation per temperature; 0 is greedy decoding (default: 0 0.7)",
    )
    run.add_argument("--samples", type=int, default=1, help="episodes per problem at temperatures > 0, the k of pass@k")
    run.add_argument("--max-new-tokens", type=int, default=40)
    run.add_argument("--envs", type=int, default=None, help=f"envs stepped together (default: all, at most {MAX_ENVS})")
    run.add_argument("--seed", type=int, default=0, help="held-out problem i resets with seed 2**30 + seed + i")
    run.add_argument(
        "--success-threshold",
        type=float,
        default=1.0,
        help="task reward of a successful turn, for tasks without a 'correct' reward component (default 1.0)",
    )
    run.add_argument("--out", default=None, help="write the results (and every episode) to this JSON file")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--eval-every``, ``--eval-episodes`` and ``--eval-temperature`` to the ``train`` parser."""
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="evaluate on held-out problems before the first step, every N steps and after the last (default: never)",
    )
    parser.add_argument("--eval-episodes", type=int, default=96, help="held-out problems per evaluation (default 96)")
    parser.add_argument(
        "--eval-temperature",
        type=float,
        nargs="+",
        default=None,
        help="evaluation temperatures, 0 for greedy (default: 0 and --temperature)",
    )


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    import gymnasium as gym

    import chatenv  # noqa: F401  (registers the envs)
    from chatenv.envs import is_token_level

    for name in ("episodes", "samples", "max_turns", "envs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    problem = settings_problem(args) or temperatures_problem(args.temperatures, "--temperature")
    if problem:
        return problem
    if args.seed < 0:
        return f"--seed must be >= 0 (held-out seeds start at 2**30 + seed), got {args.seed}"
    if not math.isfinite(args.success_threshold):
        return f"--success-threshold must be a finite number, got {args.success_threshold}"
    for env in args.env:
        if env not in gym.registry:
            return f"unknown env {env!r}; `chatenv envs` lists them"
        if is_token_level(env):
            return "`chatenv eval` runs turn-level envs; use TokenEnv from Python for token-level ones"
    if args.task_kwargs is not None and len(args.task_kwargs) not in (1, len(args.env)):
        return (
            f"give --task-kwargs once (for every env) or once per --env ({len(args.env)}), not {len(args.task_kwargs)}"
        )
    if args.out is not None and Path(args.out).is_dir():
        return f"--out {args.out} is a folder; give the path of a JSON file"
    return None


def temperatures_problem(temperatures: list[float], flag: str) -> str | None:
    """What is wrong with a list of evaluation temperatures (0: greedy), or None."""
    from chatenv.sampling import SettingError, normalize_generate_kwargs

    if len(set(temperatures)) != len(temperatures):
        return f"{flag} lists a temperature twice: {temperatures}"
    for t in temperatures:
        try:
            normalize_generate_kwargs({"temperature": t})
        except SettingError as e:
            return str(e.renamed(flag))
    return None


def run_eval(args: argparse.Namespace) -> int:
    """Run ``chatenv eval`` with parsed arguments; returns the exit code."""
    args.env = args.env or ["chatenv/Arithmetic-v0"]
    problem = _check_args(args)
    if problem:
        return fail(problem)
    given = args.task_kwargs or [None]
    settings = []
    for i, env in enumerate(args.env):
        kwargs = task_kwargs(given[i if len(given) > 1 else 0], env)
        if isinstance(kwargs, str):
            return fail(kwargs)
        settings.append((env, kwargs))
    began = time.perf_counter()
    try:
        policy = build_policy(args, max_num_seqs=args.envs or MAX_ENVS)
    except Exception as e:  # a model that does not load: say so plainly
        print(f"error: could not load the model: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    results: list[dict[str, Any]] = []
    for env, kwargs in settings:
        try:
            held_out = HeldOut(
                policy,
                env,
                kwargs,
                problems=args.episodes,
                temperatures=args.temperatures,
                samples=args.samples,
                seed=args.seed,
                max_turns=args.max_turns,
                envs=args.envs,
                success_threshold=args.success_threshold,
            )
        except Exception as e:  # bad task options
            print(f"error: could not make {env}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        with held_out:
            results += held_out.run()
    print(format_table(results))
    print(f"wall time {time.perf_counter() - began:.1f} s" + (f"; written to {args.out}" if args.out else ""))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.out).write_text(json.dumps({"config": config, "results": results}, indent=1, ensure_ascii=False))
    return 0


class HeldOut:
    """One env's held-out problems, run by a policy at several temperatures.

    Args:
        policy: The policy (its weights are used as they are when :meth:`run` is called).
        env_id: A registered turn-level env.
        task_kwargs: Its task options.
        problems: Held-out problems.
        temperatures: One evaluation per temperature (0: greedy, one episode per problem).
        samples: Episodes per problem at temperatures above 0.
        seed: Held-out problem ``i`` resets with ``HELD_OUT_SEED + seed + i``.
        max_turns: Turns per episode (None: the task's).
        envs: Envs stepped together (default: all episodes of a temperature, at most :data:`MAX_ENVS`).
        success_threshold: Task reward of a successful turn, for tasks without a ``correct`` component.
    """

    def __init__(
        self,
        policy: Any,
        env_id: str,
        task_kwargs: dict[str, Any],
        *,
        problems: int,
        temperatures: list[float],
        samples: int = 1,
        seed: int = 0,
        max_turns: int | None = None,
        envs: int | None = None,
        success_threshold: float = 1.0,
    ):
        import gymnasium as gym

        self.env_id, self.task_kwargs, self.problems, self.samples = env_id, task_kwargs, problems, samples
        self.seeds, self.success_threshold = held_out_seeds(seed, problems), success_threshold
        self.policies = {
            t: policy.get_new_version(generate_kwargs={"temperature": t}, return_log_probs=False) for t in temperatures
        }
        kwargs: dict[str, Any] = {"input_mode": "tokens", "tokenizer": policy.tokenizer}
        if max_turns is not None:
            kwargs["max_turns"] = max_turns
        if task_kwargs:
            kwargs["task_kwargs"] = task_kwargs
        most = problems * (samples if any(t > 0 for t in temperatures) else 1)
        self.envs = [gym.make(env_id, **kwargs) for _ in range(min(most, envs or MAX_ENVS))]
        self.max_turns: int | None = max_turns or self.envs[0].get_wrapper_attr("max_turns")

    def __enter__(self) -> HeldOut:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the envs."""
        for env in self.envs:
            env.close()

    def check_disjoint(self, training: range) -> None:
        """Raise ``RuntimeError`` if a held-out seed is among the ``training`` seeds (the invariant of the split)."""
        shared = sorted(set(training).intersection(self.seeds)) if training.stop > HELD_OUT_SEED else []
        if shared:
            raise RuntimeError(f"held-out seeds {shared[:5]} are training seeds too; the split is broken")

    def run(self) -> list[dict[str, Any]]:
        """One result per temperature, with the weights the policy has now.

        Each holds the env, temperature, seeds, the numbers of :func:`~chatenv.rollout.evaluation.summarize` (with
        ``distinct_problems``: seeds differ, problems may repeat), the seconds it took, and every episode
        (``episodes_detail``).
        """
        return [self._run(t, policy) for t, policy in self.policies.items()]

    def _run(self, temperature: float, policy: Any) -> dict[str, Any]:
        import chatenv
        from chatenv.cli.rollout import episodes_from_rollout
        from chatenv.rollout.evaluation import first_success_turns, summarize

        start = time.perf_counter()
        samples = self.samples if temperature > 0 else 1
        td = chatenv.rollout(
            self.envs, policy, episodes=self.problems * samples, group_size=samples, seed=self.seeds[0]
        )
        first = first_success_turns(td, self.success_threshold)
        records = episodes_from_rollout(td, policy, 0, success_threshold=self.success_threshold)
        for r, number in zip(records, sorted(first)):
            r.update(seed=self.seeds[r["group"]], first_success=first[number])
        return {
            "env": self.env_id,
            "task_kwargs": self.task_kwargs,
            "temperature": temperature,
            "decoding": "greedy" if temperature == 0 else f"T={temperature:g}",
            "seeds": self.seeds,
            **summarize(records, samples, self.max_turns or max(len(r["task_rewards"]) for r in records)),
            "seconds": time.perf_counter() - start,
            "episodes_detail": [_detail(r) for r in records],
        }


def _detail(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("episode", "group", "seed", "success", "first_success", "task_rewards", "response_tokens", "messages")
    return {k: record.get(k) for k in keys}


def format_table(results: list[dict[str, Any]]) -> str:
    """The results as a table: one row per env and temperature (``distinct``: different problems among them)."""
    ks = sorted({k for r in results for k in r["pass_at_k"]})
    turns = max((len(r["success_by_turn"]) for r in results), default=0)
    head = ["env", "decoding", "problems", "distinct", "episodes", *(f"pass@{k}" for k in ks)]
    head += [f"by turn {t + 1}" for t in range(turns)] + ["reward", "tokens", "seconds"]
    rows = []
    for r in results:
        by_turn = r["success_by_turn"] + ["-"] * (turns - len(r["success_by_turn"]))
        distinct = "-" if r.get("distinct_problems") is None else r["distinct_problems"]
        cells = [r["env"].split("/")[-1], r["decoding"], r["problems"], distinct, r["episodes"]]
        cells += [r["pass_at_k"].get(k, "-") for k in ks] + by_turn
        text = [f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells]
        rows.append([*text, f"{r['reward']:.3f}", f"{r['response_tokens']:.1f}", f"{r['seconds']:.1f}"])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = [
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [head, *rows]
    ]
    return "\n".join(lines)


def flat_metrics(result: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """A result's numbers as flat tracker metrics: ``eval/greedy/success``, ``eval/T=0.7/pass@4``, ..."""
    name = f"{prefix}/{result['decoding']}"
    out = {f"{name}/success": float(result["success"]), f"{name}/reward": float(result["reward"])}
    out.update({f"{name}/pass@{k}": float(v) for k, v in result["pass_at_k"].items()})
    out.update({f"{name}/success_by_turn_{t + 1}": float(v) for t, v in enumerate(result["success_by_turn"])})
    return out
