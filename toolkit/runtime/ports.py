"""Free TCP ports on this host, for the rendezvous of ranks started on one machine."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that was free a moment ago (the OS picks it; another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
