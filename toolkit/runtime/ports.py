"""Free TCP ports on this host, for the rendezvous of ranks started on one machine.

A port handed out here is bound only later (by a TCPStore, a launcher's agent), so something
else may take it in between. Ports the kernel hands out by itself (``bind`` to port 0, the source
port of every outgoing connection: gloo opens many) come from the ephemeral range; a port below
that range is never taken that way, only by a program asking for it by number. So the port is
drawn at random below the ephemeral range, and one the OS says is in use is skipped.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # well above the registered services most machines run


def _ephemeral_start() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems: the draw below still checks the port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port that was free a moment ago, outside the range the OS hands out by itself."""
    top = _ephemeral_start()
    if top - _LOWEST >= 1000:
        draw = random.SystemRandom()
        for _ in range(50):
            port = draw.randrange(_LOWEST, top)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the OS's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
