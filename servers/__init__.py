"""Parameter-server processes: one shard per process (``python -m servers`` / ``commlab server``)."""
