"""The ``kubernetes_asyncio`` client configuration every Kubernetes caller of the agent
uses (the config source, TokenReview authentication, ``precheck``): ``kubeconfig`` when
that setting is set, else the pod's in-cluster service account, as client-go's
``rest.InClusterConfig`` and istiod's ``kube.DefaultRestConfig`` fall back."""

from __future__ import annotations

from typing import Any

from agent.core.config import ConfigError


async def client_configuration(kubeconfig: str) -> Any:
    """A loaded ``kubernetes_asyncio.client.Configuration``. Raises :class:`ConfigError`
    naming ``kubeconfig`` when it is empty and this process is not in a pod (the
    library's own text was "Service host/port is not set."), and what the kubeconfig
    loader raises for a file it cannot use."""
    from kubernetes_asyncio import client as kclient, config as kconfig

    cfg = kclient.Configuration()
    if kubeconfig:
        await kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        return cfg
    try:
        kconfig.load_incluster_config(client_configuration=cfg)
    except kconfig.ConfigException as e:
        raise ConfigError("kubeconfig", "", f"not set, and no in-cluster service account to "
                          f"fall back to ({e}): set kubeconfig to a kubeconfig file, or run "
                          "the agent in a pod") from None
    return cfg
