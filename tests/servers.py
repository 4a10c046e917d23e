"""Throwaway servers for the team-mode and security tests: a PostgreSQL cluster in a temporary folder, an
S3-compatible store (moto) and an ``mlflow server`` that proxies an artifact store, each on a free loopback port
and torn down on exit.

Without PostgreSQL's binaries a test that needs them skips, or fails where ``EXPMAN_REQUIRE_SERVERS=1`` (CI sets
it after installing them). PostgreSQL refuses to run as root, so as root the cluster runs as Debian's ``postgres``
user."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NoReturn
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

import pytest

REQUIRE = "EXPMAN_REQUIRE_SERVERS"
# MLflow's telemetry thread, when it cannot reach its server (offline, as here), pops a variable from os.environ
# while requests iterates os.environ in another thread: a KeyError in a random request. The members and servers
# these tests start run without it (pytest's own process has it off: MLflow turns it off under pytest and in CI).
TELEMETRY_OFF = {"MLFLOW_DISABLE_TELEMETRY": "true"}


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test for a missing server binary; fail it where the environment requires the servers."""
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{reason} ({REQUIRE}=1)", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port that nothing listens on at 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _postgres_bin(name: str) -> str | None:
    """A PostgreSQL program: on PATH, else the newest major version under Debian's /usr/lib/postgresql."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: float(p.parents[1].name))
    return str(versions[-1]) if versions else None


def _run(command: list[str | Path], cwd: Path) -> None:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} exited {done.returncode}: {done.stderr.strip()[-2000:]}")


@contextmanager
def postgres() -> Iterator[str]:
    """A fresh PostgreSQL cluster on a free loopback port (trust auth, fsync off) with an empty database ``mlflow``
    owned by role ``expman``; yields its URI, ``postgresql+psycopg://expman@127.0.0.1:<port>/mlflow`` (psycopg 3,
    the driver the test extra installs)."""
    programs = {name: _postgres_bin(name) for name in ("initdb", "pg_ctl", "createdb")}
    if not all(programs.values()):
        unavailable("PostgreSQL is not installed (no initdb/pg_ctl/createdb; apt-get install postgresql)")
    folder = Path(tempfile.mkdtemp(prefix="expman-pg-"))
    run_as: list[str] = []
    if os.geteuid() == 0:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(folder)
            unavailable("running as root, and there is no postgres user to run PostgreSQL as")
        os.chown(folder, account.pw_uid, account.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", free_port()
    options = f"-h 127.0.0.1 -p {port} -k {folder} -c fsync=off"
    try:
        _run(
            [*run_as, programs["initdb"], "-D", data, "-U", "expman", "-A", "trust", "-E", "UTF8", "--no-sync"], folder
        )
        _run([*run_as, programs["pg_ctl"], "-D", data, "-l", folder / "log", "-w", "-o", options, "start"], folder)
        _run([*run_as, programs["createdb"], "-h", "127.0.0.1", "-p", port, "-U", "expman", "mlflow"], folder)
        yield f"postgresql+psycopg://expman@127.0.0.1:{port}/mlflow"
    finally:
        if (data / "postmaster.pid").exists():
            _run([*run_as, programs["pg_ctl"], "-D", data, "-m", "immediate", "-w", "stop"], folder)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _serving(command: list[str], url: str, log: Path, env: Mapping[str, str]) -> Iterator[str]:
    """Run ``command`` in its own session with output to ``log``; yield ``url`` once it answers, stop it after."""
    with log.open("wb") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urlopen(url, timeout=5):
                    break
            except HTTPError:  # it answers
                break
            except (URLError, OSError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{command[2]} did not come up: {log.read_text()[-3000:]}") from None
                time.sleep(0.25)
        yield url
    finally:
        stop_group(server)


@contextmanager
def s3_bucket(folder: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """An S3-compatible store (moto's server) on a free loopback port with one bucket; yields the artifact
    destination ``s3://drafters/mlflow`` and the variables an ``mlflow server`` needs to write there."""

    port = free_port()
    env = {
        "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "expman-test",
        "AWS_SECRET_ACCESS_KEY": "expman-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with _serving(command, f"http://127.0.0.1:{port}/", folder / "s3.log", os.environ):
        s3_client(env).create_bucket(Bucket="drafters")
        yield "s3://drafters/mlflow", env


@contextmanager
def mlflow_server(
    backend_uri: str, artifacts: str, folder: Path, env: Mapping[str, str] | None = None, workers: int = 2
) -> Iterator[str]:
    """``mlflow server`` on ``backend_uri`` that proxies the artifact store ``artifacts`` (clients see
    ``mlflow-artifacts:/`` URIs and need no credentials for it), bound to a free loopback port, its log in
    ``folder``; yields its URL once ``/health`` answers. The server gets none of the caller's ``MLFLOW_*`` or
    ``PYTEST_*`` variables, only ``env`` on top: it runs as a deployed one would."""
    port = free_port()
    server_env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PYTEST_"))}
    server_env |= {**TELEMETRY_OFF, **(env or {})}
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri]
    command += ["--artifacts-destination", artifacts, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    log = folder / f"mlflow-server-{port}.log"
    with _serving([*command, "--workers", str(workers)], f"{url}/health", log, server_env):
        yield url


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group of ``process`` (it leads its own session), SIGKILL to what is left after 30 s."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    with suppress(ProcessLookupError):
        while time.monotonic() < deadline:
            process.poll()  # reaps the server once it has exited; init reaps its workers
            os.killpg(process.pid, 0)  # raises once the whole group is gone
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def s3_client(env: dict[str, str]) -> Any:
    """A boto3 S3 client for the endpoint and keys an S3 store's environment names."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["MLFLOW_S3_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
