"""The engines of one job, loaded lazily: the named model, or up to two built-ins.

When the job names no model, each document gets the built-in text model
(SmolLM2) unless it has page images to read, in which case it gets the
built-in VLM.  Each is loaded at most once per run and only when a document
actually needs it, so a rerun with nothing to do loads no model.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from pipeline.schema.job import Job

logger = logging.getLogger(__name__)


class Engines:
    """Lazily loaded engines for a job; ``loads`` counts model loads.

    ``loader(path, needs_images=...)`` defaults to
    :func:`pipeline.models.load.load_model`, looked up at load time so tests
    can replace it.
    """

    def __init__(self, job: Job, *, loader: Callable[..., Any] | None = None):
        self.job = job
        self._loader = loader
        self._engines: dict[bool, Any] = {}
        self._errors: dict[bool, Exception] = {}
        self.loads = 0

    def get(self, needs_images: bool) -> Any:
        """The engine for a document that does (or does not) carry page images."""
        from pipeline.inference.doc_cache import store_for_job
        from pipeline.inference.engine import Engine

        path = self.job.spec.model.path
        slot = bool(needs_images) if path is None else False
        if slot in self._errors:  # don't retry a failed load for every document
            raise self._errors[slot]
        if slot not in self._engines:
            loader = self._loader
            if loader is None:
                from pipeline.models.load import load_model as loader
            try:
                loaded = loader(path, needs_images=slot)
            except Exception as e:
                self._errors[slot] = e
                raise
            self.loads += 1
            logger.info("loaded model %s (%s)", loaded.name, loaded.kind)
            self._engines[slot] = Engine(loaded, self.job.spec.cache, store=store_for_job(self.job))
        return self._engines[slot]
