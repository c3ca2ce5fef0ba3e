"""JSON and HTTP/1.1 for the ``istio-cni`` plugin (:mod:`cni.plugin`), on built-in C
modules of the standard library only.

The pure-Python ``json``, ``socket`` and ``http.client`` modules pull in ``re``,
``enum``, ``email`` and ``ssl`` (~30 ms per exec, against a ~9 ms interpreter start), so
this module parses and writes JSON with ``_json`` (the C scanner and encoder
``json.loads``/``json.dumps`` use) and speaks HTTP/1.1 over an ``AF_UNIX`` socket with
``_socket``. ``time`` is imported where a request is made. Nothing here may import
anything else at module level: it is on every pod's start-up path.
"""

try:  # the C accelerator of the stdlib json module, without json's `re` import
    import _json
except ImportError:  # pragma: no cover - non-CPython
    _json = None  # type: ignore[assignment]
import _socket

DEFAULT_TIMEOUT = 5.0  # seconds: an agent answer, as Istio's plugin client waits
MAX_TIMEOUT = 3600  # seconds: the most agent_timeout may ask (runtimes give up far sooner)

# JSON through the stdlib's C accelerator (same parser/encoder json.loads/dumps use) ---

class _ScanContext:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo: dict = {}

    @staticmethod
    def parse_constant(name):
        raise ValueError("%s is not valid JSON" % name)


_WS = " \t\n\r"


def json_loads(text):
    """Parse one JSON document (str). Raises ValueError with the offset on bad input."""
    if _json is None:  # pragma: no cover
        import json
        return json.loads(text)
    start = len(text) - len(text.lstrip(_WS))
    try:
        value, end = _json.make_scanner(_ScanContext())(text, start)
    except (StopIteration, SystemError):
        # cold path: the C scanner can only build its error message once json.decoder
        # is imported (CPython 3.11), so let the json module explain the error
        import json
        json.loads(text)
        raise ValueError("malformed JSON") from None
    if text[end:].strip(_WS):
        raise ValueError("extra data at offset %d" % end)
    return value


def json_dumps(value):
    """Compact JSON text of dicts/lists/str/int/float/bool/None."""
    if _json is None:  # pragma: no cover
        import json
        return json.dumps(value, separators=(",", ":"))
    encode = _json.make_encoder(None, None, _json.encode_basestring_ascii, None, ":", ",",
                                False, False, True)
    return "".join(encode(value, 0))


# HTTP/1.1 over a Unix stream socket

def http_request(socket_path, method, path, body=b"", timeout=DEFAULT_TIMEOUT):
    """One HTTP/1.1 request with ``Connection: close``; returns ``(status, body bytes)``.

    ``timeout`` (seconds) bounds the whole exchange. Raises ``OSError`` (socket missing,
    refused; ``ConnectionError`` when the agent closed the connection without a byte of
    answer), ``TimeoutError`` or ``ValueError`` (unparsable or cut-off response). Written on
    ``_socket`` because ``http.client`` alone costs ~20 ms of imports per pod.
    """
    import time
    deadline = time.monotonic() + timeout
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        head = ("%s %s HTTP/1.1\r\nHost: localhost\r\nUser-Agent: istio-cni\r\n"
                "Content-Type: application/json\r\nContent-Length: %d\r\n"
                "Connection: close\r\n\r\n" % (method, path, len(body)))
        sock.sendall(head.encode("ascii") + body)
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
            status, payload = _parse_response(b"".join(chunks))
            if status is not None:
                return status, payload
    finally:
        sock.close()
    if not chunks:  # e.g. the agent stopped or was killed while handling the request
        raise ConnectionError("the agent closed the connection before answering")
    status, payload = _parse_response(b"".join(chunks), eof=True)
    if status is None:
        raise ValueError("the agent closed the connection in the middle of its answer "
                         "(incomplete HTTP response)")
    return status, payload


def _parse_response(raw, eof=False):
    """``(status, body)`` once the response is complete, else ``(None, None)``."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        if eof:
            raise ValueError("the agent closed the connection in the middle of its answer "
                             "(no complete HTTP header)")
        return None, None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError("malformed HTTP status line %r" % lines[0][:80])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(rest)
        return (int(parts[1]), body) if body is not None else (None, None)
    length = headers.get("content-length")
    if length is not None and length.isdigit():
        if len(rest) >= int(length):
            return int(parts[1]), rest[:int(length)]
        return None, None
    return (int(parts[1]), rest) if eof else (None, None)


def _dechunk(data):
    out, pos = [], 0
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return None
        size = int(data[pos:line_end].split(b";")[0] or b"0", 16)
        if size == 0:
            return b"".join(out)
        start = line_end + 2
        if len(data) < start + size + 2:
            return None
        out.append(data[start:start + size])
        pos = start + size + 2


def post_nowait(socket_path, path, body, timeout):
    """Send one ``POST`` and close without reading the answer (the plugin's log lines to
    the agent, upstream's tee to its log socket): connecting and writing are bounded by
    ``timeout`` seconds together. Raises ``OSError`` or ``TimeoutError``; the caller
    ignores them (forwarding logs must never fail or hold up a CNI command)."""
    import time
    deadline = time.monotonic() + timeout
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        head = ("POST %s HTTP/1.1\r\nHost: localhost\r\nUser-Agent: istio-cni\r\n"
                "Content-Type: application/json\r\nContent-Length: %d\r\n"
                "Connection: close\r\n\r\n" % (path, len(body)))
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(head.encode("ascii") + body)
    finally:
        sock.close()
