"""The engine of one job, loaded lazily: the named model, or the built-in SmolLM2.

It is loaded at most once per run and only when a document actually needs
it, so a rerun with nothing to do loads no model.  Before a document is read,
:meth:`Engines.reads_images` says whether the model takes page images, which
decides whether scanned pages are sent as images or OCR'd into text.  A model
with random weights (the built-in tiny VLM, used only when named) is said so
in the log once per run; each of its records carries the warning.  On a
GPU a new engine is warmed up (``Engine.warm_up``) before its first document.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from pipeline.schema.job import Job
from turboquant.attention import device

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
        self._reads_images: bool | None = None
        self.loads = 0

    def reads_images(self) -> bool:
        """Whether the job's model takes page images, from its config (no weights are read).

        A model that cannot be resolved counts as reading images, so pages
        are not OCR'd for nothing: loading it fails next, with its own error.
        """
        if self._reads_images is None:
            loaded = next(iter(self._engines.values()), None)
            if loaded is not None:
                self._reads_images = loaded.loaded.kind == "vlm"
            else:
                from pipeline.models.load import model_reads_images

                try:
                    self._reads_images = model_reads_images(self.job.spec.model.path)
                except Exception:  # reported by get(), where the model is loaded
                    return True
        return self._reads_images

    def get(self, needs_images: bool) -> Any:
        """The engine for a document that does (or does not) carry page images."""
        from pipeline.inference.doc_cache import store_for_job
        from pipeline.inference.engine import Engine

        path = self.job.spec.model.path
        slot = bool(needs_images) if path is None else False
        if slot in self._errors:  # don't retry a failed load for every document
            raise self._errors[slot]
        if slot not in self._engines:
            _check_kernel_setting()
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
            if getattr(loaded, "random_weights", False):
                logger.warning("model %s has seeded random weights: its answers are noise (every record is "
                               "marked with the random_weights warning); name a trained model in model.path",
                               loaded.name)
            engine = Engine(loaded, self.job.spec.cache, store=store_for_job(self.job))
            if device.on_gpu():
                t0 = time.perf_counter()
                engine.warm_up()
                logger.info("warmed up the engine on the GPU in %.2f s", time.perf_counter() - t0)
            self._engines[slot] = engine
        return self._engines[slot]


def _check_kernel_setting() -> None:
    """``TQ_KERNELS`` must name a mode this machine has, once per run: a bad
    value is the run's problem (exit 4, one line), not every document's."""
    from pipeline.errors import RunError
    from turboquant.attention.route import kernels_allowed

    try:
        kernels_allowed(device.backend(), device.mode(), device.on_gpu())
    except (ValueError, RuntimeError) as e:
        raise RunError(str(e)) from None
