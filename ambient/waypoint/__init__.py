"""Envoy configuration for waypoints (``docs/waypoint.md``): what a waypoint Gateway
serves (:mod:`.model`), its AuthorizationPolicies as Envoy RBAC (:mod:`.rbac`), the
listeners, clusters, endpoints, routes and secrets built from them (:mod:`.resources`),
and the bootstrap a waypoint Envoy starts with (:mod:`.bootstrap`).

Imports only downward: the ambient index's API (:mod:`ambient.api`), the object
helpers and the waypoint binding rules; never the xDS server, which imports this.
"""
