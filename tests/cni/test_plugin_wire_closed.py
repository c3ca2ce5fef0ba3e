"""The plugin's HTTP client says when the agent closed the connection (a newuser
finding: an agent killed mid-ADD was reported as "malformed HTTP response"). A real Unix
socket server that reads the request and hangs up, with or without a partial answer."""

from __future__ import annotations

import socket
import threading

import pytest

from cni.plugin_wire import http_request


def _serve_once(path: str, answer: bytes) -> threading.Thread:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def run():
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                if answer:
                    conn.sendall(answer)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("answer,error,text", [
    (b"", ConnectionError, "the agent closed the connection before answering"),
    (b"HTTP/1.1 200 OK\r\nContent-Ty", ValueError,
     "the agent closed the connection in the middle of its answer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", ValueError,
     "the agent closed the connection in the middle of its answer"),
])
def test_a_hang_up_is_named(tmp_path, answer, error, text):
    path = str(tmp_path / "s.sock")
    t = _serve_once(path, answer)
    with pytest.raises(error) as e:
        http_request(path, "POST", "/cmdadd", b"{}", 10.0)
    assert text in str(e.value)
    assert "malformed" not in str(e.value)
    t.join(10)
