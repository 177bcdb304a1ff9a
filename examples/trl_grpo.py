"""GRPO with TRL's GRPOTrainer on multi-turn chatenv episodes (skips without TRL: pip install 'chatenv-gym[trl]').

Each prompt of the dataset runs as a whole episode of ``chatenv/Arithmetic-v0`` (a wrong answer gets "try again"
feedback and another turn): TRL trains on the replies only (the env's feedback is masked out) with the env's summed
reward. The chatenv part is one line, ``grpo_kwargs(...)``; the rest is ordinary TRL.

Run: .venv/bin/python examples/trl_grpo.py [--steps 8] [--model PATH]   (2 steps: well under a minute on 2 CPU cores)
"""

import argparse
import ast
import inspect
import os
from dataclasses import dataclass, fields

import torch

from chatenv.integrations.trl import grpo_kwargs, prompt_dataset

# rollout_func is experimental in TRL 1.16: TRL says so in a warning unless this is set
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@dataclass
class Args:
    model: str = ""
    """Folder of a saved causal LM and its tokenizer; empty: the embedded SmolLM2-135M-Instruct."""
    env_id: str = "chatenv/Arithmetic-v0"
    """The chatenv env every episode runs in."""
    max_turns: int = 2
    """Replies per episode (the env's feedback comes between them)."""
    steps: int = 2
    """GRPO steps (one batch of episodes each)."""
    prompts_per_step: int = 1
    """Distinct problems per step."""
    group: int = 4
    """Episodes per problem (TRL's num_generations): GRPO's advantages are rewards relative to the group."""
    max_new_tokens: int = 16
    """Tokens per reply."""
    learning_rate: float = 1e-5
    """AdamW learning rate."""
    temperature: float = 1.0
    """Sampling temperature."""
    seed: int = 0
    """Seed of the problems and of TRL."""
    output_dir: str = "runs/trl_grpo"
    """Where TRL writes its run folder (no checkpoints are saved)."""


def parse_args() -> Args:
    source = ast.parse(inspect.getsource(Args)).body[0].body
    docs = {a.target.id: b.value.value for a, b in zip(source, source[1:]) if isinstance(b, ast.Expr)}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Args):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=docs[f.name])
    return Args(**vars(parser.parse_args()))


def main() -> None:
    args = parse_args()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        print("trl is not installed (pip install 'chatenv-gym[trl]'): nothing to show")
        return
    torch.manual_seed(args.seed)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        from chatenv import load_default_model

        model, tokenizer = load_default_model()
    env_kwargs = {"max_turns": args.max_turns}
    dataset = prompt_dataset(args.env_id, args.steps * args.prompts_per_step, seed=args.seed, **env_kwargs)
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.prompts_per_step * args.group,
        num_generations=args.group,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        temperature=args.temperature,
        max_completion_length=args.max_new_tokens,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
    )

    class PrintReward(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                turns = logs.get("env/num_turns", float("nan"))
                print(f"step {state.global_step}: reward {logs['reward']:.3f}  turns/episode {turns:.2f}")

    trainer = GRPOTrainer(
        model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[PrintReward()],
        # the chatenv part: episodes as TRL's rollouts, the env's reward as TRL's reward function
        **grpo_kwargs(args.env_id, max_new_tokens=args.max_new_tokens, **env_kwargs),
    )
    trainer.remove_callback(PrinterCallback)  # the per-step reward above instead of every logged value
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    print(f"reward per step: {' '.join(f'{r:.3f}' for r in rewards)}")


if __name__ == "__main__":
    main()
