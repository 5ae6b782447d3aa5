"""Running a job: the work plan (keys, skip rule), the local runner, Ray, the inbox watcher, dry run, progress."""
