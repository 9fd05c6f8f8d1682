"""Training loops that tests submit as custom entrypoints (``tests.workloads:...``)."""
