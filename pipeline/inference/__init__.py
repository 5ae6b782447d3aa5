"""From a document to answers: prompt assembly, the prefill-once engine, output extraction."""
