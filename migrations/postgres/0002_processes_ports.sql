-- Managed processes and port reservations, fleet-wide; each process and
-- port belongs to the host whose holdfast recorded it.
CREATE TABLE processes (
    id           TEXT COLLATE "C" PRIMARY KEY,
    kind         TEXT COLLATE "C" NOT NULL,
    state        TEXT NOT NULL
        CHECK (state IN ('starting', 'running', 'stopping', 'orphaned', 'exited', 'stopped', 'failed')),
    token        BIGINT NOT NULL,
    operation_id TEXT COLLATE "C",
    lease_id     TEXT COLLATE "C",
    lease_token  BIGINT,
    host_id      TEXT COLLATE "C" NOT NULL,  -- the host whose holdfast may signal it
    identity     TEXT,
    owner        TEXT,
    spawned      BOOLEAN NOT NULL,
    command      TEXT,
    stdout_path  TEXT,
    stderr_path  TEXT,
    exit_code    INTEGER,
    exit_signal  INTEGER,
    ttl_ms       BIGINT,
    expires_at   BIGINT,
    created_at   BIGINT NOT NULL,
    started_at   BIGINT,
    ended_at     BIGINT,
    end_reason   TEXT,
    metadata     TEXT NOT NULL
);

-- At most one live process per operation id, fleet-wide.
CREATE UNIQUE INDEX processes_one_operation ON processes (operation_id)
    WHERE state IN ('starting', 'running', 'stopping', 'orphaned') AND operation_id IS NOT NULL;
CREATE INDEX processes_current ON processes (host_id, id)
    WHERE state IN ('starting', 'running', 'stopping', 'orphaned');
CREATE INDEX processes_by_lease ON processes (lease_id, id);
CREATE INDEX processes_by_kind ON processes (kind, id);

-- Port reservations. A port is a host's resource.
CREATE TABLE ports (
    id          TEXT COLLATE "C" PRIMARY KEY,
    host_id     TEXT COLLATE "C" NOT NULL,
    port        INTEGER NOT NULL CHECK (port BETWEEN 1 AND 65535),
    name        TEXT COLLATE "C" NOT NULL,
    owner_kind  TEXT NOT NULL CHECK (owner_kind IN ('process', 'lease')),
    owner_id    TEXT COLLATE "C" NOT NULL,
    owner_token BIGINT NOT NULL,
    reserved_at BIGINT NOT NULL,
    released_at BIGINT
);

CREATE UNIQUE INDEX ports_one_current ON ports (host_id, port) WHERE released_at IS NULL;
CREATE INDEX ports_by_owner ON ports (owner_id) WHERE released_at IS NULL;
