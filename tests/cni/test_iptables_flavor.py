"""The recorded iptables flavor (``<state_dir>/iptables-flavor``): a damaged file never
stops start-up with an error that does not name it (issue 28)."""

from __future__ import annotations

import logging
import shutil

import pytest

from cni.rules_common import RulesError
from cni.rules_iptables import FLAVOR_FILE, detect_flavor

pytestmark = pytest.mark.skipif(
    not (shutil.which("iptables") and (shutil.which("iptables-nft-restore")
                                       or shutil.which("iptables-legacy-restore"))),
    reason="needs iptables and iptables-{nft,legacy}-restore installed")


def test_binary_flavor_file_is_named_ignored_and_rewritten(tmp_path, caplog):
    path = tmp_path / FLAVOR_FILE
    path.write_bytes(b"\xff\xfe\x00\x9c binary \x80" * 20)
    with caplog.at_level(logging.WARNING, logger="cni.rules_iptables"):
        flavor = detect_flavor(str(tmp_path))
    assert flavor in ("nft", "legacy")
    [record] = [r for r in caplog.records if "ignoring recorded iptables flavor" in r.message]
    assert str(path) in record.message
    assert len(record.message) < 300  # at most 32 bytes of the file are shown
    assert path.read_text() == flavor + "\n"  # detected again and recorded
    assert detect_flavor(str(tmp_path)) == flavor


def test_unreadable_flavor_file_names_it(tmp_path):
    (tmp_path / FLAVOR_FILE).mkdir()  # EISDIR: readable by nobody, root included
    with pytest.raises(RulesError) as e:
        detect_flavor(str(tmp_path))
    assert str(tmp_path / FLAVOR_FILE) in str(e.value)
