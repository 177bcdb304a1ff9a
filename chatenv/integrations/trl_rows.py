"""Where the reset options of a prompt TRL passes come from: the row it carries, or its dataset row.

TRL calls ``rollout_func(prompts, trainer)`` with the prompts only. A :func:`~chatenv.integrations.trl.prompt_dataset`
prompt carries its row's other columns in its first message (:data:`ROW_KEY`); other datasets' rows are found by
prompt (:class:`RowIndex`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["ROW_KEY", "RowIndex", "carried_row", "find_row", "plan", "prompt_key", "reset_options"]

#: the key of a prompt's first message that carries its dataset row (other columns, JSON) in prompt_dataset's rows;
#: chat templates never read it, and it never reaches an env
ROW_KEY = "chatenv_row"


def prompt_key(prompt: Any) -> str:
    """A prompt as a string key (chats compared by role and content, the row key and unset fields left out)."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(
        [{k: v for k, v in dict(m).items() if v is not None and k != ROW_KEY} for m in prompt], sort_keys=True
    )


def carried_row(prompt: Any) -> dict[str, Any] | None:
    """The row a :func:`prompt_dataset` prompt carries in its first message, or None."""
    if isinstance(prompt, str) or not prompt:
        return None
    carried = dict(prompt[0]).get(ROW_KEY)
    return None if carried is None else dict(json.loads(carried))


class RowIndex:
    """The rows of a dataset by prompt: where the other columns of a prompt TRL passes come from."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.rows: dict[str, dict[str, Any] | None] = {}  # None: several rows with other columns share it
        self.columns = [c for c in getattr(dataset, "column_names", []) if c != "prompt"]
        for row in dataset:
            row = dict(row)
            key = prompt_key(row.get("prompt"))
            others = {k: v for k, v in row.items() if k != "prompt"}
            if key in self.rows and self.rows[key] != others:
                self.rows[key] = None
            else:
                self.rows[key] = others

    def find(self, key: str) -> dict[str, Any] | None:
        """The other columns of the row with prompt ``key`` (:func:`prompt_key`), or None if none has it.

        Raises:
            ValueError: For a prompt several rows share with different other columns.
        """
        if key not in self.rows:
            return None
        row = self.rows[key]
        if row is None:
            raise ValueError(
                "several dataset rows share this prompt with different other columns, so its reset options are "
                "ambiguous: build the dataset with prompt_dataset (each prompt carries its row), or make the prompts "
                "unique"
            )
        return row


def find_row(indexes: list[RowIndex], prompt: Any) -> dict[str, Any]:
    """The other columns of ``prompt``'s row in the first dataset holding it ({} if none does and none has any).

    Raises:
        ValueError: For a prompt no dataset holds while one has other columns, or an ambiguous one.
    """
    key = prompt_key(prompt)
    for index in indexes:
        row = index.find(key)
        if row is not None:
            return row
    columns = sorted({c for index in indexes for c in index.columns})
    if columns:
        raise ValueError(
            f"a prompt that is not in the trainer's datasets (columns {columns}): pass rows=[...] (one dataset row "
            "per prompt)"
        )
    return {}


def reset_options(prompt: Any, row: Mapping[str, Any]) -> dict[str, Any]:
    """The reset options of one prompt: its chat as ``messages`` plus the row's other columns."""
    if "messages" in row:
        raise ValueError(
            "a dataset column named 'messages' would replace the prompt in the env's reset options; rename it"
        )
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        # datasets give every message every key of the column's struct, None where a message has none
        messages = [{k: v for k, v in dict(m).items() if v is not None and k != ROW_KEY} for m in prompt]
    return {**{k: v for k, v in row.items() if k not in ("prompt", ROW_KEY)}, "messages": messages}


def plan(options: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """Groups of ``size`` episodes when TRL's repeats line up with them, else one reset per episode."""
    n = len(options)
    if size > 1 and n % size == 0 and all(options[k] == options[k - k % size] for k in range(n)):
        return {"group_size": size, "reset_options": options[::size]}
    return {"reset_options": options}
