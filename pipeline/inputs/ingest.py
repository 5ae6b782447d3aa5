"""Read one discovered document into a :class:`~pipeline.inputs.document.Document`.

The one entry point from a :class:`DocumentRef` to pages: hash the bytes
(the record key needs it), then read the PDF or the image set with the
job's context spec (page selection, images, retries).
"""

from __future__ import annotations

from pipeline.inputs.discover import DocumentRef, content_hash
from pipeline.inputs.document import Document, scanned_route
from pipeline.inputs.images import read_image_set
from pipeline.inputs.pdf import read_pdf
from pipeline.schema.job import ContextSpec


def ingest(ref: DocumentRef, context: ContextSpec, *, model_reads_images: bool = True,
           digest: str | None = None) -> Document:
    """Read ``ref`` with the pages ``context.pages`` selects.

    ``model_reads_images``: whether the job's model takes page images; a
    text-only model gets scanned pages as OCR'd text under ``images: auto``
    (:func:`~pipeline.inputs.document.scanned_route`).  Raises
    :class:`~pipeline.errors.IngestError` naming the file when the
    document as a whole cannot be used.  ``digest``: its content hash, when
    the caller has it already (hashing reads the whole file).
    """
    digest = digest or content_hash(ref)
    route = scanned_route(context.images, model_reads_images)
    if ref.kind == "pdf":
        return read_pdf(ref, context, digest, route)
    return read_image_set(ref, context, digest, route)
