"""The agent's TLS ports, shared by the components that serve gRPC over TLS.

Two components serve TLS to ztunnel: the workload xDS server (``ambient.xds``, the
``xds_tls_port``, istiod's 15012) and the embedded CA (``agent.sds``, on that port and
on its own ``ca_port``). What a TLS port needs sits here, below both, so neither
imports the other for it:

- :mod:`agent.tlsport.servercert` — the listener's server certificate and its renewal
  (the certificate itself comes from a provider the caller passes, in practice the
  ``sds`` component);
- :mod:`agent.tlsport.frontdoor` — the TLS front door: terminates TLS, records each
  connection's peer and relays it to the gRPC server's private Unix socket;
- :mod:`agent.tlsport.authn` — component ``authn``: who is calling (client
  certificate, tokens file, Kubernetes TokenReview).

Layer: above the core layer (``agent.core``), below the components; it imports no
component (an import-linter contract in ``pyproject.toml``).
"""
