"""The password file: one ``username:hash`` line per user, salted slow hashes.

A line is ``username:$scrypt$ln=<log2 N>,r=<r>,p=<p>$<salt>$<hash>`` (salt and hash in base64
without padding; ``.`` is accepted for ``+`` so passlib's scrypt hashes load too), or
``username:$argon2id$...`` when the optional argon2-cffi package is installed. ``#`` comments
and blank lines are kept by ``fastbroker passwd``. Parsing happens once at load (and on SIGHUP);
verifying costs one scrypt (about 50 ms at the default cost on a 2-core VM; 2**15 took 105 ms),
which the coordinator runs off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fastbroker.config import ConfigError

# log2 of scrypt's N: 2**14 with r=8 (16 MiB) is scrypt's classic interactive-login setting;
# each step up doubles the time and memory of every connect with a password.
DEFAULT_COST = 14
MIN_COST = 4
MAX_COST = 18
DEFAULT_R = 8
DEFAULT_P = 1
SALT_BYTES = 16
HASH_BYTES = 32
# A hostile or mistyped line must not make one verification take gigabytes.
MAX_SCRYPT_MEMORY = 256 * 1024 * 1024
MAX_USERNAME_BYTES = 65_535

SCRYPT_LINE = re.compile(
    r"\$scrypt\$ln=(?P<ln>[0-9]{1,2}),r=(?P<r>[0-9]{1,3}),p=(?P<p>[0-9]{1,3})"
    r"\$(?P<salt>[A-Za-z0-9+/.]+)\$(?P<hash>[A-Za-z0-9+/.]+)"
)
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


# Users whose last good password is remembered (see PasswordFile.recalled): ~200 bytes each.
MAX_RECALLED = 1_000_000


class PasswordFileError(ConfigError):
    """A password file that cannot be read or has a bad line; one line naming file:line."""


try:
    import argon2 as _argon2  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # optional: scrypt is always there
    _argon2 = None


@dataclass(frozen=True, slots=True)
class ScryptHash:
    log2_n: int
    r: int
    p: int
    salt: bytes
    digest: bytes

    @property
    def memory(self) -> int:
        # What OpenSSL's scrypt allocates (its maxmem check), plus slack.
        return 128 * self.r * ((1 << self.log2_n) + self.p + 2) + 65_536

    def matches(self, password: bytes) -> bool:
        derived = hashlib.scrypt(
            password,
            salt=self.salt,
            n=1 << self.log2_n,
            r=self.r,
            p=self.p,
            maxmem=self.memory,
            dklen=len(self.digest),
        )
        return hmac.compare_digest(derived, self.digest)

    def encode(self) -> str:
        return (
            f"$scrypt$ln={self.log2_n},r={self.r},p={self.p}"
            f"${b64encode(self.salt)}${b64encode(self.digest)}"
        )


@dataclass(frozen=True, slots=True)
class Argon2Hash:
    encoded: str

    def matches(self, password: bytes) -> bool:
        assert _argon2 is not None
        try:
            return bool(_argon2.PasswordHasher().verify(self.encoded, password))
        except _argon2.exceptions.VerificationError:
            return False
        except _argon2.exceptions.InvalidHashError:
            return False


PasswordHash = ScryptHash | Argon2Hash


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").rstrip("=")


def b64decode(text: str) -> bytes:
    text = text.replace(".", "+")
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def hash_password(password: bytes, cost: int = DEFAULT_COST) -> str:
    """A new ``$scrypt$...`` hash of ``password`` with a random salt."""
    if not MIN_COST <= cost <= MAX_COST:
        raise ValueError(f"cost must be from {MIN_COST} to {MAX_COST}")
    salt = secrets.token_bytes(SALT_BYTES)
    blank = ScryptHash(cost, DEFAULT_R, DEFAULT_P, salt, b"\0" * HASH_BYTES)
    digest = hashlib.scrypt(
        password,
        salt=salt,
        n=1 << cost,
        r=DEFAULT_R,
        p=DEFAULT_P,
        maxmem=blank.memory,
        dklen=HASH_BYTES,
    )
    return ScryptHash(cost, DEFAULT_R, DEFAULT_P, salt, digest).encode()


def parse_hash(encoded: str) -> PasswordHash:
    """The hash of one line; ValueError says what is wrong with it."""
    if encoded.startswith("$argon2id$"):
        if _argon2 is None:
            raise ValueError("argon2id hashes need the argon2-cffi package")
        return Argon2Hash(encoded)
    match = SCRYPT_LINE.fullmatch(encoded)
    if match is None:
        raise ValueError("expected $scrypt$ln=N,r=R,p=P$SALT$HASH")
    log2_n, r, p = int(match["ln"]), int(match["r"]), int(match["p"])
    try:
        salt, digest = b64decode(match["salt"]), b64decode(match["hash"])
    except binascii.Error:
        raise ValueError("salt or hash is not valid base64") from None
    if not 1 <= log2_n <= 30 or not 1 <= r <= 64 or not 1 <= p <= 16:
        raise ValueError("scrypt parameters out of range (ln 1-30, r 1-64, p 1-16)")
    parsed = ScryptHash(log2_n, r, p, salt, digest)
    if 128 * r * (1 << log2_n) > MAX_SCRYPT_MEMORY:
        raise ValueError(f"scrypt parameters need more than {MAX_SCRYPT_MEMORY >> 20} MiB")
    if len(salt) < 8 or not 16 <= len(digest) <= 64:
        raise ValueError("salt shorter than 8 bytes or hash not 16-64 bytes")
    return parsed


def check_username(username: str) -> None:
    """ValueError unless ``username`` can be a line of the file."""
    if not username:
        raise ValueError("empty username")
    if ":" in username:
        raise ValueError("username contains ':'")
    if CONTROL_CHARS.search(username):
        raise ValueError("username contains a control character")
    if username.lstrip().startswith("#"):
        raise ValueError("username starts with '#' (read as a comment)")
    if len(username.encode("utf-8", "surrogatepass")) > MAX_USERNAME_BYTES:
        raise ValueError(f"username longer than {MAX_USERNAME_BYTES} bytes")


def is_entry(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def split_entry(line: str) -> tuple[str, str]:
    username, sep, encoded = line.rstrip("\r\n").partition(":")
    if not sep:
        raise ValueError("expected username:hash")
    check_username(username)
    return username, encoded.strip()


def read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as error:
        raise PasswordFileError(f"{path}: cannot read password file: {error.strerror}") from None
    except UnicodeDecodeError:
        raise PasswordFileError(f"{path}: password file is not UTF-8 text") from None


class PasswordFile:
    """Users and their parsed hashes, as read from one file."""

    def __init__(self, path: Path | str, users: dict[str, PasswordHash]) -> None:
        self.path = Path(path)
        self.users = users
        # Verifying against it costs what verifying a real user costs (the file's first scrypt
        # parameters), so an unknown username is not told apart from a wrong password by the
        # time the refusal takes.
        model = next((h for h in users.values() if isinstance(h, ScryptHash)), None)
        self.dummy = ScryptHash(
            model.log2_n if model else DEFAULT_COST,
            model.r if model else DEFAULT_R,
            model.p if model else DEFAULT_P,
            secrets.token_bytes(SALT_BYTES),
            bytes(HASH_BYTES),
        )
        # Passwords that passed the slow check, as digests keyed with a secret of this
        # process (never the password itself), for the life of this file's contents: a fleet
        # reconnecting at once after a network outage pays one scrypt per device, not one
        # per connect (at ~40 ms each, 10,000 devices would otherwise wait minutes). Wrong
        # passwords and unknown users always take the slow path.
        self.recall_key = secrets.token_bytes(32)
        self.recalled: dict[str, bytes] = {}

    def recall(self, username: str | None, password: bytes | None) -> bool:
        """True when ``password`` is one that passed ``verify`` for ``username`` already.
        Fast (one HMAC): call it on the event loop before queueing a slow check."""
        if username is None or password is None:
            return False
        remembered = self.recalled.get(username)
        return remembered is not None and hmac.compare_digest(
            remembered, self.recall_digest(password)
        )

    def recall_digest(self, password: bytes) -> bytes:
        return hmac.new(self.recall_key, password, hashlib.sha256).digest()

    @classmethod
    def load(cls, path: Path | str) -> PasswordFile:
        """Reads and parses ``path``; PasswordFileError names the file and line at fault."""
        path = Path(path)
        users: dict[str, PasswordHash] = {}
        for number, line in enumerate(read_text(path).splitlines(), start=1):
            if not is_entry(line):
                continue
            try:
                username, encoded = split_entry(line)
                if username in users:
                    raise ValueError(f"user {username!r} appears twice")
                users[username] = parse_hash(encoded)
            except ValueError as error:
                raise PasswordFileError(f"{path}:{number}: {error}") from None
        return cls(path, users)

    def verify(self, username: str | None, password: bytes | None) -> bool:
        """True when ``password`` is ``username``'s. Slow on purpose (one scrypt) whatever the
        outcome, so call it off the event loop."""
        known = self.users.get(username) if username is not None else None
        hashed = known if known is not None else self.dummy
        matched = hashed.matches(password if password is not None else b"")
        if not (matched and known is not None and password is not None):
            return False
        if len(self.recalled) < MAX_RECALLED or username in self.recalled:
            self.recalled[username] = self.recall_digest(password)  # type: ignore[index]
        return True


# --------------------------------------------------------------------------- editing (CLI)


def set_user(path: Path | str, username: str, password: bytes, cost: int = DEFAULT_COST) -> bool:
    """Adds ``username`` or changes their password, keeping every other line; True when the
    user is new. The file must exist (create it with ``create_file``)."""
    check_username(username)
    path = Path(path)
    lines = read_text(path).splitlines(keepends=True)
    entry = f"{username}:{hash_password(password, cost)}\n"
    added = True
    for index, line in enumerate(lines):
        if is_entry(line) and entry_name(line) == username:
            lines[index] = entry
            added = False
            break
    else:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        lines.append(entry)
    write_atomically(path, "".join(lines))
    return added


def delete_user(path: Path | str, username: str) -> bool:
    """Removes ``username``'s line; False when there is none."""
    path = Path(path)
    lines = read_text(path).splitlines(keepends=True)
    kept = [line for line in lines if not (is_entry(line) and entry_name(line) == username)]
    if len(kept) == len(lines):
        return False
    write_atomically(path, "".join(kept))
    return True


def entry_name(line: str) -> str:
    return line.rstrip("\r\n").partition(":")[0]


def create_file(path: Path | str) -> None:
    """An empty password file (mode 0600), unless one is already there."""
    path = Path(path)
    if not path.exists():
        write_atomically(path, "")


def write_atomically(path: Path, text: str) -> None:
    """Replaces ``path`` with ``text`` so a reader (or a crash) sees the old file or the new
    one, never a mix; the new file is 0600 (it holds hashes)."""
    directory = path.parent if str(path.parent) else Path(".")
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        # mkstemp already creates it 0600; kept explicit as the mode matters here.
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    sync_directory(directory)


def sync_directory(directory: Path) -> None:
    # Makes the rename itself durable.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
