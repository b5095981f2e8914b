"""Test hosts on one machine: network namespaces joined by a veth pair, each with its own address and loopback,
and a Ray cluster over them (head on the first, a worker node on the second), so that what crosses between
machines in a real cluster crosses a network here too. Needs root (CAP_SYS_ADMIN) and iproute2; `unavailable()`
says why not where they are missing, for the tests to skip saying so."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

RAY_PORT = 6380
RAY = str(Path(sys.executable).with_name("ray"))


@dataclass
class Host:
    name: str  # the namespace
    address: str

    def command(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]


@dataclass
class Cluster:
    hosts: list[Host]
    env: dict = field(default_factory=dict)  # what a process needs to join the cluster (address, auth token)
    client_address: str = ""  # where the test process reaches host A (a link of its own, as a user's would)

    @property
    def head(self) -> Host:
        return self.hosts[0]

    def stop_node(self, host: Host) -> None:
        """The host is lost: every process in its namespace is killed (its Ray node, workers and actors). Not
        `ray stop`: the namespaces share one process table, and it would stop every Ray process on the machine."""
        kill_all(host)

    def start_node(self, host: Host, cpus: int) -> None:
        """The host (back) in the cluster as a worker node."""
        address = self.env["RAY_ADDRESS"]
        run(*host.command(RAY, "start", "--address", address, "--node-ip-address", host.address,
                          "--num-cpus", str(cpus), "--disable-usage-stats"), env=self.env)  # fmt: skip


def unavailable() -> str | None:
    """Why this machine cannot make test hosts, or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2; .ci/run installs it)"
    probe = f"fovea-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def kill_all(host: Host) -> None:
    pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def run(*argv: str, env: dict | None = None, timeout: float = 120) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")
    return done.stdout


@contextlib.contextmanager
def two_hosts(cpus: tuple[int, int] = (2, 2)):
    """Hosts A and B (namespaces with a link between them) and a Ray cluster with `cpus` CPUs on each."""
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.{77 + os.getpid() % 50}.{os.getpid() % 250}"
    hosts = [Host(f"fovea-a-{tag}", f"{subnet}.1"), Host(f"fovea-b-{tag}", f"{subnet}.2")]
    links = (f"fva{tag}", f"fvb{tag}")
    client_links, client_subnet = (f"fvc{tag}", f"fvd{tag}"), f"10.{127 + os.getpid() % 50}.{os.getpid() % 250}"
    env = {
        **os.environ,
        "RAY_ADDRESS": f"{hosts[0].address}:{RAY_PORT}",
        "RAY_AUTH_MODE": "token",  # Ray 2.5x wants a token between nodes
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    try:
        for host in hosts:
            run("ip", "netns", "add", host.name)
        run("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for host, link in zip(hosts, links):
            run("ip", "link", "set", link, "netns", host.name)
            run(*host.command("ip", "addr", "add", f"{host.address}/24", "dev", link))
            run(*host.command("ip", "link", "set", link, "up"))
            run(*host.command("ip", "link", "set", "lo", "up"))
        run("ip", "link", "add", client_links[0], "type", "veth", "peer", "name", client_links[1])
        run("ip", "link", "set", client_links[1], "netns", hosts[0].name)
        run("ip", "addr", "add", f"{client_subnet}.1/24", "dev", client_links[0])
        run("ip", "link", "set", client_links[0], "up")
        run(*hosts[0].command("ip", "addr", "add", f"{client_subnet}.2/24", "dev", client_links[1]))
        run(*hosts[0].command("ip", "link", "set", client_links[1], "up"))
        head, worker = hosts
        common = ["--disable-usage-stats", "--include-dashboard", "false"]
        run(*head.command(RAY, "start", "--head", "--node-ip-address", head.address, "--port", str(RAY_PORT),
                          "--num-cpus", str(cpus[0]), "--temp-dir", f"/tmp/ray-{tag}", *common), env=env)  # fmt: skip
        cluster = Cluster(hosts, env, f"{client_subnet}.2")
        cluster.start_node(worker, cpus[1])
        yield cluster
    finally:
        for host in reversed(hosts):
            kill_all(host)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        subprocess.run(["ip", "link", "del", client_links[0]], capture_output=True)  # gone with A's end, if made
