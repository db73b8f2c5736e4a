"""A Redis Cluster of the test's own: 3 primaries and 3 replicas on free loopback ports.

Used by the applications' checks (apps/replay/check_replay.py): `with redis_cluster() as
cluster:` gives a Cluster once `redis-cli --cluster create` joined the nodes and every node
says cluster_state:ok, and kills every node and removes the directory however the block
ends. Each node runs in its own folder of one temporary directory, with no persistence.
A missing redis-server or redis-cli, or a cluster that does not form, is a RuntimeError
naming what to install or what happened, never a skipped test.
"""

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def _bindable(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_ports(n):
    """Ports whose cluster bus port (port + 10000) is free too."""
    ports = []
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    while len(ports) < n:
        p = rng.randrange(20000, 45000)
        if all(abs(p - q) not in (0, 10000) for q in ports) and _bindable(p) and _bindable(p + 10000):
            ports.append(p)
    return ports


class Cluster:
    def __init__(self, cli, nodes, primary_count):
        self.cli = cli
        self.nodes = nodes  # [(port, Popen, dir)]
        self.primary_count = primary_count

    def seeds(self):
        """Every node's address, comma-separated."""
        return ",".join(f"127.0.0.1:{port}" for port, _, _ in self.nodes)

    def command(self, port, *args):
        """One redis-cli command on the node at `port`; its output ("" if it failed)."""
        proc = subprocess.run([self.cli, "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True, text=True,
                              timeout=30)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def alive(self):
        return [(port, proc) for port, proc, _ in self.nodes if proc.poll() is None]

    def primaries(self):
        """Ports of the live nodes whose ROLE is master."""
        return [port for port, _ in self.alive() if self.command(port, "ROLE").splitlines()[:1] == ["master"]]

    def keys_held(self):
        """Keys in all the live primaries."""
        return sum(int(self.command(port, "DBSIZE") or 0) for port in self.primaries())

    def kill(self, port):
        """SIGKILL the node at `port`."""
        for p, proc, _ in self.nodes:
            if p == port:
                proc.send_signal(signal.SIGKILL)
                proc.wait()

    def converged(self):
        """Every live node says cluster_state:ok, as many live nodes are primaries as the
        cluster was made with (after a kill: the replica was promoted), and every live
        replica's link to its primary is up (a replica still in its handshake could not be
        promoted)."""
        for port, _ in self.alive():
            if "cluster_state:ok" not in self.command(port, "CLUSTER", "INFO"):
                return False
            role = self.command(port, "ROLE").splitlines()
            if role[:1] == ["slave"] and role[3:4] != ["connected"]:
                return False
        return len(self.primaries()) == self.primary_count

    def wait_converged(self, what, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while not self.converged():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.1)


@contextlib.contextmanager
def redis_cluster(primaries=3, replicas=1, node_timeout_ms=1000):
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise RuntimeError("redis-server and redis-cli are missing. Run, as root: apt-get install -y redis-server redis-tools")
    with tempfile.TemporaryDirectory() as tmp:
        nodes = []
        try:
            for port in _free_ports(primaries * (1 + replicas)):
                d = os.path.join(tmp, str(port))
                os.mkdir(d)
                proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                                         "--cluster-config-file", os.path.join(d, "nodes.conf"),
                                         "--cluster-node-timeout", str(node_timeout_ms), "--save", "", "--appendonly", "no",
                                         "--dir", d, "--logfile", os.path.join(d, "redis.log")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                nodes.append((port, proc, d))
            cluster = Cluster(cli, nodes, primaries)
            for port, proc, _ in nodes:
                deadline = time.monotonic() + 10
                while cluster.command(port, "PING") != "PONG":
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on port {port} did not start")
                    time.sleep(0.05)
            create = subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p, _, _ in nodes],
                                     "--cluster-replicas", str(replicas), "--cluster-yes"],
                                    capture_output=True, text=True, timeout=120)
            if create.returncode != 0:
                raise RuntimeError("redis-cli --cluster create failed:\n" + create.stdout + create.stderr)
            cluster.wait_converged("the new cluster")
            yield cluster
        finally:
            for _, proc, _ in nodes:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                    proc.wait()
