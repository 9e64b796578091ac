"""Several processes, one model: JAX's multi-controller runtime (`jax.distributed`).

Where it sits: under the runner. Every process builds the same ModelRunner over the global
mesh (weights and KV pool are placed shard by shard, each process filling only its own
devices) and must call the same compiled programs with the same inputs in the same order.
Process 0 alone runs the scheduler (and the HTTP server); before each runner call it
publishes the call to the other processes through the coordination service's key-value
store, which `jax.distributed` already runs; the others replay the calls (`follow`). On one
machine a 64-sequence decode step costs ~0.7 ms to publish and ~1 ms to receive. A
process that stops answering ends the others with a clear error after a bounded wait
instead of a hang: besides JAX's own heartbeats, every process keeps one TCP connection to
process 0 (port = coordinator port + 1), opened before `jax.distributed.initialize`, so a
missing process is named at start-up and a dead one is noticed the moment its sockets close.

Flags: `--distributed-executor-backend jax`, the coordinator at `--data-parallel-address` and
`--data-parallel-rpc-port`, `--num-processes` and `--process-id` (all may be left out on TPU
VMs, where JAX reads them from the environment).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import struct
import sys
import threading
import time

import jax

logger = logging.getLogger(__name__)

_PREFIX = "jaxserve/runner"


class DistributedError(RuntimeError):
    """The processes could not meet (one never arrived, or process 0 was unreachable)."""


DEFAULT_PORT = 13345  # vLLM's default --data-parallel-rpc-port
_presence: _Presence | None = None


def initialize_from_args(args) -> None:
    """Join the other processes if the engine arguments ask for it; idempotent. Runs before
    anything touches a JAX device (EngineArgs.validate calls it first)."""
    if args.distributed_executor_backend != "jax" or _client_or_none() is not None:
        return
    address = None
    if args.data_parallel_address:
        address = f"{args.data_parallel_address}:{args.data_parallel_rpc_port or DEFAULT_PORT}"
    initialize(address, args.num_processes, args.process_id, args.distributed_timeout)


def initialize(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    timeout_s: float = 300,
) -> None:
    """Meet the other processes (named, within timeout_s), then jax.distributed.initialize,
    with CPU collectives (gloo) on CPU. On TPU VMs all three may be None: JAX reads them from
    the environment (and only its heartbeats watch the processes)."""
    global _presence
    if "cpu" in str(jax.config.jax_platforms or "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator_address is not None and num_processes is not None and process_id is not None:
        host, port = coordinator_address.rsplit(":", 1)
        _presence = _Presence(host, int(port) + 1, num_processes, process_id, timeout_s)
    jax.distributed.initialize(
        coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=int(timeout_s),
    )
    if _presence is not None:
        _presence.watch()
    logger.info(
        "Process %d of %d: %d local devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
    )


def closing() -> None:
    """This process is stopping on purpose: the others going away is expected now."""
    if _presence is not None:
        _presence.closing = True


def _fatal(message: str) -> None:
    logger.error(message)
    print(f"jaxserve: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)  # the engine thread may be inside a collective that will never finish


class _Presence:
    """One TCP connection from each process to process 0, held for the processes' lives."""

    def __init__(self, host: str, port: int, num_processes: int, process_id: int, timeout_s: float):
        self.rank, self.closing = process_id, False
        deadline = time.monotonic() + timeout_s
        if process_id == 0:
            try:
                server = socket.create_server((host, port))
            except OSError as err:
                raise DistributedError(
                    f"Process 0 cannot listen on {host}:{port} (the port after the coordinator's, "
                    f"{port - 1}): {err.strerror or err}."
                ) from None
            server.settimeout(1.0)
            self.peers: dict[int, socket.socket] = {}
            while len(self.peers) < num_processes - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, num_processes)) - set(self.peers))
                    raise DistributedError(
                        f"Process(es) {missing} of {num_processes} never arrived within {timeout_s:g} s "
                        f"(coordinator {host}:{port - 1})."
                    )
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                conn.settimeout(timeout_s)
                (rank,) = struct.unpack("!I", conn.recv(4))
                self.peers[rank] = conn
            server.close()
        else:
            while True:
                try:
                    conn = socket.create_connection((host, port), timeout=1.0)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise DistributedError(
                            f"Could not reach process 0 at {host}:{port - 1} within {timeout_s:g} s."
                        ) from None
                    time.sleep(0.2)
            conn.sendall(struct.pack("!I", process_id))
            self.peers = {0: conn}

    def watch(self) -> None:
        threading.Thread(target=self._watch, name="jaxserve-presence", daemon=True).start()

    def _watch(self) -> None:
        by_socket = {conn: rank for rank, conn in self.peers.items()}
        for conn in by_socket:
            conn.setblocking(True)
        while True:
            readable, _, _ = select.select(list(by_socket), [], [])
            for conn in readable:
                try:
                    data = conn.recv(1)
                except OSError:
                    data = b""
                if data:
                    continue
                if self.closing:
                    return
                rank = by_socket[conn]
                _fatal(
                    f"process {rank} stopped (its connection to process {self.rank} closed); "
                    "the model spans every process, so this one stops too."
                )


def _client_or_none():
    from jax._src import distributed

    return distributed.global_state.client


def _client():
    client = _client_or_none()
    if client is None:
        raise RuntimeError("jax.distributed is not initialized.")
    return client


class StepChannel:
    """Process 0 -> every other process: the runner calls to replay, in order."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_ms = int(timeout_s * 1000)
        self.rank, self.size = jax.process_index(), jax.process_count()
        self._next = 0

    def publish(self, call: str, *args) -> None:
        payload = pickle.dumps((call, args), protocol=pickle.HIGHEST_PROTOCOL)
        client = _client()
        for rank in range(1, self.size):
            client.key_value_set_bytes(f"{_PREFIX}/{rank}/{self._next}", payload)
        self._next += 1

    def receive(self) -> tuple[str, tuple]:
        """The next call from process 0, however long process 0 stays idle."""
        client, key = _client(), f"{_PREFIX}/{self.rank}/{self._next}"
        while True:
            try:
                payload = client.blocking_key_value_get_bytes(key, self.timeout_ms)
                break
            except Exception as e:  # a timeout means process 0 is idle: wait again
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        client.key_value_delete(key)
        self._next += 1
        return pickle.loads(payload)


def follow(runner, channel: StepChannel) -> None:
    """A non-zero process's whole life: replay process 0's runner calls until it says stop."""
    while True:
        call, args = channel.receive()
        if call == "stop":
            closing()
            return
        getattr(runner, call)(*args)
