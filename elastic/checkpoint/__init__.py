"""Checkpoints: where they are stored, a job's directory of them with its retention, the parts
a checkpoint holds, and the worker's writer that saves them off the training's critical path."""
