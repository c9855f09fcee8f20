"""A Redis Cluster spread over the fabric's nodes: one master and one replica on each
Redis node, every replica on another node than its master (so a node's loss never
takes a shard's both copies), built with redis-cli from the host, and a master's
failover: its process SIGKILLed, its replica promoted by the cluster itself, then the
process started again (it rejoins as the new master's replica).

    cluster = start_cluster([r1, r2, r3], folder, logs)   # cluster.url: REDIS_URL
    victim = cluster.kill_master("{tenant}")               # SIGKILL
    cluster.promoted("{tenant}", victim)                   # waits for the replica's turn
    cluster.restart(victim.address)                        # back, as a replica
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.cluster import key_slot

from sluice.localinfra import redis_binary
from tests.cluster.netns import Node
from tests.cluster.services import Logs, wait_until

MASTER_PORT, REPLICA_PORT = 7000, 7001  # on every Redis node; bus ports + 10000
NODE_TIMEOUT_MS = 2000  # a master silent this long is failed over (a loaded machine)


@dataclass
class Instance:
    node: Node
    port: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.node.address}:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(self.node.address, self.port, socket_timeout=2,
                           socket_connect_timeout=2)


@dataclass
class RedisCluster:
    instances: list[Instance]
    logs: Logs
    binary: str

    @property
    def url(self) -> str:
        """The platform's REDIS_URL: every instance a seed."""
        return "redis+cluster://" + ",".join(i.address for i in self.instances) + "/"

    def start(self, instance: Instance) -> None:
        instance.folder.mkdir(exist_ok=True)
        instance.proc = instance.node.spawn(
            [self.binary, "--bind", instance.node.address, "--port", str(instance.port),
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             "--cluster-announce-ip", instance.node.address, "--protected-mode", "no",
             "--save", "", "--appendonly", "no", "--repl-diskless-sync", "yes",
             "--repl-diskless-sync-delay", "0", "--dir", str(instance.folder),
             "--loglevel", "warning"], self.logs.of(instance.node))

        def up() -> bool:
            try:
                return bool(instance.client().ping())
            except redis.RedisError:
                return False

        wait_until(up, 30, f"redis-server {instance.address}", self.logs.tail)

    def slots(self) -> list[tuple[int, int, str, list[str]]]:
        """(first slot, last slot, master address, replica addresses) per shard, as the
        first instance that answers sees them."""
        for instance in self.instances:
            try:
                reply = instance.client().execute_command("CLUSTER SLOTS")
            except redis.RedisError:
                continue
            return [(int(s[0]), int(s[1]), _address(s[2]), [_address(r) for r in s[3:]])
                    for s in reply]
        return []

    def master_of(self, tag: str) -> Instance:
        slot = key_slot(tag.encode())
        for first, last, master, _replicas in self.slots():
            if first <= slot <= last:
                return next(i for i in self.instances if i.address == master)
        raise AssertionError(f"no master serves {tag}'s slot {slot}")

    def healthy(self) -> bool:
        """Every slot served, every instance known to all, every replica in sync, and
        every shard with a replica (as the first instance that answers sees it)."""
        shards = self.slots()
        if not shards or not all(replicas for *_s, replicas in shards):
            return False
        for instance in self.instances:
            try:
                client = instance.client()
                info = client.execute_command("CLUSTER INFO")
                replication = client.info("replication")
            except redis.RedisError:
                return False
            fields = info if isinstance(info, dict) else dict(
                line.split(":", 1) for line in info.decode().split() if ":" in line)
            if (str(fields.get("cluster_state")) != "ok"
                    or str(fields.get("cluster_slots_ok")) != "16384"
                    or str(fields.get("cluster_known_nodes")) != str(len(self.instances))):
                return False
            if replication.get("role") == "slave" and \
                    replication.get("master_link_status") != "up":
                return False
        return True

    def kill_master(self, tag: str) -> Instance:
        """SIGKILL the master serving `tag`'s slot (the first step of a failover)."""
        victim = self.master_of(tag)
        assert victim.proc is not None
        victim.proc.kill()
        victim.proc.wait(10)
        return victim

    def promoted(self, tag: str, victim: Instance) -> str:
        """Wait until an instance other than `victim` serves `tag`'s slot: its address."""
        slot = key_slot(tag.encode())

        def found() -> str | None:
            master = self._master_address(slot, skip=victim)
            return master if master and master != victim.address else None

        return str(wait_until(found, 60, f"a replica promoted in place of {victim.address}",
                              self.logs.tail))

    def restart(self, address: str) -> None:
        """Start a killed instance again (it rejoins as a replica) and wait until the
        cluster is whole."""
        instance = next(i for i in self.instances if i.address == address)
        self.start(instance)
        wait_until(self.healthy, 60, "the Redis Cluster whole again", self.logs.tail)

    def _master_address(self, slot: int, *, skip: Instance) -> str | None:
        for instance in self.instances:
            if instance is skip:
                continue
            try:
                reply = instance.client().execute_command("CLUSTER SLOTS")
            except redis.RedisError:
                continue
            for shard in reply:
                if int(shard[0]) <= slot <= int(shard[1]):
                    return _address(shard[2])
        return None


def _address(entry: Any) -> str:
    host = entry[0].decode() if isinstance(entry[0], bytes) else str(entry[0])
    return f"{host}:{int(entry[1])}"


def missing() -> str | None:
    """What this machine lacks for a Redis Cluster, or None."""
    if redis_binary() is None or shutil.which("redis-cli") is None:
        return "no redis-server and redis-cli"
    return None


def start_cluster(nodes: list[Node], folder: Path, logs: Logs) -> RedisCluster:
    """A master on each of `nodes` (MASTER_PORT) and a replica of it on the next node
    (REPLICA_PORT), once the cluster serves every slot with every replica in sync."""
    binary = redis_binary()
    cli = shutil.which("redis-cli")
    assert binary is not None and cli is not None
    masters = [Instance(n, MASTER_PORT, folder / f"{n.name}-{MASTER_PORT}") for n in nodes]
    replicas = [Instance(n, REPLICA_PORT, folder / f"{n.name}-{REPLICA_PORT}") for n in nodes]
    cluster = RedisCluster([*masters, *replicas], logs, binary)
    for instance in cluster.instances:
        cluster.start(instance)

    def cli_run(*args: str) -> None:
        done = subprocess.run([cli, "--cluster", *args, "--cluster-yes"], capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 0, f"redis-cli --cluster {args[0]}: {done.stdout[-2000:]}"

    cli_run("create", *(m.address for m in masters), "--cluster-replicas", "0")
    for i, master in enumerate(masters):
        replica = replicas[(i + 1) % len(replicas)]  # on the next node
        node_id = master.client().execute_command("CLUSTER MYID")
        node_id = node_id.decode() if isinstance(node_id, bytes) else str(node_id)
        cli_run("add-node", replica.address, master.address, "--cluster-slave",
                "--cluster-master-id", node_id)
    wait_until(cluster.healthy, 90, "the Redis Cluster", logs.tail)
    for _first, _last, master_address, replica_addresses in cluster.slots():
        host = master_address.rsplit(":", 1)[0]
        assert replica_addresses and all(r.rsplit(":", 1)[0] != host
                                         for r in replica_addresses), cluster.slots()
    return cluster
