-- Requests made with an Idempotency-Key: the first one's request (method,
-- path and body) and, once answered, its answer, kept for 24 hours. The row
-- is written in the same transaction as the request's change; `request_id`
-- tells the request that made it from a later one with the same key.
CREATE TABLE idempotency (
    key          TEXT PRIMARY KEY,
    request      TEXT NOT NULL,
    request_id   TEXT NOT NULL,
    status       INTEGER,           -- null until the request is answered
    content_type TEXT,
    body         TEXT,
    created_at   INTEGER NOT NULL
);
CREATE INDEX idempotency_created ON idempotency (created_at);
