"""What a job is, written down: the job schema, page ranges, record fields and keys.

Pure data and pure functions; no file or model I/O, so every other room can import it.
"""
