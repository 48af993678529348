"""The password file (fastbroker.auth.passwords) and the `fastbroker passwd` command."""

from __future__ import annotations

import os
import pty
import select
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastbroker.auth import passwords
from fastbroker.auth.passwords import PasswordFile, PasswordFileError, hash_password, set_user
from fastbroker.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
# Cheap hashes keep the suite fast; the format and the code path are the same.
FAST = 8

pytestmark = pytest.mark.timeout(60)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_hash_has_the_documented_format_and_verifies(tmp_path):
    encoded = hash_password(b"s3cret", cost=FAST)
    ln_r_p, salt, digest = encoded.removeprefix("$scrypt$").split("$")
    assert ln_r_p == f"ln={FAST},r=8,p=1"
    assert len(passwords.b64decode(salt)) == 16
    assert len(passwords.b64decode(digest)) == 32
    # Salted: the same password never hashes the same twice.
    assert hash_password(b"s3cret", cost=FAST) != encoded

    users = PasswordFile.load(write(tmp_path / "pw", f"alice:{encoded}\n"))
    assert users.verify("alice", b"s3cret")
    assert not users.verify("alice", b"s3cret ")
    assert not users.verify("alice", b"")
    assert not users.verify("alice", None)
    assert not users.verify("bob", b"s3cret")
    assert not users.verify(None, b"s3cret")


def test_comments_blank_lines_and_binary_passwords(tmp_path):
    text = (
        "# users of the test bench\n"
        "\n"
        f"alice:{hash_password(b'a', cost=FAST)}\n"
        "   # indented comment\n"
        f"b\u00f6b smith:{hash_password(bytes(range(256)), cost=FAST)}\r\n"
    )
    users = PasswordFile.load(write(tmp_path / "pw", text))
    assert sorted(users.users) == ["alice", "b\u00f6b smith"]
    assert users.verify("b\u00f6b smith", bytes(range(256)))
    assert users.verify("alice", b"a")


def test_passlib_style_base64_is_accepted(tmp_path):
    # passlib writes scrypt hashes in "adapted base64" ('.' for '+'); same numbers otherwise.
    encoded = hash_password(b"pw", cost=FAST)
    prefix, salt, digest = encoded.rsplit("$", 2)
    adapted = f"{prefix}${salt.replace('+', '.')}${digest.replace('+', '.')}"
    users = PasswordFile.load(write(tmp_path / "pw", f"u:{adapted}\n"))
    assert users.verify("u", b"pw")


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("alice", "expected username:hash"),
        ("alice:plain-text-password", "expected $scrypt$"),
        (":$scrypt$ln=8,r=8,p=1$c2FsdHNhbHQ$" + "A" * 43, "empty username"),
        ("al\x01ice:$scrypt$ln=8,r=8,p=1$c2FsdHNhbHQ$" + "A" * 43, "control character"),
        ("alice:$scrypt$ln=8,r=8,p=1$c2FsdHNhbHQ$!!!", "expected $scrypt$"),
        ("alice:$scrypt$ln=8,r=8,p=1$c2FsdHNhbHQ$AAAAA", "not valid base64"),
        ("alice:$scrypt$ln=25,r=8,p=1$c2FsdHNhbHQ$" + "A" * 43, "more than 256 MiB"),
        ("alice:$scrypt$ln=8,r=8,p=1$c2FsdA$" + "A" * 43, "salt shorter"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, why):
    path = write(tmp_path / "pw", f"# header\nok:{hash_password(b'x', cost=FAST)}\n{line}\n")
    with pytest.raises(PasswordFileError) as raised:
        PasswordFile.load(path)
    message = str(raised.value)
    assert message.startswith(f"{path}:3: ")
    assert why in message
    assert "\n" not in message
    # A ConfigError: the broker reports it in one line and exits 2.
    assert isinstance(raised.value, ConfigError)


def test_duplicate_user_and_unreadable_file(tmp_path):
    entry = f"alice:{hash_password(b'x', cost=FAST)}\n"
    path = write(tmp_path / "pw", entry + entry)
    with pytest.raises(PasswordFileError, match=r":2: user 'alice' appears twice"):
        PasswordFile.load(path)
    with pytest.raises(PasswordFileError, match="cannot read password file"):
        PasswordFile.load(tmp_path / "missing")
    (tmp_path / "latin1").write_bytes(b"j\xe9r\xf4me:x\n")
    with pytest.raises(PasswordFileError, match="not UTF-8"):
        PasswordFile.load(tmp_path / "latin1")


@pytest.mark.skipif(passwords._argon2 is not None, reason="argon2-cffi is installed")
def test_argon2_line_without_the_package_is_a_clear_error(tmp_path):
    line = "alice:$argon2id$v=19$m=65536,t=3,p=4$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA\n"
    with pytest.raises(PasswordFileError, match=r":1: argon2id hashes need the argon2-cffi"):
        PasswordFile.load(write(tmp_path / "pw", line))


@pytest.mark.skipif(passwords._argon2 is None, reason="argon2-cffi is not installed")
def test_argon2_line_verifies_with_the_package(tmp_path):
    encoded = passwords._argon2.PasswordHasher().hash(b"pw")
    users = PasswordFile.load(write(tmp_path / "pw", f"alice:{encoded}\n"))
    assert users.verify("alice", b"pw")
    assert not users.verify("alice", b"other")


def median_time(call, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)[runs // 2]


def test_unknown_user_costs_as_much_as_a_wrong_password(tmp_path):
    # The dummy hash takes the file's own parameters: with a cost far from the default, an
    # unknown user would otherwise answer much faster or slower than a known one.
    cost = 12
    users = PasswordFile.load(write(tmp_path / "pw", f"alice:{hash_password(b'x', cost)}\n"))
    known, unknown = [], []
    for _ in range(9):  # interleaved, so both see the same machine load
        known.append(median_time(lambda: users.verify("alice", b"wrong"), runs=1))
        unknown.append(median_time(lambda: users.verify("nobody", b"wrong"), runs=1))
    ratio = sorted(unknown)[4] / sorted(known)[4]
    # Without the dummy an unknown user answers at once; with the default cost, 8x slower.
    assert 1 / 3 < ratio < 3, (known, unknown)


def test_default_cost_takes_tens_of_milliseconds():
    # Slow enough to make guessing expensive, fast enough for connect bursts.
    hashed = passwords.parse_hash(hash_password(b"x"))
    assert isinstance(hashed, passwords.ScryptHash)
    assert hashed.log2_n == passwords.DEFAULT_COST
    elapsed = median_time(lambda: hashed.matches(b"x"), runs=3)
    assert 0.005 < elapsed < 2.0, elapsed


# --------------------------------------------------------------------------- passwd command


def passwd(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", "fastbroker", "passwd", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )


def test_passwd_create_add_change_delete(tmp_path):
    path = tmp_path / "passwords"
    done = passwd("-c", "--cost", str(FAST), "--password-stdin", str(path), "alice", stdin="a1\n")
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert PasswordFile.load(path).verify("alice", b"a1")

    # Without -c the file must exist.
    missing = passwd("--password-stdin", str(tmp_path / "nope"), "bob", stdin="b\n")
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr

    # Comments and other users survive every rewrite, in place.
    path.write_text("# managed by hand\n" + path.read_text() + "# trailing note")
    added = passwd("--cost", str(FAST), "--password-stdin", str(path), "bob", stdin="b1\n")
    assert added.returncode == 0, added.stderr
    inode = path.stat().st_ino
    changed = passwd("--cost", str(FAST), "--password-stdin", str(path), "alice", stdin="a2\r\n")
    assert changed.returncode == 0, changed.stderr
    # Replaced by rename (atomic), not rewritten in place.
    assert path.stat().st_ino != inode
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = path.read_text().splitlines()
    assert lines[0] == "# managed by hand"
    assert lines[1].startswith("alice:$scrypt$")
    assert lines[2] == "# trailing note"
    assert lines[3].startswith("bob:$scrypt$")
    users = PasswordFile.load(path)
    assert users.verify("alice", b"a2") and not users.verify("alice", b"a1")
    assert users.verify("bob", b"b1")
    # No temporary file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passwords"]

    deleted = passwd("-D", str(path), "bob")
    assert deleted.returncode == 0, deleted.stderr
    assert sorted(PasswordFile.load(path).users) == ["alice"]
    assert "# trailing note" in path.read_text()

    again = passwd("-D", str(path), "bob")
    assert again.returncode == 1
    assert "no user 'bob'" in again.stderr


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["--password-stdin", "{path}", "a:b"], "x\n", "contains ':'"),
        (["--password-stdin", "{path}", "#admin"], "x\n", "starts with '#'"),
        (["--password-stdin", "{path}", "alice"], "\n", "empty password"),
        (["-D", "-c", "{path}", "alice"], "", "-D takes no"),
        (["--cost", "40", "--password-stdin", "{path}", "alice"], "x\n", "40"),
    ],
)
def test_passwd_usage_errors_exit_2(tmp_path, args, stdin, message):
    path = tmp_path / "pw"
    path.write_text("")
    done = passwd(*[a.format(path=path) for a in args], stdin=stdin)
    assert done.returncode == 2, done
    assert message in done.stderr
    assert path.read_text() == ""


def test_passwd_unreadable_file_exits_2(tmp_path):
    path = tmp_path / "pw"
    path.write_bytes(b"\xff\xfe not text\n")
    done = passwd("--password-stdin", str(path), "alice", stdin="x\n")
    assert done.returncode == 2
    assert "not UTF-8" in done.stderr


def run_in_terminal(args: list[str], answers: list[str], timeout: float = 30) -> tuple[int, str]:
    """Runs the command on a pseudo-terminal (getpass reads /dev/tty), answering each prompt."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    pid, fd = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty
        os.execve(sys.executable, [sys.executable, "-m", "fastbroker", *args], env)
    output = b""
    answered = 0
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
            # Answered only once asked: getpass flushes what was typed ahead (TCSAFLUSH).
            if answered < len(answers) and output.endswith(b": "):
                os.write(fd, answers[answered].encode() + b"\n")
                answered += 1
        else:
            raise AssertionError(f"no exit within {timeout} s: {output!r}")
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status), output.decode(errors="replace")
    finally:
        os.close(fd)
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def test_passwd_prompts_twice(tmp_path):
    path = tmp_path / "pw"
    code, output = run_in_terminal(
        ["passwd", "-c", "--cost", str(FAST), str(path), "carol"], ["c4rol", "c4rol"]
    )
    assert code == 0, output
    assert "Password again" in output
    assert "c4rol" not in output  # not echoed
    assert PasswordFile.load(path).verify("carol", b"c4rol")

    code, output = run_in_terminal(
        ["passwd", "--cost", str(FAST), str(path), "carol"], ["one", "two"]
    )
    assert code == 2, output
    assert "do not match" in output
    assert PasswordFile.load(path).verify("carol", b"c4rol")


def test_a_password_that_passed_is_recalled_without_scrypt_until_reload(tmp_path):
    path = write(tmp_path / "pw", f"alice:{hash_password(b'secret', 12)}\n")
    users = PasswordFile.load(path)
    assert not users.recall("alice", b"secret")  # never checked yet
    assert users.verify("alice", b"secret")
    assert users.recall("alice", b"secret")
    # Only that password, only that user; the digest is keyed, not the password.
    assert not users.recall("alice", b"Secret")
    assert not users.recall("bob", b"secret")
    assert not users.recall("alice", None) and not users.recall(None, b"secret")
    assert b"secret" not in users.recalled["alice"]
    assert not users.verify("alice", b"wrong")
    assert users.recall("alice", b"secret")  # a wrong try does not evict the good one
    # Recalling is an HMAC, not a scrypt: orders of magnitude faster.
    slow = median_time(lambda: users.verify("alice", b"secret"), runs=3)
    fast = median_time(lambda: users.recall("alice", b"secret"), runs=3)
    assert fast * 50 < slow, (fast, slow)
    # A reload (a new PasswordFile) starts with nothing recalled: a changed password counts.
    set_user(path, "alice", b"new", cost=12)
    reloaded = PasswordFile.load(path)
    assert not reloaded.recall("alice", b"secret")
    assert not reloaded.verify("alice", b"secret")
