-- The PostgreSQL schema: the same tables as the SQLite one, shared by every
-- holdfast of a fleet. Ids are compared bytewise (COLLATE "C"), as SQLite
-- does, so that cursors order the same on both stores.

-- Key/value facts about the store (health probe, retention watermark).
CREATE TABLE meta (
    key   TEXT COLLATE "C" PRIMARY KEY,
    value TEXT NOT NULL
);

-- One row per resource ever leased: its last fencing token.
CREATE TABLE resources (
    resource   TEXT COLLATE "C" PRIMARY KEY,
    last_token BIGINT NOT NULL
);

CREATE TABLE leases (
    id              TEXT COLLATE "C" PRIMARY KEY,
    resource        TEXT COLLATE "C" NOT NULL,
    token           BIGINT NOT NULL,
    holder          TEXT COLLATE "C" NOT NULL,
    state           TEXT NOT NULL
        CHECK (state IN ('reserved', 'active', 'released', 'expired', 'reclaimed', 'broken')),
    owner           TEXT,              -- identity JSON, null when unbound
    parent_id       TEXT COLLATE "C",
    parent_resource TEXT,
    parent_token    BIGINT,
    ttl_ms          BIGINT,
    expires_at      BIGINT,            -- ms since the epoch
    acquired_at     BIGINT NOT NULL,
    renewed_at      BIGINT,
    ended_at        BIGINT,
    end_reason      TEXT,
    metadata        TEXT NOT NULL      -- JSON text, member order kept
);

-- The invariant itself: at most one current lease per resource, fleet-wide.
CREATE UNIQUE INDEX leases_one_current ON leases (resource)
    WHERE state IN ('reserved', 'active');
CREATE INDEX leases_current_expiry ON leases (expires_at)
    WHERE state IN ('reserved', 'active');
CREATE INDEX leases_current_owned ON leases (id)
    WHERE state IN ('reserved', 'active') AND owner IS NOT NULL;
CREATE INDEX leases_by_resource ON leases (resource, id);
CREATE INDEX leases_by_holder ON leases (holder, id);
CREATE INDEX leases_by_parent ON leases (parent_id, id);

-- The last event seq. Every write transaction locks this row first, so the
-- fleet's writes are serialized and seqs become visible in commit order: a
-- reader that has seen seq N has seen every seq below it.
CREATE TABLE event_seq (
    one  BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),
    seq  BIGINT NOT NULL
);
INSERT INTO event_seq (seq) VALUES (0);

CREATE TABLE events (
    seq  BIGINT PRIMARY KEY,
    at   BIGINT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX events_by_time ON events (at);
