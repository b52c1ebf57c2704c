"""``local://``: one worker, no exchange (the reference); ``noop://``: N workers that never talk.

``local://`` is the single-process large-batch step that every synchronous
regime must reproduce. ``noop://`` runs the same hooks and buckets as the real
regimes but moves nothing: the floor a benchmark measures communication
against.
"""

from __future__ import annotations

from commlab.base.errors import ConfigError
from commlab.core.exchanger import BucketedExchanger
from commlab.base.handles import DoneHandle


class LocalExchanger(BucketedExchanger):
    scheme = "local"
    carry_presence = False

    def _connect(self, model, optimizer):
        if self.world_size != 1 and self.scheme == "local":
            raise ConfigError(f"local:// runs one worker, but the launcher started {self.world_size} "
                              f"(rank {self.rank}); use noop:// for independent workers")

    def _start_bucket(self, bucket):
        return DoneHandle(what=f"bucket {bucket.index}")

    def _finish(self):
        self._drop_absent_grads()

    def _sync_buffers(self, mode):
        pass  # one worker (local://), or workers that never talk (noop://): nothing to make equal


class NoopExchanger(LocalExchanger):
    scheme = "noop"
