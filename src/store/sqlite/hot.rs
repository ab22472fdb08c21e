//! The writes of the hot paths (lease updates and inserts, events, token
//! counters), kept as JSON rows and written by one statement per send:
//! an INSERT into a TEMP view whose INSTEAD OF trigger writes each kind with
//! one statement over its rows. sqlx answers every statement of a query
//! with a message from its SQLite thread, and each wakes the task that
//! waits for it: one statement instead of four saves those wake-ups, and
//! lets a transaction made only of such writes run as that one statement
//! (see `Pipeline::lone_write`). A statement is atomic, so the trigger's
//! writes are kept or undone together, and it is one of a few texts, which
//! stay prepared.

use sqlx::SqliteConnection;

use super::map_err;
use crate::store::Result;
use crate::store::sql::lease_cols;

/// The kinds of rows, in the order they are written. Lease updates go
/// before inserts: an update only keeps a lease current or ends it, and an
/// ended lease must make way before a new current one on its resource is
/// inserted. Each kind is a table of its own and none of the tables'
/// constraints spans two of them, so only the order within a kind matters.
pub const LEASE_UPDATES: usize = 0;
pub const LEASE_INSERTS: usize = 1;
pub const EVENTS: usize = 2;
pub const TOKENS: usize = 3;
pub const KINDS: [usize; 4] = [LEASE_UPDATES, LEASE_INSERTS, EVENTS, TOKENS];

/// The statement of a send: the rows of each kind as a JSON array (or
/// null), and how many leases the updates must find.
pub const WRITE: &str = "INSERT INTO temp.hot_writes \
     (lease_updates, lease_inserts, events, tokens, updates_expected) VALUES ($1, $2, $3, $4, $5)";

/// What a lease update that finds fewer leases than it has rows says
/// (as `db::vanished` does), undoing the whole statement.
const VANISHED: &str = "a lease vanished during update";

/// Each kind's statement over its rows, `rows` standing for the array.
const WRITES: [&str; 4] = [
    // One row per lease (see `pipeline::hot_item`), so the join is one to one.
    "UPDATE leases SET state = j.value->>1, owner = j.value->>2, ttl_ms = j.value->>3, \
     expires_at = j.value->>4, renewed_at = j.value->>5, ended_at = j.value->>6, \
     end_reason = j.value->>7 FROM json_each(NEW.lease_updates) AS j WHERE leases.id = j.value->>0",
    // json_each walks the array in order.
    concat!(
        "INSERT INTO leases (",
        lease_cols!(),
        ") SELECT j.value->>0, j.value->>1, j.value->>2, j.value->>3, j.value->>4, \
         j.value->>5, j.value->>6, j.value->>7, j.value->>8, j.value->>9, j.value->>10, \
         j.value->>11, j.value->>12, j.value->>13, j.value->>14, j.value->>15 \
         FROM json_each(NEW.lease_inserts) AS j"
    ),
    "INSERT INTO events (seq, at, body) SELECT j.value->>0, j.value->>1, j.value->>2 \
     FROM json_each(NEW.events) AS j",
    // One row per resource (see `pipeline::hot_item`).
    "INSERT INTO resources (resource, last_token) SELECT j.value->>0, j.value->>1 \
     FROM json_each(NEW.tokens) AS j WHERE true \
     ON CONFLICT (resource) DO UPDATE SET last_token = excluded.last_token",
];

/// Create the view and its trigger on the writer's connection (TEMP: they
/// live as long as the connection, and no schema migration carries them).
pub async fn install(conn: &mut SqliteConnection) -> Result<()> {
    let [updates, inserts, events, tokens] = WRITES;
    let sql = format!(
        "CREATE TEMP VIEW IF NOT EXISTS hot_writes \
             (lease_updates, lease_inserts, events, tokens, updates_expected) \
             AS SELECT NULL, NULL, NULL, NULL, NULL;
         CREATE TEMP TRIGGER IF NOT EXISTS hot_writes_insert INSTEAD OF INSERT ON hot_writes
         BEGIN
             {updates};
             SELECT RAISE(ABORT, '{VANISHED}') WHERE changes() <> NEW.updates_expected;
             {inserts};
             {events};
             {tokens};
         END;"
    );
    sqlx::raw_sql(&sql)
        .execute(conn)
        .await
        .map(|_| ())
        .map_err(map_err)
}
