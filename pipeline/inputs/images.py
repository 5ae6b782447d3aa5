"""Image sets: one document of many images, one page per image (per frame of a multi-page TIFF), no text layer.

Each image goes to the model as an image, or as its OCR'd text when the
route says ``ocr`` (a text-only model, or ``images: ocr``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import IngestError
from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.document import Document, Page, ScannedRoute, read_pages
from pipeline.inputs.ocr import ocr_image
from pipeline.schema.job import ContextSpec

if TYPE_CHECKING:
    import PIL.Image


def read_image_set(ref: DocumentRef, context: ContextSpec, digest: str, route: ScannedRoute = "image") -> Document:
    """Read the selected pages of an image set in member order: one page per
    image, and one per frame of a multi-page TIFF (a fax or a scanner's
    batch file is one such file)."""
    if route == "none":
        raise IngestError(ref.source, "an image set has no text, but the job says context.images: never")
    if not ref.members:
        raise IngestError(ref.source, "image set holds no images")
    pages = [(path, frame) for path in ref.members for frame in range(_page_frames(path))]
    return read_pages(ref, digest, len(pages), context, lambda n: _read_image(*pages[n - 1], n, route))


def _page_frames(path: Path) -> int:
    """Pages in ``path``: a TIFF's frames; 1 for any other image (an animated
    GIF's or a camera MPO's extra frames are not pages) and for a file that
    does not open (reading that page fails with its own error)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return max(1, int(getattr(im, "n_frames", 1))) if im.format == "TIFF" else 1
    except Exception:  # noqa: BLE001 - any failure to open is the page's, reported when it is read
        return 1


def _read_image(path: Path, frame: int, number: int, route: ScannedRoute) -> tuple[Page, list[str]]:
    from PIL import Image

    notes = []
    with Image.open(path) as im:
        if frame:
            im.seek(frame)
        elif getattr(im, "n_frames", 1) > 1 and im.format != "TIFF":
            notes.append(f"page {number}: {path.name} holds {im.n_frames} frames; the first is read")
        im.load()  # decode now, so a truncated file fails here and not in the model
        image = to_rgb(im)
    name = f"{path.name} (page {frame + 1})" if frame else path.name
    if route == "ocr":
        text = ocr_image(image)
        if not text:
            notes.append(f"page {number}: OCR found no text on {name}")
        return Page(number=number, text=text, image=None, scanned=True, via="ocr"), notes
    return Page(number=number, text="", image=image, scanned=True, via="image"), notes


def to_rgb(im: "PIL.Image.Image") -> "PIL.Image.Image":
    """``im`` as 8-bit RGB.  Pillow's ``convert`` clips 16- and 32-bit
    grayscale (scanner output, ``I;16`` PNG / TIFF) at 255, which turns a
    whole page white; those are scaled by their range instead: 65535 for
    16-bit modes; for 32-bit integer or float data the smallest of 255,
    65535 and the image's own maximum that holds its values."""
    import numpy as np
    from PIL import Image

    if not (im.mode.startswith("I;16") or im.mode in ("I", "F")):
        return im.convert("RGB")
    a = np.asarray(im, dtype=np.float64)
    peak = float(a.max(initial=0.0))
    top = 65535.0 if im.mode.startswith("I;16") else 255.0 if peak <= 255 else 65535.0 if peak <= 65535 else peak
    a = np.clip(a * (255.0 / top) + 0.5, 0, 255).astype(np.uint8)
    return Image.fromarray(a, "L").convert("RGB")
