"""Authentication and authorization: the password file, the ACL file and plugins.

``fastbroker.auth.plugins`` is the documented plugin interface (docs/auth.md).
"""

from fastbroker.auth.acl import PUBLISH, READ, SUBSCRIBE, Acl
from fastbroker.auth.coordinator import AuthCoordinator, engine_keys, load_auth
from fastbroker.auth.passwords import PasswordFile, hash_password
from fastbroker.auth.plugins import AuthResult, ConnectRequest, Deny, Drop, Message, Plugin

__all__ = [
    "PUBLISH",
    "READ",
    "SUBSCRIBE",
    "Acl",
    "AuthCoordinator",
    "AuthResult",
    "ConnectRequest",
    "Deny",
    "Drop",
    "Message",
    "PasswordFile",
    "Plugin",
    "engine_keys",
    "hash_password",
    "load_auth",
]
