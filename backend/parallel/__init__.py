"""Tensor and expert parallelism: the layout of a model over ranks, the collectives, the worker processes."""
