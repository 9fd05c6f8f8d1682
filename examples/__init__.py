"""Example training loops to submit as custom entrypoints (``examples.<module>:train_loop``)."""
