-- Managed processes: spawned by holdfast or registered and confirmed by a client.
CREATE TABLE processes (
    id           TEXT PRIMARY KEY,
    kind         TEXT NOT NULL,
    state        TEXT NOT NULL
        CHECK (state IN ('starting', 'running', 'stopping', 'orphaned', 'exited', 'stopped', 'failed')),
    token        INTEGER NOT NULL,
    operation_id TEXT,
    lease_id     TEXT,
    lease_token  INTEGER,
    host_id      TEXT NOT NULL,     -- the host whose holdfast may signal it
    identity     TEXT,              -- JSON, null while starting
    owner        TEXT,              -- JSON identity of the heartbeat owner
    spawned      INTEGER NOT NULL,
    command      TEXT,              -- JSON {argv, cwd, env}
    stdout_path  TEXT,
    stderr_path  TEXT,
    exit_code    INTEGER,
    exit_signal  INTEGER,
    ttl_ms       INTEGER,
    expires_at   INTEGER,
    created_at   INTEGER NOT NULL,
    started_at   INTEGER,
    ended_at     INTEGER,
    end_reason   TEXT,
    metadata     TEXT NOT NULL
);

-- At most one live process per operation id.
CREATE UNIQUE INDEX processes_one_operation ON processes (operation_id)
    WHERE state IN ('starting', 'running', 'stopping', 'orphaned') AND operation_id IS NOT NULL;
CREATE INDEX processes_current ON processes (host_id, id)
    WHERE state IN ('starting', 'running', 'stopping', 'orphaned');
CREATE INDEX processes_by_lease ON processes (lease_id, id);
CREATE INDEX processes_by_kind ON processes (kind, id);

-- Port reservations. A port is a host's resource.
CREATE TABLE ports (
    id          TEXT PRIMARY KEY,
    host_id     TEXT NOT NULL,
    port        INTEGER NOT NULL,
    name        TEXT NOT NULL,
    owner_kind  TEXT NOT NULL CHECK (owner_kind IN ('process', 'lease')),
    owner_id    TEXT NOT NULL,
    owner_token INTEGER NOT NULL,
    reserved_at INTEGER NOT NULL,
    released_at INTEGER
);

-- The invariant: one current reservation per port on a host.
CREATE UNIQUE INDEX ports_one_current ON ports (host_id, port) WHERE released_at IS NULL;
CREATE INDEX ports_by_owner ON ports (owner_id) WHERE released_at IS NULL;
