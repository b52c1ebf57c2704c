"""commlab.transport.sockets: which I/O thread carries a socket's bytes is the caller's choice, and it holds."""

import os
import re
import shutil
import tempfile
import time

import pytest
import zmq

from commlab.base.errors import ConfigError
from commlab.transport.sockets import Transport


def _threads() -> dict[int, str]:
    return {int(tid): open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")}


def _cpu_ticks(tid: int) -> int:
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _io_threads(before: set[int]) -> list[int]:
    """The ids of the two I/O threads a context started after ``before`` (each names itself once running)."""
    deadline = time.monotonic() + 10
    while True:
        mine = {name: tid for tid, name in _threads().items() if tid not in before}
        if "ZMQbg/IO/0" in mine and "ZMQbg/IO/1" in mine:
            return [mine["ZMQbg/IO/0"], mine["ZMQbg/IO/1"]]
        assert time.monotonic() < deadline, f"no zmq I/O threads among {mine}"
        time.sleep(0.01)


def _io_thread_work(pull_on: int, push_on: int, megabytes: int = 512) -> list[int]:
    """Stream ``megabytes`` from a PUSH pinned to one I/O thread to a PULL pinned to another (or the
    same), in 4 MiB zero-copy frames; the CPU ticks each of the context's two I/O threads spent."""
    before = set(_threads())
    net = Transport(io_threads=2)
    folder = tempfile.mkdtemp(prefix="commlab-test-")
    try:
        pull = net.bind(zmq.PULL, f"ipc://{folder}/s", io_thread=pull_on)
        push = net.connect(zmq.PUSH, f"ipc://{folder}/s", io_thread=push_on)
        io = _io_threads(before)
        start = [_cpu_ticks(tid) for tid in io]
        frame = bytearray(4 << 20)
        for _ in range(megabytes // 4):
            push.send(frame, copy=False)
            assert pull.poll(10_000), "the frame never arrived"
            assert len(pull.recv(copy=False)) == len(frame)
        return [_cpu_ticks(tid) - t0 for tid, t0 in zip(io, start)]
    finally:
        net.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads per-thread CPU time from /proc")
def test_pinned_sockets_use_the_io_thread_they_were_given():
    # Both ends on thread 0: thread 1 idles. Apart: both threads copy (the ring's layout).
    together = _io_thread_work(0, 0)
    assert together[0] > 0 and together[1] == 0, together
    apart = _io_thread_work(0, 1)
    assert apart[0] > 0 and apart[1] > 0, apart


def test_pinning_to_a_missing_io_thread_is_refused():
    net = Transport(io_threads=2)
    try:
        with pytest.raises(ConfigError, match="I/O thread 2 does not exist: the context has 2"):
            net.bind(zmq.PULL, "tcp://127.0.0.1:0", io_thread=2)
        assert net.bind(zmq.PULL, "tcp://127.0.0.1:0", io_thread=1).affinity == 2
    finally:
        net.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="reads the kernel's socket buffers with ss (iproute2)")
def test_send_buffer_reaches_the_kernel():
    """``Transport(sndbuf=...)`` fixes SO_SNDBUF of the real TCP connections (Linux reports twice the value
    asked for; left alone, loopback TCP grows it to 4 MiB on the machines we measured)."""
    import subprocess

    net = Transport(sndbuf=512 * 1024)
    try:
        pull = net.bind(zmq.PULL, "tcp://127.0.0.1:0")
        port = int(pull.last_endpoint.decode().rsplit(":", 1)[1])
        push = net.connect(zmq.PUSH, f"tcp://127.0.0.1:{port}")
        push.send(b"hello")
        assert pull.poll(10_000) and pull.recv() == b"hello"
        out = subprocess.run(["ss", "-tmnH", "dport", "=", f":{port}"], capture_output=True, text=True,
                             timeout=10).stdout
        buffers = re.findall(r"tb(\d+)", out)
        assert buffers == ["1048576"], out
    finally:
        net.close()


def test_send_buffer_is_fixed_only_within_this_host():
    """Towards another host the kernel's autotuning stays (a fixed buffer would cap a long fat link);
    zmq reports -1 for "the system's". The remote case never touches the network: the attach step is
    a stand-in, so no packet leaves this machine."""
    from commlab.transport.sockets import _open

    net = Transport(sndbuf=512 * 1024)
    try:
        assert net.connect(zmq.PUSH, "tcp://127.0.0.1:9").sndbuf == 512 * 1024
        assert net.connect(zmq.PUSH, "ipc:///nonexistent/commlab-test").sndbuf == 512 * 1024
        remote = _open(net.socket(zmq.PUSH), lambda endpoint: None, "connect to", "tcp://192.0.2.1:9", 512 * 1024)
        assert remote.sndbuf == -1
        remote.close()
    finally:
        net.close()


def test_a_monitored_socket_closed_thousands_of_times_leaks_nothing():
    """close_monitored disables the monitor before closing: closing a watched socket alone keeps libzmq's side of the
    monitor open (a descriptor, and the inproc address a later socket with the same descriptor needs: "Address
    already in use", or "Too many open files" first). 400 watched connections opened and closed in one context:
    without the monitor disabled each leaves a descriptor open."""
    from commlab.transport.sockets import close_monitored

    ctx = zmq.Context()
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(400):
            sock = ctx.socket(zmq.DEALER)
            sock.connect("tcp://127.0.0.1:1")
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
            close_monitored(sock, monitor)
        deadline = time.monotonic() + 30  # libzmq's reaper closes them behind the loop, later under load
        while len(os.listdir("/proc/self/fd")) - before >= 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir("/proc/self/fd")) - before < 50
    finally:
        ctx.destroy(linger=0)
