"""Runnable recipes over the pipeline's library: each one a command (`python -m recipes.<name>`) that
composes pipeline/ (data, models, sources, training, evaluation) for a whole task end to end."""
