"""The training worker: models, data, loop. Run it as ``python -m workers`` (or under torchrun)."""
