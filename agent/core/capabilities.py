"""Which Linux capabilities this process holds (``CapEff`` of ``/proc/self/status``).

The agent needs CAP_NET_ADMIN for every rule it writes (host probe rules, in-pod rules,
ipsets): ``run`` refuses to start without it, and ``precheck`` says so once instead of
letting each check that needs it fail with its own "operation not permitted".
"""

from __future__ import annotations

CAP_NET_ADMIN = 12  # linux/capability.h


def has_net_admin(status_path: str = "/proc/self/status") -> bool:
    """Whether this process has CAP_NET_ADMIN in its effective set (``CapEff`` of
    ``status_path``); True when that can't be read (the components then say)."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True
