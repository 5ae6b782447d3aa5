"""From a document to answers: prompt assembly, the prefill-once engine, the document-cache store, output extraction."""
