"""The kernel every package imports: common helpers (and, as issue 18's moves land,
configuration, lifecycle, errors and logging). Imports nothing from the components
above it (``cni``, ``zds``, ``ambient``, ``agent.sds``, ``agent.status``); the import
contracts in ``pyproject.toml`` enforce it."""
