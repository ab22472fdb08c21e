-- Key/value facts about the store itself (boot id of the last run, health probe).
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

-- One row per resource ever leased: its last fencing token. Tokens are taken
-- from here in the acquiring transaction, so they never go backwards, even
-- after releases, reclaims and restarts.
CREATE TABLE resources (
    resource   TEXT PRIMARY KEY,
    last_token INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE leases (
    id              TEXT PRIMARY KEY,
    resource        TEXT NOT NULL,
    token           INTEGER NOT NULL,
    holder          TEXT NOT NULL,
    state           TEXT NOT NULL
        CHECK (state IN ('reserved', 'active', 'released', 'expired', 'reclaimed', 'broken')),
    owner           TEXT,              -- identity JSON, null when unbound
    parent_id       TEXT,
    parent_resource TEXT,
    parent_token    INTEGER,
    ttl_ms          INTEGER,
    expires_at      INTEGER,           -- ms since the epoch
    acquired_at     INTEGER NOT NULL,
    renewed_at      INTEGER,
    ended_at        INTEGER,
    end_reason      TEXT,
    metadata        TEXT NOT NULL
);

-- The invariant itself: at most one current lease per resource.
CREATE UNIQUE INDEX leases_one_current ON leases (resource)
    WHERE state IN ('reserved', 'active');
-- Reconciler scans: current leases by expiry, and current leases with an owner.
CREATE INDEX leases_current_expiry ON leases (expires_at)
    WHERE state IN ('reserved', 'active');
CREATE INDEX leases_current_owned ON leases (id)
    WHERE state IN ('reserved', 'active') AND owner IS NOT NULL;
CREATE INDEX leases_by_resource ON leases (resource, id);
CREATE INDEX leases_by_holder ON leases (holder, id);
CREATE INDEX leases_by_parent ON leases (parent_id, id);

-- The event log: body is the event's JSON without its seq.
CREATE TABLE events (
    seq  INTEGER PRIMARY KEY AUTOINCREMENT,
    at   INTEGER NOT NULL,
    body TEXT NOT NULL
);
