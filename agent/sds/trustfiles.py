"""Trust material on disk: the mesh root the agent publishes, and the PEM bundles it reads.

- :func:`publish_root` writes the mesh root to ``mesh_root_file`` (0644 in a 0755
  directory, atomically) so ztunnel can use it as ``XDS_ROOT_CA`` / ``CA_ROOT_CA``;
- :func:`read_trust_anchors` reads ``trust_anchors_file`` (extra anchors merged into
  ``ROOTCA``; upstream receives them as ``ProxyConfig.caCertificatesPem`` over xDS);
- :func:`read_pem_bundle` reads ``ca_root_cert`` (the remote CA's root) in canonical
  form, so a rewritten file with the same certificates is not a change.

All blocking (file I/O): callers on the event loop run them through ``run_blocking``.
"""

from __future__ import annotations

import os

from cryptography import x509

from agent.core.config import ConfigError
from agent.core.files import write_atomic
from agent.sds import keys


def publish_root(path: str, root: bytes) -> None:
    """Write ``root`` to ``path`` atomically, 0644, creating its directory 0755. Blocking;
    raises OSError."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    os.chmod(directory, 0o755)
    write_atomic(path, root if root.endswith(b"\n") else root + b"\n", 0o644)


def read_trust_anchors(path: str) -> bytes:
    """The PEM certificates in ``path`` (extra anchors). Raises
    :class:`ConfigError` naming ``trust_anchors_file`` when unreadable or not certificates."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        if not x509.load_pem_x509_certificates(data):
            raise ValueError("no certificate")
    except OSError as e:
        raise ConfigError("trust_anchors_file", path, e.strerror or str(e)) from None
    except ValueError as e:
        raise ConfigError("trust_anchors_file", path, f"not PEM certificates ({e})") from None
    return data


def read_pem_bundle(path: str) -> bytes:
    """The certificates of a PEM file in canonical form (split, de-duplicated, sorted:
    :func:`agent.sds.keys.merge_trust`), so two files holding the same certificates in
    another order compare equal. Raises OSError, or ValueError when it holds none."""
    with open(path, "rb") as f:
        data = f.read()
    keys.load_certs(data, f"ca_root_cert {path}")
    return keys.merge_trust(data)
