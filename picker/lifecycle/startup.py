"""Start-up failures worded for the operator: one line naming the field, never a traceback.

`picker serve` checks that it can listen on each configured port before it starts anything, and maps
a bind that still fails (a race with that check) to the same kind of line. `cli.py` prints and exits.
"""

from __future__ import annotations

import errno
import re
import socket

from picker.config.model import PickerConfig

_PORT_FIELDS = ("grpc_port", "health_port", "metrics_port")


def cannot_listen(config: PickerConfig) -> str | None:
    """Why the servers could not bind, naming the field, or None. Checked before anything starts.

    Binds each port as the servers will (SO_REUSEADDR, no SO_REUSEPORT, so a second picker on the
    same port is refused rather than sharing it) and lets it go at once. Port 0 means "any port".
    """
    bind = config.server.bind_address
    taken: dict[int, str] = {}
    for name in _PORT_FIELDS:
        port = getattr(config.server, name)
        if port and port in taken:
            return f"server.{name}: port {port} is also server.{taken[port]}"
        taken[port] = name
        problem = bind_problem(bind, port, f"server.{name}", "server.bind_address")
        if problem is not None:
            return problem
    return None


def bind_problem(bind: str, port: int, field: str, address_field: str) -> str | None:
    """Why `port` on `bind` cannot be listened on, naming `field` (or `address_field`), or None."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as exc:
        return f"{address_field}: {bind!r} is not an address to listen on ({exc})"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{field}: port {port} is in use"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"{address_field}: {bind} is not an address of this host"
            if exc.errno == errno.EACCES:
                return f"{field}: no permission to listen on port {port}"
            return f"{field}: cannot listen on {bind} port {port}: {exc.strerror}"
    return None


async def serve_or_reason(config: PickerConfig) -> str | None:
    """Run the picker; a server that still fails to bind (a race with the check) is one line too."""
    from picker.app import serve
    from picker.wiring import StartupProblem

    try:
        await serve(config)
    except StartupProblem as exc:
        return str(exc)
    except (OSError, RuntimeError) as exc:
        text = str(exc)
        if "bind" not in text.lower():  # grpc: "Failed to bind to address"; aiohttp: "attempting to bind"
            raise
        text = text.split(";")[0]
        # grpc says "host:port", aiohttp "('host', port)"
        name = next(
            (n for n in _PORT_FIELDS if re.search(rf"[:,] ?{getattr(config.server, n)}\b", text)),
            "bind_address",
        )
        return f"server.{name}: cannot listen: {text}"
    return None
