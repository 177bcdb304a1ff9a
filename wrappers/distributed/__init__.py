"""Policy factories for :class:`chatenv.distributed.RayCollector`'s inference actors, and a one-call Ray run.

An inference actor builds its policy itself, in its own process (no model is pickled): the collector takes a
picklable factory, and these are the ones for the library's backends. :func:`collect_on_ray` runs a registered env
with a saved model on a local Ray cluster (``chatenv rollout --workers N``).
"""

from __future__ import annotations

from wrappers.distributed.factories import TransformersFactory, VLLMFactory
from wrappers.distributed.run import collect_on_ray

__all__ = ["TransformersFactory", "VLLMFactory", "collect_on_ray"]
