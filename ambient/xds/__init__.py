"""Workload delta xDS: the server (``server``), its sans-I/O per-stream state machine
(``stream``), one generator per type URL (``generators``), and the ztunnel-like reference
client (``client``) with its command line (``cli``). See docs/xds.md."""
