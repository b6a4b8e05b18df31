"""Deployment: render a host's systemd units and service configs from one cluster description.

``python -m xavier_core.deploy render --hosts FILE --host NAME --out DIR``.
"""

from .hosts import Cluster, HostSpec, load_cluster
from .render import RenderedUnit, plan_host, render_host

__all__ = ["Cluster", "HostSpec", "RenderedUnit", "load_cluster", "plan_host", "render_host"]
