"""Local ports for servers and launchers the tests start, without racing other jobs for them.

Where a server can bind port 0 itself and say which port it got (moto's server, a proxy, a ``TCPStore``), the
tests do that. Two cases cannot: a launcher whose ranks must all be told one port before rank 0 binds it
(``srun``'s ``MASTER_PORT``, torchrun's ``--master-port`` across agents), and a port where nothing may listen.

- :func:`refused_port`: a port held bound (never listening) for the block: a connection to it is refused, and
  no other job can take it meanwhile.
- :func:`on_a_free_port`: a port free when picked, handed to ``start``; another job may take it before rank 0
  binds it, so a start that failed because the port was taken (``taken``) is made again on another port.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

LOCALHOST = "127.0.0.1"
T = TypeVar("T")


@contextmanager
def refused_port() -> Iterator[int]:
    """A local port where nothing listens, held for the block."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        yield int(s.getsockname()[1])


def on_a_free_port(start: Callable[[int], T], taken: Callable[[T], bool], tries: int = 5) -> T:
    """``start(port)`` on a port that was free when picked; again on another port while ``taken(result)`` says
    the port was taken before it could be bound (at most ``tries`` times). Returns the last result."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind((LOCALHOST, 0))
            port = int(s.getsockname()[1])
        result = start(port)
        if not taken(result):
            return result
    return result
