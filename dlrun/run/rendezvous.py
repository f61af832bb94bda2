"""The client's Horovod gloo rendezvous: ``dlrun.remote.rendezvous`` (a host program module, so
a detached job's leader keeper can run it too) with its errors as ``RendezvousError``.
"""

from __future__ import annotations

from collections.abc import Mapping

from dlrun.errors import RendezvousError
from dlrun.remote import rendezvous as _remote
from dlrun.remote.rendezvous import RendezvousServerError, scope_sizes

__all__ = ["RendezvousServer", "scope_sizes"]


class RendezvousServer(_remote.RendezvousServer):
    """:class:`dlrun.remote.rendezvous.RendezvousServer`, raising :class:`RendezvousError`."""

    def __init__(self, scope_sizes: Mapping[str, int], host: str = "127.0.0.1", port: int = 0,
                 key: str | None = None) -> None:
        try:
            super().__init__(scope_sizes, host=host, port=port, key=key)
        except RendezvousServerError as exc:
            raise RendezvousError(str(exc), hint=exc.hint or None) from exc

    def start(self) -> tuple[str, int]:
        try:
            return super().start()
        except RendezvousServerError as exc:
            raise RendezvousError(str(exc), hint=exc.hint or None) from exc
