"""Read one discovered document into a :class:`~pipeline.inputs.document.Document`.

The one entry point from a :class:`DocumentRef` to pages: hash the bytes
(the record key needs it), then read the PDF or the image set with the
job's context spec (page selection, images, retries).
"""

from __future__ import annotations

from pipeline.inputs.discover import DocumentRef, content_hash
from pipeline.inputs.document import Document
from pipeline.inputs.images import read_image_set
from pipeline.inputs.pdf import read_pdf
from pipeline.schema.job import ContextSpec


def ingest(ref: DocumentRef, context: ContextSpec) -> Document:
    """Read ``ref`` with the pages ``context.pages`` selects.

    Raises :class:`~pipeline.errors.IngestError` naming the file when the
    document as a whole cannot be used.
    """
    digest = content_hash(ref)
    if ref.kind == "pdf":
        return read_pdf(ref, context, digest)
    return read_image_set(ref, context, digest)
