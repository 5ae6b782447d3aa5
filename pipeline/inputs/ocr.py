"""OCR: the text of pages that are only pixels (scanned PDF pages, image sets).

A text-only model (the built-in SmolLM2, or any mlx-lm model) cannot look at
a page image, so such pages are read here, offline, and enter the context as
text under their own ``[Page N]`` marker, like a text layer would.  The
engine is RapidOCR with the PP-OCRv6 detection and recognition models that
ship inside its wheel (nothing is downloaded at run time), run by
onnxruntime on ONE thread: multi-threaded float reductions may sum in a
different order from run to run, and the same scan must give the same text,
hence the same prompt and the same record key inputs, every time.

Boxes are grouped into lines by their vertical overlap and read left to
right, so a table row stays one line.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from pipeline.errors import TqpipeError

if TYPE_CHECKING:
    import PIL.Image

#: Resolution at which a scanned PDF page is rendered for OCR: small print
#: needs more pixels than ``context.dpi`` (72, sized for VLM image tokens) has.
OCR_DPI = 150

_INSTALL = "pip install 'rapidocr>=3.10,<4' onnxruntime"
# One engine per process; onnxruntime sessions are not shared between threads here.
_LOCK = threading.Lock()


class OcrUnavailableError(TqpipeError):
    """The OCR engine cannot be imported (message names what to install)."""


@lru_cache(maxsize=1)
def _engine() -> Any:
    try:
        from rapidocr import RapidOCR
    except ImportError as e:
        raise OcrUnavailableError(f"OCR of scanned pages needs rapidocr and onnxruntime ({e}): {_INSTALL}") from e
    return RapidOCR(
        params={
            "Global.log_level": "warning",
            "EngineConfig.onnxruntime.intra_op_num_threads": 1,
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
        }
    )


@lru_cache(maxsize=1)
def engine_name() -> str:
    """What reads the pages, for the record: package, version and models."""
    from importlib.metadata import version

    return f"rapidocr {version('rapidocr')} (PP-OCRv6 det/rec small, onnxruntime {version('onnxruntime')})"


def ocr_image(image: "PIL.Image.Image") -> str:
    """The text on ``image``, one line per text line, top to bottom; ``""`` if none."""
    import numpy as np

    from pipeline.inputs.images import to_rgb

    pixels = np.asarray(to_rgb(image))
    with _LOCK:
        result = _engine()(pixels)
    if result.txts is None or result.boxes is None:
        return ""
    return "\n".join(_lines(result.boxes, result.txts))


def _lines(boxes: Any, texts: tuple[str, ...]) -> list[str]:
    """Join boxes that share a line (vertical centres within half a box height), left to right."""
    items = []
    for box, text in zip(boxes, texts):
        ys, xs = [p[1] for p in box], [p[0] for p in box]
        items.append(((min(ys) + max(ys)) / 2, max(ys) - min(ys), min(xs), text))
    items.sort(key=lambda it: (it[0], it[2]))
    lines: list[list[tuple]] = []
    for item in items:
        if lines and abs(item[0] - lines[-1][0][0]) <= max(item[1], lines[-1][0][1]) / 2:
            lines[-1].append(item)
        else:
            lines.append([item])
    return ["  ".join(it[3] for it in sorted(line, key=lambda it: it[2])) for line in lines]


__all__ = ["OCR_DPI", "OcrUnavailableError", "engine_name", "ocr_image"]
