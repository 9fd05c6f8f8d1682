"""What runs inside a training worker in either mode: the training context and its step loop,
sampling, the learning-rate schedule, distributed wrapping, the process group, logs and metrics."""

from elastic.train.current import get_context

__all__ = ["get_context"]
