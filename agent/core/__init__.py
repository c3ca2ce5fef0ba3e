"""The core layer every package imports: configuration, lifecycle, errors, logging and
common helpers. ("Kernel" elsewhere in this code always means the Linux kernel, e.g.
``cni.enrollment.kernel``, the real netns operations.) Imports nothing from the components
above it (``cni``, ``zds``, ``ambient``, ``agent.sds``, ``agent.status``); the import
contracts in ``pyproject.toml`` enforce it."""
