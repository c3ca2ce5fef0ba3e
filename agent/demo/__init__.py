"""The demo and its helpers: ``ambient-agent demo`` (a node in a box, ``docs/demo.md``)
and what it, the tests and the benchmarks use to drive the agent from outside.

Nothing here is part of the daemon: no daemon package (``cni``, ``zds``, ``ambient``,
``agent.sds``, ``agent.status``, ``agent.core``) imports this package (an import-linter
contract in ``pyproject.toml``). Modules:

- :mod:`agent.demo.cli`: the subcommand's flags and entry point;
- :mod:`agent.demo.driver` (:class:`~agent.demo.driver.Demo`, bring-up and teardown),
  :mod:`agent.demo.state` (what a run holds), :mod:`agent.demo.pods` (starting pods through
  CNI), :mod:`agent.demo.checks` (the table of checks), :mod:`agent.demo.model` (pods,
  rows, errors, constants), :mod:`agent.demo.traffic` (sockets inside pods, netns,
  ztunnel's metrics);
- launchers for real peers: :mod:`agent.demo.podman`, :mod:`agent.demo.envoy`,
  :mod:`agent.demo.ztunnel` (a ztunnel binary), and :mod:`agent.demo.cni_runtime` (runs a
  conflist's plugins the way a container runtime does);
- :mod:`agent.demo.fake_ztunnel` (with :mod:`agent.demo.pod_listeners` and
  :mod:`agent.demo.fake_ztunnel_thread`): the Python ztunnel stand-in shared by the demo,
  the tests and the benchmarks;
- :mod:`agent.demo.examples`: Pod manifests as the example cluster writes them.
"""
