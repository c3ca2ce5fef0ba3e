"""The authenticator chain's logic: client certificate first, then the tokens file, then
the TokenReview verdict (its mapping from TokenReview status to caller or reason, and the
cache). The TokenReview call itself is exercised against a real kube-apiserver in
tests/kube/ (no fake API server here: ``_review`` results are built as the API returns
them). Tokens never appear in reasons or logs."""

from __future__ import annotations

import logging
import os

import pytest
from kubernetes_asyncio import client as kclient

from agent.tlsport.authn import AuthenticationError, Authenticator, TokenReviewAuthenticator, TokensFile
from agent.tlsport.frontdoor import TlsPeer
from tests.xds.certs import Pki

SECRET = "t0ken-value-never-logged"


class Context:
    def __init__(self, peer="unix-abstract:x", metadata=()):
        self._peer, self._metadata = peer, list(metadata)

    def peer(self):
        return self._peer

    def invocation_metadata(self):
        return self._metadata


class Door:
    def __init__(self, peers):
        self.peers = peers

    def lookup(self, peer):
        return self.peers.get(peer)


def tls_peer(spiffe_id=None):
    if spiffe_id is None:
        return TlsPeer("ipv4:1.2.3.4:5", None, (), "TLSv1.3", "h2")
    from cryptography import x509
    cert, _ = Pki().leaf(spiffe_id)
    der = x509.load_pem_x509_certificate(cert).public_bytes(
        __import__("cryptography.hazmat.primitives.serialization", fromlist=["x"]).Encoding.DER)
    return TlsPeer("ipv4:1.2.3.4:5", der, (spiffe_id,), "TLSv1.3", "h2")


def review(authenticated=True, username="system:serviceaccount:istio-system:ztunnel",
           groups=("system:serviceaccounts", "system:authenticated"), error=None, extra=None):
    return kclient.V1TokenReview(spec=kclient.V1TokenReviewSpec(token="x"),
                                 status=kclient.V1TokenReviewStatus(
                                     authenticated=authenticated, error=error,
                                     user=kclient.V1UserInfo(username=username,
                                                             groups=list(groups), extra=extra)))


class Reviewer(TokenReviewAuthenticator):
    """The real authenticator with the API call replaced by canned API answers."""

    def __init__(self, answers, **kw):
        super().__init__(None, ["istio-ca"], "cluster.local", "Kubernetes", **kw)
        self.answers = answers

    async def _review(self, token):
        self.reviews += 1
        return self._result(self.answers[token])


async def test_client_certificate_first_then_tokens_file(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"{SECRET}: istio-system/ztunnel\nother: spiffe://td2/ns/a/sa/b\n")
    tokens.chmod(0o600)
    chain = Authenticator("cluster.local", TokensFile(str(tokens), "cluster.local"))
    chain.add_front_door(Door({"unix-abstract:cert": tls_peer("spiffe://cluster.local/ns/x/sa/y"),
                               "unix-abstract:nocert": tls_peer()}))
    caller = await chain.authenticate(Context("unix-abstract:cert"))
    assert caller.spiffe_id == "spiffe://cluster.local/ns/x/sa/y"
    assert caller.source == "client certificate"
    caller = await chain.authenticate(Context("unix-abstract:nocert",
                                              [("authorization", f"Bearer {SECRET}")]))
    assert caller.spiffe_id == "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
    assert (await chain.authenticate(Context("unix-abstract:nocert", [
        ("authorization", "bearer other")]))).spiffe_id == "spiffe://td2/ns/a/sa/b"
    for metadata, reason in ((), "no client certificate and no 'authorization: Bearer' token"),\
            ([("authorization", "Bearer nope")], "bearer token is not in tokens_file"):
        with pytest.raises(AuthenticationError, match=reason):
            await chain.authenticate(Context("unix-abstract:nocert", metadata))
    with pytest.raises(AuthenticationError, match="TLS only"):
        await chain.authenticate(Context("ipv4:127.0.0.1:9", [("authorization",
                                                               f"Bearer {SECRET}")]))
    # an edited file is re-read; a broken one accepts nobody and says why (not the token)
    tokens.write_text(f"{SECRET}: not-an-identity\n")
    os.utime(tokens, (1, 1))
    with pytest.raises(AuthenticationError) as e:
        await chain.authenticate(Context("unix-abstract:nocert", [("authorization",
                                                                   f"Bearer {SECRET}")]))
    assert "entry 1" in str(e.value) and SECRET not in str(e.value)
    tokens.write_text(f"{SECRET}: [unclosed\n")
    os.utime(tokens, (2, 2))
    with pytest.raises(AuthenticationError, match="malformed YAML at line") as e:
        await chain.authenticate(Context("unix-abstract:nocert", [("authorization",
                                                                   f"Bearer {SECRET}")]))
    assert SECRET not in str(e.value)
    assert SECRET not in caplog.text


async def test_token_review_verdicts_name_the_reason():
    extra = {"authentication.kubernetes.io/pod-name": ["ztunnel-abc"],
             "authentication.kubernetes.io/pod-uid": ["uid-1"]}
    answers = {
        "good": review(extra=extra),
        "aud": review(False, error="[invalid bearer token, token audiences [\"api\"] is "
                                   "invalid for the target audiences [\"istio-ca\"]]"),
        "expired": review(False, error="[invalid bearer token, square/go-jose/jwt: validation "
                                       "failed, token is expired (exp)]"),
        "user": review(groups=("system:authenticated",), username="alice"),
    }
    reviewer = Reviewer(answers)
    chain = Authenticator("cluster.local", token_review=reviewer)
    caller = await chain.authenticate_token("good")
    assert caller.spiffe_id == "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
    assert (caller.source, caller.pod_name, caller.pod_uid) == ("TokenReview", "ztunnel-abc",
                                                                "uid-1")
    for token, reason in (("aud", "wrong audience (this agent accepts istio-ca)"),
                          ("expired", "invalid or expired"),
                          ("user", "not a service account token")):
        with pytest.raises(AuthenticationError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            await chain.authenticate_token(token)
    with pytest.raises(AuthenticationError, match="client claims to be in cluster 'east'"):
        await chain.authenticate_token("good", "east")
    # cached by hash: a second call does not review again, failures neither (briefly)
    reviews = reviewer.reviews
    await chain.authenticate_token("good")
    with pytest.raises(AuthenticationError):
        await chain.authenticate_token("aud")
    assert reviewer.reviews == reviews
    assert all(len(k) == 64 for k in reviewer._cache)  # SHA-256 keys, never the token


async def test_token_review_cache_expires_and_is_bounded():
    now = [0.0]
    reviewer = Reviewer({f"t{i}": review() for i in range(5)}, cache_ttl=30, max_entries=3,
                        clock=lambda: now[0])
    for i in range(5):
        await reviewer.authenticate(f"t{i}")
    assert len(reviewer._cache) == 3 and reviewer.reviews == 5
    await reviewer.authenticate("t4")
    assert reviewer.reviews == 5
    now[0] = 31
    await reviewer.authenticate("t4")
    assert reviewer.reviews == 6


async def test_no_token_authenticator_configured_says_so():
    chain = Authenticator("cluster.local")
    chain.add_front_door(Door({"unix-abstract:p": tls_peer()}))
    with pytest.raises(AuthenticationError, match="bearer tokens are not accepted here"):
        await chain.authenticate(Context("unix-abstract:p", [("authorization", "Bearer x")]))
