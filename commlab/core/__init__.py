"""The contract a training loop sees (the Exchanger, connect, report, the DDP hook) and the
mechanics every regime shares: buckets, hooks, buffers, manifests, staging."""
