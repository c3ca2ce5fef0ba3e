"""The demo and its helpers: ``ambient-agent demo`` (a node in a box, ``docs/demo.md``)
and what it, the tests and the benchmarks use to drive the agent from outside: launchers
for podman, Envoy and a ztunnel binary, the CNI runtime, the fake ztunnel, the example
manifests. No daemon package imports this package (an import-linter contract in
``pyproject.toml``).
"""
