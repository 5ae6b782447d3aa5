"""What a run leaves on disk: the record renderer, the results log (the checkpoint), the job lock."""
