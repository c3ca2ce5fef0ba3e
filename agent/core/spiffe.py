"""A workload's SPIFFE identity, ``spiffe://<trust domain>/ns/<namespace>/sa/<service account>``.

Istio's identity form (upstream ``istio/istio:pkg/spiffe/spiffe.go``, ``Identity`` and
``ParseIdentity``). The SDS cache and CAs issue certificates for it, the TLS ports'
authenticator (``agent.tlsport.authn``) finds it in client certificates and tokens, so it
lives in the kernel where both reach it.
"""

from __future__ import annotations

import dataclasses
import re

_SPIFFE = re.compile(r"^spiffe://([^/]+)/ns/([^/]+)/sa/([^/]+)$")


@dataclasses.dataclass(frozen=True)
class Identity:
    """A workload identity: ``spiffe://<trust_domain>/ns/<namespace>/sa/<service_account>``."""

    trust_domain: str
    namespace: str
    service_account: str

    @property
    def spiffe_id(self) -> str:
        return f"spiffe://{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"

    @classmethod
    def parse(cls, uri: str) -> "Identity":
        """Parse ``spiffe://td/ns/X/sa/Y``; raises ValueError naming the value otherwise."""
        m = _SPIFFE.match(uri or "")
        if not m:
            raise ValueError(f"identity {uri!r} is not spiffe://<trust domain>/ns/<ns>/sa/<sa>")
        return cls(*m.groups())

    def __str__(self) -> str:
        return self.spiffe_id
