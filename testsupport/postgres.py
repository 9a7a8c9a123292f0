"""A real PostgreSQL server from the installed binaries, for the job-store tests and benchmarks.

``PostgresServer.start()`` runs ``initdb`` in a temporary directory, starts ``postgres`` on a
free loopback port with its socket in that directory, and ``stop()`` shuts it down
(``start()`` again brings the same cluster back: the outage tests use that). PostgreSQL
refuses to run as root, so as root every server command runs as the ``postgres`` user
(``runuser``) and the directory is given to it; as a normal user they run as that user.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

PG_BIN_DIRS = ("/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/17/bin")
SUPERUSER = "streamvox"


def find_pg_bin() -> Path | None:
    for directory in (os.environ.get("STREAMVOX_PG_BIN"), *PG_BIN_DIRS):
        if directory and (Path(directory) / "initdb").exists():
            return Path(directory)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresServer:
    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.as_root = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="streamvox-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        if self.as_root:  # the server's files must belong to the user it runs as
            os.chmod(self.root, 0o755)
            shutil.chown(self.root, "postgres", "postgres")

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=120)

    def init(self, password: str | None = None) -> None:
        """``password``: the superuser's, and every connection must give it (scram-sha-256);
        None: trust (no password)."""
        auth = ["-A", "trust"]
        if password is not None:
            pwfile = self.root / "pwfile"
            pwfile.write_text(password + "\n")
            if self.as_root:
                shutil.chown(pwfile, "postgres", "postgres")
            auth = ["-A", "scram-sha-256", "--pwfile", str(pwfile)]
        self._run("initdb", "-D", str(self.data), *auth, "-U", SUPERUSER, "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        # -l: the server's output goes to a file, so pg_ctl returns instead of holding our pipes.
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        result = self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "-t", "60",
                           "start", check=False)
        if result.returncode != 0:
            raise RuntimeError(f"postgres did not start: {result.stderr}\n{self.log_text()}")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop", check=False)

    def log_text(self) -> str:
        try:
            return self.log.read_text()[-4000:]
        except OSError:
            return ""

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh database (one per test): returns its URL."""
        name = "t_" + uuid.uuid4().hex[:12]
        self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, "-d", "postgres", "-q",
                  "-c", f"CREATE DATABASE {name}")
        return self.url(name)

    def cleanup(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres(password: str | None = None) -> PostgresServer:
    bin_dir = find_pg_bin()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL binaries not found (set STREAMVOX_PG_BIN); scripts/dev-setup.sh installs them")
    server = PostgresServer(bin_dir)
    try:
        server.init(password)
        server.start()
    except BaseException:
        shutil.rmtree(server.root, ignore_errors=True)
        raise
    return server
