"""The `fastbroker` command."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import click

from fastbroker import __version__
from fastbroker.cluster.transport import parse_address
from fastbroker.config import LOG_LEVELS, ConfigError, load_config

EXIT_STARTUP_ERROR = 1
EXIT_CONFIG_ERROR = 2


def fail(message: str, exit_code: int) -> NoReturn:
    click.echo(f"fastbroker: {message}", err=True)
    raise SystemExit(exit_code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="fastbroker")
def main() -> None:
    """fastbroker: a performance-first MQTT broker."""


@main.command()
@click.option(
    "--workers",
    metavar="N|auto",
    help="Processes serving this node; auto: one per usable core (overrides [node] workers).",
)
@click.option("--host", help="Address to listen on (overrides [listener] host).")
@click.option("--port", type=click.IntRange(0, 65535), help="TCP port (overrides [listener] port).")
@click.option(
    "--config",
    "config_path",
    # Not exists=True: a missing file gets the same one-line error as any other bad config.
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML config file (see fastbroker.example.toml).",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    help="Log level (overrides [log] level).",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Data directory, created if missing (overrides [storage] data_dir).",
)
@click.option("--node-id", help="This node's id in a cluster (overrides [cluster] node_id).")
@click.option(
    "--cluster-listen",
    metavar="HOST:PORT",
    help="Address for links from other nodes (overrides [cluster] listen).",
)
@click.option(
    "--advertise",
    metavar="HOST:PORT",
    help="Address other nodes dial (overrides [cluster] advertise; default: --cluster-listen).",
)
@click.option(
    "--join",
    metavar="HOST:PORT[,HOST:PORT...]",
    help="Static seed nodes (overrides [cluster] join).",
)
@click.option(
    "--discovery",
    metavar="SPEC",
    help="multicast[:GROUP:PORT], file:PATH, dns:NAME or python:MODULE:FACTORY "
    "(overrides [cluster] discovery).",
)
@click.option(
    "--admin",
    "admin_listen",
    metavar="HOST:PORT",
    help="Admin HTTP endpoint (overrides [admin] host and port, and turns it on).",
)
def run(
    workers: str | None,
    host: str | None,
    port: int | None,
    config_path: Path | None,
    log_level: str | None,
    data_dir: Path | None,
    node_id: str | None,
    cluster_listen: str | None,
    advertise: str | None,
    join: str | None,
    discovery: str | None,
    admin_listen: str | None,
) -> None:
    """Run the broker until SIGTERM or SIGINT."""
    admin_host = admin_port = None
    if admin_listen is not None:
        try:
            admin_host, admin_port = parse_address(admin_listen, allow_any_port=True)
        except ValueError as error:
            fail(f"--admin: {error}", EXIT_CONFIG_ERROR)
    overrides: dict[str, dict[str, Any]] = {
        "listener": {"host": host, "port": port},
        "log": {"level": log_level},
        "node": {"workers": workers},
        "storage": {"data_dir": str(data_dir) if data_dir is not None else None},
        "cluster": {
            "node_id": node_id,
            "listen": cluster_listen,
            "advertise": advertise,
            "join": join,
            "discovery": discovery,
        },
        "admin": {
            "host": admin_host,
            "port": admin_port,
            "enabled": True if admin_listen is not None else None,
        },
    }
    try:
        config = load_config(config_path, overrides)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG_ERROR)

    if config.node.workers != 1:
        from fastbroker.workers import run_workers, worker_count

        if worker_count(config) > 1:
            try:
                code = run_workers(config, run_broker)
            except ConfigError as error:
                fail(str(error), EXIT_CONFIG_ERROR)
            raise SystemExit(code)
    raise SystemExit(run_broker(config))


def run_broker(config: Any, worker: Any = None) -> int:
    """Runs one broker process (the only one, or a worker); its exit code."""
    try:
        # Imported here so that config errors and --help work without loading the engine.
        from fastbroker import server
    except ImportError as error:
        fail(f"cannot load the broker: {error}", EXIT_STARTUP_ERROR)

    try:
        server.run(config, worker)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG_ERROR)
    except server.StartupError as error:
        fail(str(error), EXIT_STARTUP_ERROR)
    except KeyboardInterrupt:
        # SIGINT before the signal handlers are installed: nothing to clean up yet.
        pass
    return 0


DEFAULT_ADMIN = "127.0.0.1:18830"


@main.group()
def cluster() -> None:
    """Inspect and change the cluster (through a node's admin endpoint, or its stopped
    data directory for `recover`)."""


def admin_request(admin: str, method: str, path: str, timeout: float, body: Any = None) -> Any:
    import json
    import urllib.error
    import urllib.request

    try:
        host, port = parse_address(admin)
    except ValueError as error:
        fail(f"--admin: {error}", EXIT_CONFIG_ERROR)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}{path}"
    request = urllib.request.Request(
        url,
        method=method,
        data=(json.dumps(body).encode() if body is not None else b"") if method == "POST" else None,
        # The admin endpoint's guard against POSTs from web pages (fastbroker.admin).
        headers={"X-Fastbroker-Admin": "1"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data = json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            data = json.loads(error.read())
        except ValueError:
            fail(f"{url}: HTTP {error.code}", EXIT_STARTUP_ERROR)
        if not isinstance(data, dict) or "error" in data:
            detail = data.get("error") if isinstance(data, dict) else data
            fail(f"{url}: HTTP {error.code}: {detail}", EXIT_STARTUP_ERROR)
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        fail(f"cannot reach the admin endpoint {url}: {reason}", EXIT_STARTUP_ERROR)
    if not isinstance(data, dict):
        fail(f"{url}: unexpected answer {data!r:.200}", EXIT_STARTUP_ERROR)
    return data


def ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5': partition lists stay readable."""
    parts: list[str] = []
    start = prev = None
    for n in numbers:
        if prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
        start = prev = n
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts) or "-"


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@cluster.command()
@click.option("--admin", default=DEFAULT_ADMIN, show_default=True, metavar="HOST:PORT")
@click.option("--json", "as_json", is_flag=True, help="Print the endpoint's JSON as is.")
@click.option("--partitions", is_flag=True, help="List the partitions each member holds.")
def status(admin: str, as_json: bool, partitions: bool) -> None:
    """Members, their state, the partitions they hold and the map version."""
    import json

    data = admin_request(admin, "GET", "/cluster/status", 5.0)
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    if data.get("standalone"):
        click.echo("standalone broker (no [cluster] node_id)")
        return
    raft = data.get("raft", {})
    if data.get("cluster_id") is None:
        click.echo(f"node {data['node_id']}: not in a cluster yet (discovering, joining)")
        return
    click.echo(
        f"cluster {data['cluster_name']} ({data['cluster_id']}): map version "
        f"{data['map_version']}, {data['partitions']} partitions, replication factor "
        f"{data['replication_factor']}"
    )
    pending = ", a membership change is in progress" if data.get("pending_change") else ""
    click.echo(
        f"asked node {data['node_id']}: {raft.get('role')}, term {raft.get('term')}, "
        f"leader {data.get('leader') or 'unknown'}{pending}"
    )
    split = data.get("partial_split")
    if split:
        click.echo(
            f"partial split: cut off from {split['cut_off_from']}, which "
            f"{split['heard_through']} still hears; this node's data links are closed"
        )
    elif data.get("data_links_cut"):
        cut = ", ".join(data["data_links_cut"])
        click.echo(f"partial split: cut off from {cut}; the data link to it is closed")
    rows = [
        (
            "NODE",
            "ADDRESS",
            "STATE",
            "ROLE",
            "CLIENTS",
            "SESSIONS",
            "COPIES",
            "STREAMING",
            "PRIMARY",
            "FOLLOWER",
        )
    ]
    for m in data["members"]:
        clients, sessions, copies = m.get("clients"), m.get("sessions"), m.get("copies")
        streaming = m.get("streaming")
        rows.append(
            (
                m["node_id"],
                m["address"],
                m["state"],
                "leader" if m["leader"] else "follower",
                "?" if clients is None else str(clients),
                "?" if sessions is None else str(sessions),
                "?" if copies is None else str(copies),
                "?" if streaming is None else str(streaming),
                str(len(m["primary"])),
                str(len(m["follower"])),
            )
        )
    print_table(rows)
    plane = data.get("data_plane") or {}
    if plane:
        click.echo(f"links of node {data['node_id']} (data plane):")
        table = [
            ("  PEER", "LINK", "FRAMES OUT/IN", "MSGS OUT/IN", "BYTES OUT/IN", "QUEUED", "ROWS")
        ]
        for peer, p in sorted(plane.items()):
            table.append(
                (
                    "  " + peer,
                    "up" if p["up"] else "down",
                    f"{p['frames_out']}/{p['frames_in']}",
                    f"{p['messages_out']}/{p['messages_in']}",
                    f"{p['bytes_out']}/{p['bytes_in']}",
                    str(p["unacked_bytes"]),
                    str(p["route_rows"]),
                )
            )
        print_table(table)
    if partitions:
        for m in data["members"]:
            click.echo(f"{m['node_id']}: primary {ranges(m['primary'])}")
            click.echo(f"{' ' * len(m['node_id'])}  follower {ranges(m['follower'])}")


@cluster.command()
@click.option("--admin", default=DEFAULT_ADMIN, show_default=True, metavar="HOST:PORT")
def leave(admin: str) -> None:
    """Remove the node behind --admin from the cluster, then stop it (its sessions go to
    their owners). Refused while another member is out of reach."""
    data = admin_request(admin, "POST", "/cluster/leave", 15.0)
    if not data.get("left"):
        fail(f"the node did not leave: {data.get('reason', 'no majority agreed in time')}", 1)
    click.echo("left the cluster; the node is stopping")


@cluster.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The node's TOML config file (for its [storage] data_dir).",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="The node's data directory (overrides [storage] data_dir).",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def recover(config_path: Path | None, data_dir: Path | None, yes: bool) -> None:
    """Make a stopped node that lost the majority for good the only member of a new cluster.

    Only when the other members are gone for good (docs/operations.md): they may come
    back only with an empty data directory, joining the new cluster.
    """
    overrides = {"storage": {"data_dir": str(data_dir) if data_dir is not None else None}}
    try:
        config = load_config(config_path, overrides)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG_ERROR)
    from fastbroker.cluster.recover import RecoverError
    from fastbroker.cluster.recover import recover as recover_node

    directory = Path(config.storage.data_dir)
    if not yes:
        click.confirm(
            f"{directory}: form a new cluster with this node alone? The other members must "
            "never come back with their data",
            abort=True,
        )
    try:
        done = recover_node(directory)
    except RecoverError as error:
        fail(str(error), EXIT_STARTUP_ERROR)
    except OSError as error:
        fail(f"{directory}: {error.strerror or error}", EXIT_STARTUP_ERROR)
    click.echo(
        f"node {done.node_id} is now the only member of cluster {done.new_cluster_id} "
        f"(was {done.old_cluster_id}; removed {', '.join(done.removed) or 'none'}); map "
        f"version {done.map_version}; {done.records_dropped} records kept for removed "
        "members dropped. Start it, then join new nodes with empty data directories."
    )


@main.group()
def clients() -> None:
    """Act on clients through a node's admin endpoint."""


@clients.command()
@click.argument("client_id")
@click.option("--admin", default=DEFAULT_ADMIN, show_default=True, metavar="HOST:PORT")
def kick(client_id: str, admin: str) -> None:
    """End CLIENT_ID's connection and session on every node of the cluster."""
    data = admin_request(admin, "POST", "/clients/kick", 5.0, {"client_id": client_id})
    where = "this node held its session" if data.get("held_here") else "not held on this node"
    click.echo(f"kicked {client_id} on every reachable node ({where})")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("username")
@click.option("-c", "--create", is_flag=True, help="Create FILE if it does not exist.")
@click.option("-D", "--delete", is_flag=True, help="Remove USERNAME from FILE.")
@click.option(
    "--password-stdin", is_flag=True, help="Read the password from one line of stdin (scripts)."
)
@click.option(
    "--cost",
    type=click.IntRange(4, 18),
    default=None,
    help="log2 of scrypt's N (default 14: 16 MiB, ~50 ms per check; +1 doubles both).",
)
def passwd(
    file: Path,
    username: str,
    create: bool,
    delete: bool,
    password_stdin: bool,
    cost: int | None,
) -> None:
    """Add a user to a password file, change their password, or remove them (-D).

    Exit codes: 0 done, 1 no such user (-D), 2 usage or file error.
    """
    import getpass
    import sys

    from fastbroker.auth import passwords

    if delete and (create or password_stdin or cost is not None):
        fail("-D takes no password options and no -c", EXIT_CONFIG_ERROR)
    try:
        passwords.check_username(username)
    except ValueError as error:
        fail(f"bad username: {error}", EXIT_CONFIG_ERROR)
    try:
        if create:
            passwords.create_file(file)
        elif not file.exists():
            fail(f"{file} does not exist (-c creates it)", EXIT_CONFIG_ERROR)
        if delete:
            if not passwords.delete_user(file, username):
                fail(f"no user {username!r} in {file}", EXIT_STARTUP_ERROR)
            return
        if password_stdin:
            password = sys.stdin.readline().rstrip("\r\n")
        else:
            password = getpass.getpass("Password: ")
            if getpass.getpass("Password again: ") != password:
                fail("the passwords do not match", EXIT_CONFIG_ERROR)
        if not password:
            fail("empty password", EXIT_CONFIG_ERROR)
        encoded = password.encode("utf-8")
        added = passwords.set_user(file, username, encoded, cost or passwords.DEFAULT_COST)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG_ERROR)
    except OSError as error:
        fail(f"{file}: {error.strerror or error}", EXIT_CONFIG_ERROR)
    click.echo(f"{'added' if added else 'changed the password of'} {username}", err=True)
