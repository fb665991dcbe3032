"""ControlTLS: how the control plane's connections are secured (a ``ZeroConfig`` option).

Pure: it checks that the files it names exist, and imports neither grpc nor ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ControlTLS:
    """TLS for the control plane (every owner's server, the driver's Coordinator, all clients).

    cert/key: a certificate valid for the nodes' addresses (subjectAltName IPs) and its key;
    ca: the CA that signed it, which every client checks the servers against. mutual: clients
    present the same certificate and servers require it (mTLS).
    """

    cert: str
    key: str
    ca: str
    mutual: bool = True

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if not os.path.isfile(path):
                raise ConfigError(f"control TLS {name}={path!r} is not a file")
