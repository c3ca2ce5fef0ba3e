"""Issue 27: a malformed tokens file (a YAML list, a number or mapping where a string
belongs) is named at start-up — the authn component refuses to start with one line naming
``tokens_file`` — and never reveals a token in the reason."""

from __future__ import annotations

import pytest

from agent.core.config import ConfigError
from agent.tlsport.authn import Authenticator, AuthnComponent, TokensFile

SECRET = "s3cret-token-value"


@pytest.mark.parametrize("text, reason", [
    (f"- {SECRET}\n- istio-system/ztunnel\n", "top level must be a mapping"),
    (f"{SECRET}: 12\n", "entry 1: the identity is a int"),
    (f"{SECRET}: {{ns: a}}\n", "entry 1: the identity is a dict"),
    ("12345: istio-system/ztunnel\n", "entry 1: the token is a int"),
    ("yes: istio-system/ztunnel\n", "entry 1: the token is a bool"),
    (f"{SECRET}: [a, b\n", "malformed YAML at line 2"),
])
async def test_malformed_tokens_file_stops_start(tmp_path, text, reason):
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    path.chmod(0o600)
    tokens = TokensFile(str(path), "cluster.local")
    component = AuthnComponent(Authenticator("cluster.local", tokens))
    with pytest.raises(ConfigError, match=reason) as e:
        await component.start()
    assert e.value.setting == "tokens_file" and SECRET not in str(e.value)
    assert "12345" not in str(e.value)
    # at call time, the same file accepts nobody and says why
    assert tokens.lookup(SECRET) is None and reason.split(": ")[-1] in tokens.error


async def test_good_tokens_file_starts(tmp_path):
    path = tmp_path / "tokens.yaml"
    path.write_text(f"{SECRET}: istio-system/ztunnel\n'12345': spiffe://td/ns/a/sa/b\n")
    path.chmod(0o600)
    tokens = TokensFile(str(path), "cluster.local")
    component = AuthnComponent(Authenticator("cluster.local", tokens))
    await component.start()
    assert tokens.lookup("12345").spiffe_id == "spiffe://td/ns/a/sa/b"
    assert tokens.lookup(SECRET).service_account == "ztunnel"
