"""The router: an asynchronous Ray actor that sends each policy request to the least loaded inference actor.

It counts the requests in flight on every inference actor (sent, not yet answered) and picks the actor with the
fewest (ties: the one that has served fewest, so a lone caller alternates). A request whose actor dies is sent to
another one: generation has no side effect, so nothing is lost but time. When no actor is left the request fails
with :class:`~chatenv.distributed.common.InferenceUnavailable`.
"""

from __future__ import annotations

from typing import Any

from chatenv.distributed.common import InferenceUnavailable, import_ray

__all__ = ["Router"]


class Router:
    """Least-loaded routing over inference actors (run as an asynchronous Ray actor).

    Args:
        actors: The inference actors' handles.
        failures_to_drop: Consecutive failed calls after which an actor is taken out of rotation for good (1 without
            restarts; more when Ray may be restarting it).
    """

    def __init__(self, actors: list[Any], failures_to_drop: int = 1):
        self.actors = list(actors)
        n = len(self.actors)
        self.inflight, self.peak, self.served = [0] * n, [0] * n, [0] * n
        self.failures, self.alive = [0] * n, [True] * n
        self.failures_to_drop = failures_to_drop

    def _pick(self) -> int:
        live = [i for i in range(len(self.actors)) if self.alive[i]]
        if not live:
            raise InferenceUnavailable(
                "every inference actor of the collector died; the episodes in progress are lost (create a new "
                "collector, or use max_restarts=... to let Ray restart actors)"
            )
        return min(live, key=lambda i: (self.inflight[i], self.served[i], i))

    async def generate(self, td: Any) -> Any:
        """The policy output for ``td`` from the least loaded live actor.

        Raises:
            InferenceUnavailable: When every actor is dead.
            BaseException: The policy's own error for a request it refuses (its type and message).
        """
        ray = import_ray()
        for _ in range(2 * len(self.actors) * self.failures_to_drop + 1):
            i = self._pick()
            self.inflight[i] += 1
            self.peak[i] = max(self.peak[i], self.inflight[i])
            try:
                out = await self.actors[i].generate.remote(td)
            except ray.exceptions.RayActorError:
                self.failures[i] += 1
                if self.failures[i] >= self.failures_to_drop:
                    self.alive[i] = False
                continue
            except ray.exceptions.RayTaskError as e:  # the policy refused the request: its own error
                cause = getattr(e, "cause", None)
                raise (cause if isinstance(cause, BaseException) else e) from None
            finally:
                self.inflight[i] -= 1
            self.failures[i] = 0
            self.served[i] += 1
            return out
        raise InferenceUnavailable("no inference actor answered the request (they keep failing)")

    def stats(self) -> list[dict[str, Any]]:
        """Per inference actor: requests ``served``, ``inflight`` now, ``peak`` in flight, and ``alive``."""
        return [
            {"served": s, "inflight": f, "peak": p, "alive": a}
            for s, f, p, a in zip(self.served, self.inflight, self.peak, self.alive)
        ]

    def mark_dead(self, index: int) -> None:
        """Take an actor out of rotation (the collector found it dead)."""
        self.alive[index] = False
