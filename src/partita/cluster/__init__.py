"""The hardware as the planner sees it: devices, links, clusters; presets for hardware you don't have."""

from partita.cluster.cluster import Cluster, DeviceSpec, Link, RuntimeOverheads
from partita.cluster.presets import DEVICES, parse_cluster

__all__ = ["Cluster", "DEVICES", "DeviceSpec", "Link", "RuntimeOverheads", "parse_cluster"]
