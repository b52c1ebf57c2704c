"""Secure by default: loopback unless told otherwise; CURVE encrypts and admits only authorised keys.

A recording TCP proxy sits between client and server and keeps every byte the
client sent, so "the traffic is encrypted" is checked on the real stream: a
sentinel payload is visible in it without CURVE (the control) and absent with it.
"""

import socket
import threading

import pytest
import torch
import zmq

from commlab.transport import keys, sockets as transport, wire
from commlab.base.errors import CommTimeout, ConfigError

SENTINEL = b"commlab-plaintext-sentinel-" * 8


class RecordingProxy:
    """127.0.0.1:port -> target; records client->server bytes."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.seen = bytearray()
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.lsock.settimeout(10)
        threading.Thread(target=self._serve, daemon=True).start()

    def _pump(self, src, dst, record):
        try:
            while data := src.recv(65536):
                if record:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _serve(self):
        try:
            client, _ = self.lsock.accept()
        except OSError:
            return
        upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
        upstream.settimeout(None)
        client.settimeout(None)
        threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def close(self):
        self.lsock.close()


def echo_once(server_sock, timeout=5.0):
    """Serve one request: echo its frames back. Returns the frames or None if none came."""
    if not server_sock.poll(int(timeout * 1000)):
        return None
    frames = server_sock.recv_multipart()
    server_sock.send_multipart(frames)
    return frames


def roundtrip(server_t, client_t, authorized=None):
    srv = server_t.bind(zmq.ROUTER, "tcp://127.0.0.1:*", authorized=authorized)
    port = int(srv.last_endpoint.decode().rsplit(":", 1)[1])
    proxy = RecordingProxy(port)
    cli = client_t.connect(zmq.DEALER, f"tcp://127.0.0.1:{proxy.port}")
    payload = torch.frombuffer(bytearray(SENTINEL), dtype=torch.uint8)
    transport.send(cli, wire.encode("push", "w", 0, wire.split("k", payload)))
    served = threading.Thread(target=echo_once, args=(srv,))
    served.start()
    try:
        reply = transport.recv(cli, 3.0, who="test server")
    except CommTimeout:
        reply = None
    served.join()
    proxy.close()
    return reply, bytes(proxy.seen)


def test_plaintext_control_shows_the_sentinel():
    s, c = transport.Transport(), transport.Transport()
    try:
        reply, seen = roundtrip(s, c)
        assert reply is not None and SENTINEL in seen  # without CURVE the payload is readable on the wire
    finally:
        s.close(), c.close()


def test_curve_encrypts_and_serves_authorised_clients(tmp_path):
    d = keys.create(tmp_path / "k", ["worker"])
    server_keys, authorized = keys.server_keys(d)
    s, c = transport.Transport(curve=server_keys), transport.Transport(curve=keys.client_keys(d, "worker"))
    try:
        reply, seen = roundtrip(s, c, authorized)
        assert reply is not None, "authorised client got no reply"
        h = wire.decode(reply)
        assert bytes(wire.frame_tensor(h.frames[0], reply[1]).numpy()) == SENTINEL
        assert len(seen) > len(SENTINEL) and SENTINEL not in seen and b"commlab" not in seen
    finally:
        s.close(), c.close()


def test_unauthorised_client_gets_no_reply_and_no_data(tmp_path):
    d = keys.create(tmp_path / "k", ["worker"])
    stranger_dir = keys.create(tmp_path / "other", ["worker"])  # a valid key pair the server never authorised
    stranger = transport.CurveKeys(keys.client_keys(stranger_dir).public, keys.client_keys(stranger_dir).secret,
                                   keys.client_keys(d).server_public)
    server_keys, authorized = keys.server_keys(d)
    s, c = transport.Transport(curve=server_keys), transport.Transport(curve=stranger)
    try:
        reply, seen = roundtrip(s, c, authorized)
        assert reply is None
        assert SENTINEL not in seen
    finally:
        s.close(), c.close()


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:*", "tcp://*:*"])
def test_non_loopback_bind_needs_keys_or_insecure(endpoint):
    t = transport.Transport()
    try:
        with pytest.raises(ConfigError, match=r"refusing to bind .* without authentication.*'commlab keys'.*--insecure"):
            t.bind(zmq.ROUTER, endpoint)
        t.bind(zmq.ROUTER, endpoint, insecure=True).close()  # said in so many words: allowed
    finally:
        t.close()


def test_keys_refuse_to_overwrite(tmp_path):
    keys.create(tmp_path / "k", ["worker"])
    with pytest.raises(ConfigError, match="already holds keys"):
        keys.create(tmp_path / "k", ["worker"])
    assert oct((tmp_path / "k" / "server.key_secret").stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("clients, why", [(["ok", "a/b"], "bad client key name 'a/b'"),
                                          (["ok", ""], "bad client key name ''"),
                                          (["ok", "server"], "bad client key name 'server'"),  # the server's own pair
                                          (["ok", "clients"], "bad client key name 'clients'"),
                                          (["ok", "ok"], "'ok' given twice")])
def test_bad_client_names_are_refused_before_anything_is_written(tmp_path, clients, why):
    # 'ok' comes first: a check made inside the write loop would already have written its pair
    empty, absent, used = tmp_path / "empty", tmp_path / "absent", tmp_path / "used"
    empty.mkdir()
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    for d in (empty, absent, used):
        with pytest.raises(ConfigError, match=why):
            keys.create(d, clients)
    assert list(empty.iterdir()) == [] and not absent.exists()
    assert [f.name for f in used.iterdir()] == ["notes.txt"] and (used / "notes.txt").read_text() == "mine"
    argv = [str(absent)] + [a for name in clients for a in ("--client", name)]
    assert keys.main(argv) == 2 and not absent.exists()  # the CLI says why (stderr) and writes nothing


@pytest.mark.multiproc
def test_servers_the_launcher_starts_get_the_keys_the_workers_use(tmp_path):
    """``ps://?shards=2&keys=DIR``: ``commlab train`` starts both servers with ``--keys DIR``. Workers
    with keys speak CURVE, so a server started without them never answers their hello (this
    job then fails within the URL's timeout, which is what it did before)."""
    from conftest import commlab_train
    d = keys.create(tmp_path / "k", ["worker"])
    done = commlab_train(["--exchanger", f"ps://?shards=2&mode=sync&timeout=10&keys={d}", "--workers", "2",
                          "--model", "tiny", "--steps", "2"], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
