"""The README walkthroughs, through a client generated from openapi/openapi.json.

Generate the client first (./generate), then, with a server running:

    HOLDFAST_URL=http://127.0.0.1:7427 HOLDFAST_TOKEN=... .venv/bin/python walkthrough.py

Every step checks what the server answered, so a document change that breaks
the generated client makes this program fail.
"""

from __future__ import annotations

import os
import time
import uuid

from holdfast_client import AuthenticatedClient, Client
from holdfast_client.api.events import list_events
from holdfast_client.api.leases import acquire_lease, release_lease, renew_lease
from holdfast_client.api.processes import create_process, get_process_logs, stop_process
from holdfast_client.models import (
    AcquireRequest,
    AcquireResponse,
    CommandSpec,
    CreateProcessRequest,
    EventList,
    EventType,
    Lease,
    LeaseState,
    Metadata,
    Problem,
    ProblemCode,
    Process,
    ProcessState,
    ReleaseRequest,
    RenewRequest,
    StopRequest,
)


def connect() -> Client | AuthenticatedClient:
    url = os.environ.get("HOLDFAST_URL", "http://127.0.0.1:7427")
    token = os.environ.get("HOLDFAST_TOKEN")
    if token:
        return AuthenticatedClient(base_url=url, token=token, raise_on_unexpected_status=True)
    return Client(base_url=url, raise_on_unexpected_status=True)


def leases(client: Client | AuthenticatedClient, resource: str) -> tuple[Lease, int]:
    """Acquire, meet a conflict, renew, release."""
    metadata = Metadata.from_dict({"example": "python", "pid": os.getpid()})
    body = AcquireRequest(resource=resource, holder="supervisor-1", ttl_ms=30_000, metadata=metadata)
    # An Idempotency-Key makes the request safe to retry after a timeout or a 503.
    key = f"walkthrough-{uuid.uuid4()}"
    lease = acquire_lease.sync(client=client, body=body, idempotency_key=key)
    assert isinstance(lease, AcquireResponse), lease
    # The retry is answered the first answer again; nothing is acquired twice.
    retried = acquire_lease.sync(client=client, body=body, idempotency_key=key)
    assert isinstance(retried, AcquireResponse) and retried.id == lease.id, retried
    assert lease.state == LeaseState.ACTIVE and lease.metadata["example"] == "python"
    print(f"acquired {lease.resource} with token {lease.token}, expires {lease.expires_at}")

    # A second holder is refused: the problem's code and the holder are typed.
    refused = acquire_lease.sync_detailed(
        client=client,
        body=AcquireRequest(resource=resource, holder="supervisor-2", ttl_ms=30_000),
    )
    problem = refused.parsed
    assert refused.status_code == 409 and isinstance(problem, Problem), refused
    assert problem.code == ProblemCode.LEASE_HELD
    assert isinstance(problem.holder, Lease) and problem.holder.token == lease.token
    print(f"{problem.code.value}: {problem.detail} (holder {problem.holder.holder!r}, token {problem.holder.token})")

    renewed = renew_lease.sync(id=lease.id, client=client, body=RenewRequest(token=lease.token, ttl_ms=60_000))
    assert isinstance(renewed, Lease) and renewed.ttl_ms == 60_000, renewed
    assert renewed.expires_at is not None and lease.expires_at is not None
    assert renewed.expires_at > lease.expires_at
    print(f"renewed until {renewed.expires_at}")

    released = release_lease.sync(id=lease.id, client=client, body=ReleaseRequest(token=lease.token))
    assert isinstance(released, Lease) and released.state == LeaseState.RELEASED, released
    # A stale token is fenced, and the problem shows the lease as it is now.
    fenced = renew_lease.sync(id=lease.id, client=client, body=RenewRequest(token=lease.token))
    assert isinstance(fenced, Problem) and fenced.code == ProblemCode.FENCED, fenced
    print(f"released; renewing again is {fenced.code.value}")
    return released, lease.token


def processes(client: Client | AuthenticatedClient) -> Process:
    """Spawn a dev server with a port, read its output, stop it."""
    script = 'echo "listening on $PORT_HTTP"; exec sleep 30'
    proc = create_process.sync(
        client=client,
        body=CreateProcessRequest(
            kind="dev-server",
            command=CommandSpec(argv=["sh", "-c", script]),
            ports=["http"],
        ),
    )
    assert isinstance(proc, Process) and proc.state == ProcessState.RUNNING, proc
    port = proc.ports["http"]
    print(f"spawned pid {proc.pid} with port http={port}")

    expected = f"listening on {port}"
    deadline = time.monotonic() + 10
    output = ""
    while expected not in output:
        assert time.monotonic() < deadline, f"no output: {output!r}"
        logs = get_process_logs.sync(id=proc.id, client=client)
        assert isinstance(logs, str), logs
        output = logs
        time.sleep(0.05)
    print(f"its output: {output.strip()!r}")

    stopped = stop_process.sync(id=proc.id, client=client, body=StopRequest(token=proc.token, grace_ms=2000))
    assert isinstance(stopped, Process) and stopped.state == ProcessState.STOPPED, stopped
    assert stopped.exit_.signal == 15, stopped.exit_
    assert not stopped.ports.additional_properties, "its port was released"
    print(f"stopped: signal {stopped.exit_.signal}")
    return stopped


def events(client: Client | AuthenticatedClient, lease: Lease, proc: Process) -> None:
    """The ordered log of what happened above."""
    seen: list[EventType] = []
    after = 0
    while True:
        page = list_events.sync(client=client, after=after, limit=1000)
        assert isinstance(page, EventList), page
        if not page.items:
            break
        for event in page.items:
            after = event.seq
            if (event.lease and event.lease.id == lease.id) or (event.process and event.process.id == proc.id):
                seen.append(event.type_)
    assert seen[:2] == [EventType.LEASE_ACQUIRED, EventType.LEASE_RELEASED], seen
    assert seen[-2:] == [EventType.PROCESS_RUNNING, EventType.PROCESS_STOPPED], seen
    print("events: " + ", ".join(t.value for t in seen))


def main() -> None:
    client = connect()
    lease, _ = leases(client, f"workspace/python-{os.getpid()}")
    proc = processes(client)
    events(client, lease, proc)
    print("python walkthrough: ok")


if __name__ == "__main__":
    main()
