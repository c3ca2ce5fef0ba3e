"""ambient/objects.py's IP helpers answer what ``ipaddress`` answers (their fast path is the
C parser/formatter): same bytes, same text, the same error for what either refuses."""

from __future__ import annotations

import ipaddress
import random

import pytest

from ambient.objects import TranslateError, ip_bytes, ip_text, parse_ip_or_none

FORMS = ["1.2.3.4", "0.0.0.0", "255.255.255.255", "01.2.3.4", "1.2.3.04", "1.2.3", "1.2.3.4.5",
         "256.1.1.1", "0x1.2.3.4", "1.2.3.-4", "1.2.3.4/32", "", " 1.2.3.4 ", "1.2.3.4\x00",
         "١.٢.٣.٤", "::", "::1", "fe80::1%eth0", "::ffff:1.2.3.4", "::ffff:01.2.3.4",
         "2001:db8::1", "2001:DB8::1", "1:2:3:4:5:6:7:8", "1::2:3:4:5:6:7:8", ":::", "1::",
         "::1.2.3.4", "1:2:3:4:5:6:1.2.3.4", "1:2:3:4:5:6:7:8:9", "g::1"]


def _random_forms(n: int) -> list[str]:
    rnd = random.Random(28)
    out = []
    for _ in range(n):
        out.append(".".join(str(rnd.randint(0, 300)) for _ in range(rnd.choice([3, 4, 4, 5]))))
        out.append(":".join(rnd.choice(["", "0", "1", "ab", "ffff", "10000", "g"])
                            for _ in range(rnd.randint(2, 9))))
    return out


@pytest.mark.parametrize("text", FORMS)
def test_ip_bytes_as_ipaddress(text):
    try:
        want = ipaddress.ip_address(text.strip()).packed
    except ValueError:
        with pytest.raises(TranslateError, match="is not an IP address"):
            ip_bytes(text, "status.podIP")
        assert parse_ip_or_none(text) is None
        return
    assert ip_bytes(text, "status.podIP") == want == parse_ip_or_none(text)


def test_many_random_forms_parse_as_ipaddress():
    for text in _random_forms(5000):
        try:
            want = ipaddress.ip_address(text).packed
        except ValueError:
            want = None
        assert parse_ip_or_none(text) == want, text


def test_ip_text_as_ipaddress():
    rnd = random.Random(28)
    for raw in ([bytes(rnd.randrange(256) for _ in range(4)) for _ in range(2000)]
                + [bytes(rnd.choice([0, 0, 0, 1, 255]) for _ in range(16)) for _ in range(2000)]
                + [ipaddress.ip_address("::ffff:1.2.3.4").packed, bytes(16), bytes(4)]):
        assert ip_text(raw) == str(ipaddress.ip_address(raw)), raw
