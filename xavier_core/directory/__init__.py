"""Directory access for peers and the router: the typed client and the peer's registration session."""

from .client import TERMINAL_ROOM_STATES, DirectoryClient, Registration
from .session import OnRegistered, PeerSession

__all__ = ["TERMINAL_ROOM_STATES", "DirectoryClient", "OnRegistered", "PeerSession", "Registration"]
