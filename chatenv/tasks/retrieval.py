"""Questions answered by searching documents: :class:`RetrievalTask` and its :class:`DocumentStore` tools."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from chatenv.rewards import exact_match
from chatenv.tasks.tool_task import ANSWER_FORMAT, ToolTask
from chatenv.tools.base import PerEpisode

__all__ = ["DocumentStore", "RetrievalTask"]

_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset("a an and are as at by for from how in is it of on or the to was what when which who whose".split())


def _terms(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


class DocumentStore:
    """Documents searched by term overlap (BM25): the ``search`` and ``read`` tools of one episode.

    Args:
        documents: ``{doc_id: text}``.
        top_k: Results per search.
        snippet_chars: Characters of each result's text shown by ``search``.
    """

    def __init__(self, documents: Mapping[str, str], top_k: int = 3, snippet_chars: int = 300):
        if not isinstance(documents, Mapping):
            raise TypeError(f"documents must be a dict of doc_id -> text, got {type(documents).__name__}")
        self._docs = {str(k): str(v) for k, v in documents.items()}
        self._top_k, self._snippet = int(top_k), int(snippet_chars)
        self._terms = {k: _terms(v) for k, v in self._docs.items()}
        n = len(self._docs)
        df = Counter(w for words in self._terms.values() for w in set(words))
        self._idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}
        self._avg = sum(map(len, self._terms.values())) / n if n else 0.0

    def _score(self, doc_id: str, query: list[str]) -> float:  # BM25 with k1 = 1.2, b = 0.75
        words = self._terms[doc_id]
        norm = 1.2 * (0.25 + 0.75 * len(words) / (self._avg or 1.0))
        return sum(self._idf.get(q, 0.0) * 2.2 * words.count(q) / (words.count(q) + norm) for q in set(query))

    def search(self, query: str) -> str:
        """Search the document collection and return the best-matching documents with their ids.

        Args:
            query: Words to look for, e.g. a name or a topic.
        """
        if not isinstance(query, str):
            raise ValueError(f"query must be a string, got {type(query).__name__}")
        words = _terms(query)
        if not words:
            raise ValueError(f"the query {query!r} has no searchable words; search for a name or a topic")
        scored = sorted(((self._score(k, words), k) for k in self._docs), key=lambda s: (-s[0], s[1]))
        hits = [(s, k) for s, k in scored[: self._top_k] if s > 0]
        if not hits:
            return f"No documents match {query!r}."
        return "\n".join(f"[{k}] {self._docs[k][: self._snippet]}" for _, k in hits)

    def read(self, doc_id: str) -> str:
        """Return the full text of a document.

        Args:
            doc_id: The document's id as shown by search, e.g. "doc-3".
        """
        key = str(doc_id).strip().strip("[]")
        if key not in self._docs:
            raise ValueError(f"there is no document {doc_id!r}; use an id that search returned (like 'doc-0')")
        return self._docs[key]


_SYLLABLES = "ka vel tra osk mir dun sel qua bro zen lor phi tan ur esh gal ny rho vik ad om ter lu ban cor fen".split()
_GOODS = "amber copper silk salt timber wool glass tin saffron pearls indigo marble honey flax cobalt ivory".split()


def _word(rng: np.random.Generator, parts: int) -> str:
    return "".join(_SYLLABLES[int(i)] for i in rng.integers(len(_SYLLABLES), size=parts))


def _countries(rng: np.random.Generator, n: int) -> list[dict[str, str]]:
    """``n`` fictional countries with distinct names, capitals and currencies."""
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    while len(out) < n:
        c = {
            "name": _word(rng, 3).capitalize() + ("a", "ia", "or", "and")[int(rng.integers(4))],
            "capital": _word(rng, 2).capitalize() + ("", "en", "is")[int(rng.integers(3))],
            "founded": str(int(rng.integers(1100, 1900))),
            "currency": _word(rng, 2),
            "export": _GOODS[int(rng.integers(len(_GOODS)))],
        }
        names = {c["name"].lower(), c["capital"].lower(), c["currency"]}
        if len(names) == 3 and not names & seen:
            seen |= names
            out.append(c)
    return out


def _documents(rng: np.random.Generator, countries: list[dict[str, str]]) -> dict[str, str]:
    """One document per country and one per capital city, in a random order."""
    texts = []
    for c in countries:
        texts.append(
            f"{c['name']} is a small inland nation. It was founded in {c['founded']}. The capital of {c['name']} is "
            f"{c['capital']}. Its currency is the {c['currency']}, and its chief export is {c['export']}."
        )
        texts.append(
            f"{c['capital']} is a walled city on a wide river, home to an old market and a university. "
            f"{c['capital']} is the capital of {c['name']}."
        )
    order = rng.permutation(len(texts))
    return {f"doc-{i}": texts[int(k)] for i, k in enumerate(order)}


#: question kind -> (question, the country's fact that answers it)
_QUESTIONS = {
    "capital": ("What is the capital of {name}?", "capital"),
    "founded": ("In what year was {name} founded?", "founded"),
    "currency": ("What is the currency of {name} called?", "currency"),
    "export": ("What is the chief export of {name}?", "export"),
    "capital_export": ("What is the chief export of the country whose capital is {capital}?", "export"),
}


class RetrievalTask(ToolTask):
    """Questions about fictional countries, answered by searching the episode's own document store.

    Each episode makes a new world from the seed (``countries`` countries, a document for each and for each
    capital), so the model cannot know the answers: it must ``search`` (and may ``read``) the documents. Answers
    are checked by exact match (case and whitespace ignored). The documents are part of the episode's state, and
    its tools are built from that state, so one task object can serve many envs.

    Args:
        countries: Countries per world.
        top_k: Results per search.
        facts: Question kinds (default: all of ``"capital"``, ``"founded"``, ``"currency"``, ``"export"`` and the
            two-step ``"capital_export"``).
        **kwargs: :class:`ToolTask` arguments (``reward_fn``, ``system_prompt``, ``max_turns``).
    """

    description = "Questions about fictional countries answered with a search tool over a generated document store."
    match = staticmethod(exact_match)
    system_prompt = (
        "You answer questions about places you have never heard of. Use the search tool to find documents about "
        "them (and read to see a whole document), then reply with the answer word taken from the documents. "
        + ANSWER_FORMAT
    )

    def __init__(self, countries: int = 6, top_k: int = 3, facts: Sequence[str] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if isinstance(countries, bool) or not isinstance(countries, int) or not 1 <= countries <= 50:
            raise ValueError(f"countries must be an int in [1, 50], got {countries!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        self.facts = list(_QUESTIONS) if facts is None else list(facts)
        if not self.facts or any(f not in _QUESTIONS for f in self.facts):
            raise ValueError(f"facts must be a non-empty list of {list(_QUESTIONS)}, got {self.facts}")
        self.countries, self.top_k = countries, top_k

        def document_store(state: Any) -> DocumentStore:
            return DocumentStore((state or {}).get("documents", {}), top_k=self.top_k)

        self.tools = [PerEpisode(document_store, pass_state=True)]

    def problem(self, rng: np.random.Generator) -> tuple[str, Any, dict[str, Any]]:  # noqa: D102
        world = _countries(rng, self.countries)
        documents = _documents(rng, world)
        country = world[int(rng.integers(len(world)))]
        fact = self.facts[int(rng.integers(len(self.facts)))]
        question, key = _QUESTIONS[fact]
        answer = country[key]
        sources = sorted(k for k, v in documents.items() if country["name"] in v and answer.lower() in _terms(v))
        extra = {"fact": fact, "sources": sources, "documents": documents}
        return f"{question.format(**country)} {ANSWER_FORMAT}", answer, extra

    def state_for(self, messages: list[dict[str, Any]], options: Mapping[str, Any]) -> Any:
        """For a given chat: ``options["answer"]``, and ``options["documents"]`` (default: none) to search."""
        documents = options.get("documents", {})
        if not isinstance(documents, Mapping):
            raise TypeError(f"options['documents'] must be a dict of doc_id -> text, got {type(documents).__name__}")
        return {"answer": options.get("answer"), "documents": {str(k): str(v) for k, v in documents.items()}}
