//! A PostgreSQL write transaction's statements, in as few round trips as
//! the jobs allow. sqlx sends every statement as a round trip of its own (it
//! does not pipeline), and each wakes a server process and this task, which
//! costs more than the statement. As SQLite's writer does
//! (`sqlite::pipeline`), the writes of the hot paths (lease inserts and
//! updates, token counters, events) are kept as rows and written by one call
//! of a function that runs one statement per kind, in order: at the end of
//! the batch with the commit's notifications, or earlier, before any
//! statement that could see them.
//!
//! BEGIN and the fleet's write lock go out with the batch's first read, in
//! one simple query (the read prepared, its values written in, `literal`):
//! a lone acquire or release is two round trips, that one and the commit.
//!
//! Reads that the queued rows cannot change go out at once: a lease or the
//! current lease of a resource the queue holds no row of, the token counter
//! of a resource it holds none of, an owner's reservations (never queued).
//! Any other statement sends the queue first, so it sees every write before
//! it, in order. Event seqs are counted here: the transaction holds the
//! fleet's write lock (the row of `event_seq`), so no one else takes one.

use std::collections::{HashMap, HashSet};

use futures_util::TryStreamExt;
use serde_json::{Value, json};
use sqlx::PgConnection;
use sqlx::postgres::PgRow;

use super::literal::{dollar_tag, execute};
use super::notify::Notice;
use crate::store::cache::Check;
use crate::store::db::{Cols, Exec, Hot, Stmt, json_row};
use crate::store::rows::{CURRENT_LOCKED, LEASE_LOCKED, NEXT_TOKEN, PORTS_OF, UPDATE_INTO_INSERT};
use crate::store::sql::{lease_cols, lease_current};
use crate::store::{BoxFuture, Result, StoreError};
use crate::time::Millis;

/// Verifies the cache's checks (`cache::Check`: each raises `HF001`,
/// `StoreError::Stale`, when it fails; the leases locked when `locking`,
/// in a transaction that holds the fleet's lock), then writes the queued rows of each
/// kind (JSON arrays of rows): lease updates first (an update only keeps a
/// lease current or ends it, and an ended lease must make way before a new
/// current one on its resource is inserted), then lease inserts, events,
/// token counters; sends the notifications, records `marker` under
/// `marker_key` (in `meta`) when given, and returns the shift of the
/// batch's event seqs. The batch counts its events from 0 (`Pipeline::seq`,
/// `seq_from` the count the database's counter stands at), and the function
/// adds the counter's value to them, to the counter, and to the seq of each
/// notification (`notify::Notice`). A temporary function, created on every
/// connection (`install`): no migration carries it, and a holdfast of
/// another version on the same database never sees it.
const FUNCTION: &str = concat!(
    "CREATE OR REPLACE FUNCTION pg_temp.holdfast_write(
        checks jsonb, locking boolean, lease_updates jsonb, lease_inserts jsonb, new_events jsonb,
        tokens jsonb, seq_from bigint, channel text, notices jsonb,
        marker_key text, marker text, claims jsonb) RETURNS bigint LANGUAGE plpgsql AS $fn$
    DECLARE
        u jsonb;
        changed bigint;
        shift bigint;
        last bigint;
    BEGIN
        FOR u IN SELECT value FROM jsonb_array_elements(checks) LOOP
            IF u->>0 = 'lease' AND locking THEN
                -- Locked, so that no renewal changes it before the writes.
                PERFORM 1 FROM leases
                    WHERE id = u->>1 AND xmin::text::bigint = (u->>2)::bigint FOR UPDATE;
                IF NOT FOUND THEN
                    RAISE EXCEPTION USING ERRCODE = 'HF001', MESSAGE = 'lease changed';
                END IF;
            ELSIF u->>0 = 'lease' THEN
                -- Outside the fleet's lock (a batch that only read): rows
                -- taken one after another could deadlock with a writer.
                PERFORM 1 FROM leases
                    WHERE id = u->>1 AND xmin::text::bigint = (u->>2)::bigint;
                IF NOT FOUND THEN
                    RAISE EXCEPTION USING ERRCODE = 'HF001', MESSAGE = 'lease changed';
                END IF;
            ELSIF u->>0 = 'free' THEN
                PERFORM 1 FROM leases WHERE resource = u->>1 AND ",
    lease_current!(),
    ";
                IF FOUND THEN
                    RAISE EXCEPTION USING ERRCODE = 'HF001', MESSAGE = 'resource taken';
                END IF;
            ELSIF u->>0 = 'token' THEN
                IF (SELECT last_token FROM resources WHERE resource = u->>1)
                    IS DISTINCT FROM (u->>2)::bigint THEN
                    RAISE EXCEPTION USING ERRCODE = 'HF001', MESSAGE = 'token moved';
                END IF;
            -- The same ids: as many, and each of them current and the owner's.
            ELSIF (SELECT count(*) FROM ports WHERE owner_id = u->>1 AND released_at IS NULL)
                <> jsonb_array_length(u->2)
                OR EXISTS (SELECT 1 FROM jsonb_array_elements_text(u->2) AS held(id)
                    WHERE NOT EXISTS (SELECT 1 FROM ports p WHERE p.id = held.id
                        AND p.owner_id = u->>1 AND p.released_at IS NULL)) THEN
                RAISE EXCEPTION USING ERRCODE = 'HF001', MESSAGE = 'reservations changed';
            END IF;
        END LOOP;
        FOR u IN SELECT value FROM jsonb_array_elements(claims) LOOP
            IF pg_temp.holdfast_claim(u->>0, u->>1, u->>2, (u->>3)::bigint, (u->>4)::bigint,
                    u->>5, u->>6) IS DISTINCT FROM u->>2 THEN
                RAISE EXCEPTION USING ERRCODE = 'HF001', MESSAGE = 'idempotency key held';
            END IF;
            -- Its answer, kept with the change (`rows::answer_key`), which
            -- leaves it no run; or that its request created a record
            -- (`rows::key_created`).
            IF u->>7 IS NOT NULL THEN
                UPDATE idempotency SET status = (u->>7)::bigint, content_type = u->>8,
                    body = u->>9, run_id = NULL
                    WHERE key = u->>0 AND request_id = u->>2 AND status IS NULL;
            ELSIF u->>5 IS NULL THEN
                UPDATE idempotency SET run_id = NULL WHERE key = u->>0 AND request_id = u->>2;
            END IF;
        END LOOP;
        -- One by id each: a join with the array would be planned for a
        -- hundred rows, as a hash join over the whole table.
        FOR u IN SELECT value FROM jsonb_array_elements(lease_updates) LOOP
            UPDATE leases SET state = u->>1, owner = u->>2, ttl_ms = (u->>3)::bigint,
                expires_at = (u->>4)::bigint, renewed_at = (u->>5)::bigint,
                ended_at = (u->>6)::bigint, end_reason = u->>7
                WHERE id = u->>0;
            GET DIAGNOSTICS changed = ROW_COUNT;
            IF changed <> 1 THEN
                RAISE EXCEPTION 'a lease vanished during update';
            END IF;
        END LOOP;
        -- Each statement below runs only when it has rows: a statement,
        -- even of none, costs its executor's start and end.
        IF jsonb_array_length(lease_inserts) > 0 THEN
            INSERT INTO leases (",
    lease_cols!(),
    ") SELECT j->>0, j->>1, (j->>2)::bigint, j->>3, j->>4, j->>5, j->>6, j->>7,
                (j->>8)::bigint, (j->>9)::bigint, (j->>10)::bigint, (j->>11)::bigint,
                (j->>12)::bigint, (j->>13)::bigint, j->>14, j->>15
                FROM jsonb_array_elements(lease_inserts) AS j;
        END IF;
        IF jsonb_array_length(new_events) > 0 THEN
            -- The counter moves to the batch's last seq, shifted, and the
            -- shift comes back with it.
            SELECT max((j->>0)::bigint) INTO last FROM jsonb_array_elements(new_events) AS j;
            UPDATE event_seq SET seq = seq - seq_from + last RETURNING seq - last INTO shift;
            INSERT INTO events (seq, at, body)
                SELECT (j->>0)::bigint + shift, (j->>1)::bigint, j->>2
                FROM jsonb_array_elements(new_events) AS j;
        ELSE
            SELECT seq - seq_from INTO shift FROM event_seq;
        END IF;
        IF jsonb_array_length(tokens) > 0 THEN
            INSERT INTO resources (resource, last_token) SELECT j->>0, (j->>1)::bigint
                FROM jsonb_array_elements(tokens) AS j
                ON CONFLICT (resource) DO UPDATE SET last_token = excluded.last_token;
        END IF;
        IF jsonb_array_length(notices) > 0 THEN
            PERFORM pg_notify(channel, CASE WHEN n->>1 IS NULL THEN n->>0
                    ELSE '{\"seq\":' || ((n->>1)::bigint + shift) || ',' || substr(n->>0, 2) END)
                FROM jsonb_array_elements(notices) AS n;
        END IF;
        IF marker_key IS NOT NULL THEN
            INSERT INTO meta (key, value) VALUES (marker_key, marker)
                ON CONFLICT (key) DO UPDATE SET value = excluded.value;
        END IF;
        RETURN shift;
    END
    $fn$"
);

/// `rows::claim_key`'s statement as a function, which `FUNCTION` calls for
/// the claims queued with the writes (`Pipeline::claims`).
const CLAIM_FUNCTION: &str = concat!(
    "CREATE OR REPLACE FUNCTION pg_temp.holdfast_claim(text, text, text, bigint, bigint, \
     text, text) RETURNS text LANGUAGE sql AS $fn$ ",
    crate::store::rows::claim_sql!(),
    " $fn$"
);

/// The reads a batch may begin with, prepared on every connection under
/// these names, to be sent with BEGIN (see `Pipeline::first`).
const PREPARED: [(&str, &str); 2] = [
    ("holdfast_lease_locked", LEASE_LOCKED),
    ("holdfast_current_locked", CURRENT_LOCKED),
];

/// Create the function and prepare `PREPARED` on a new connection.
pub fn install(conn: &mut PgConnection) -> BoxFuture<'_, std::result::Result<(), sqlx::Error>> {
    Box::pin(async move {
        let prepare = PREPARED.map(|(name, sql)| format!("PREPARE {name} AS {sql}"));
        sqlx::Executor::execute(&mut *conn, CLAIM_FUNCTION).await?;
        sqlx::Executor::execute(&mut *conn, FUNCTION).await?;
        sqlx::Executor::execute(conn, prepare.join("; ").as_str()).await?;
        Ok(())
    })
}

/// `sql` as a simple query (several statements, no parameters).
pub(super) fn exec(conn: &mut PgConnection, sql: impl Into<String>) -> BoxFuture<'_, Result<()>> {
    let sql = sql.into();
    Box::pin(async move {
        // Boxed on its own, as every future of sqlx calls that a spawned task
        // awaits: rustc cannot otherwise prove it `Send` for every lifetime
        // (rust-lang/rust#102211).
        let run: BoxFuture<'_, std::result::Result<_, sqlx::Error>> =
            Box::pin(sqlx::Executor::execute(conn, sql.as_str()));
        run.await.map(|_| ()).map_err(super::map_err)
    })
}

/// The rows waiting to be written.
#[derive(Default)]
struct Queue {
    updates: Vec<Value>,
    inserts: Vec<Value>,
    events: Vec<Value>,
    tokens: Vec<Value>,
    /// Each queued lease: whether its row is an insert, and where.
    leases: HashMap<String, (bool, usize)>,
    /// Each queued token counter's row.
    token_rows: HashMap<String, usize>,
    /// Resources of the queued lease rows.
    resources: HashSet<String>,
    /// An update of a lease whose resource is not known is queued.
    unknown_resource: bool,
}

impl Queue {
    fn is_empty(&self) -> bool {
        self.updates.is_empty()
            && self.inserts.is_empty()
            && self.events.is_empty()
            && self.tokens.is_empty()
    }
}

/// BEGIN and the fleet's write lock, which yields the transaction's id
/// and the last event seq.
const BEGIN: &str = "BEGIN; SELECT txid_current(), seq FROM event_seq FOR UPDATE";

/// The rows of each statement of the simple query `sql`.
fn simple(conn: &mut PgConnection, sql: String) -> BoxFuture<'_, Result<Vec<Vec<PgRow>>>> {
    Box::pin(async move { simple_raw(conn, sql).await.map_err(super::map_err) })
}

/// Whether `e` says the transaction was not kept: an error of a statement
/// (severity ERROR) aborts it, where a FATAL one (the server process ended,
/// `57P01`) may come after its commit.
fn refused(e: &sqlx::Error) -> bool {
    use sqlx::postgres::{PgDatabaseError, PgSeverity};
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<PgDatabaseError>())
        .is_some_and(|d| d.severity() == PgSeverity::Error)
}

/// `simple`, with the driver's error.
fn simple_raw(
    conn: &mut PgConnection,
    sql: String,
) -> BoxFuture<'_, std::result::Result<Vec<Vec<PgRow>>, sqlx::Error>> {
    Box::pin(async move {
        let mut out = vec![Vec::new()];
        let mut items = sqlx::Executor::fetch_many(conn, sql.as_str());
        while let Some(item) = items.try_next().await? {
            match item {
                // A statement's end.
                sqlx::Either::Left(_) => out.push(Vec::new()),
                sqlx::Either::Right(row) => {
                    if let Some(rows) = out.last_mut() {
                        rows.push(row);
                    }
                }
            }
        }
        // The one opened after the last statement's end.
        out.pop();
        Ok(out)
    })
}

pub struct Pipeline<'c> {
    conn: &'c mut PgConnection,
    /// The transaction's id, once BEGIN went out: with the batch's first
    /// read when it can carry it, else alone, else with the commit.
    txid: Option<i64>,
    /// The database's event seq when the transaction took the fleet's
    /// lock: what the batch's own count of events is shifted by.
    base: Option<i64>,
    /// A statement of the current job failed (which aborts the transaction).
    pub failed: bool,
    /// The commit that went out with BEGIN (so with no id known before it)
    /// recorded its marker: should its answer be lost, the marker tells
    /// whether it committed.
    pub marked: bool,
    /// The commit failed without an answer that it was refused (the
    /// connection broke, or its server process ended): it may have
    /// committed.
    pub lost: bool,
    queue: Queue,
    /// Checks of the cache's entries not verified yet: they go with the
    /// next write, before it.
    checks: Vec<Check>,
    /// Keys claimed by the jobs and not sent yet (`Exec::claim_key`), as
    /// rows of `claim_sql!`'s parameters: they go with the next write.
    claims: Vec<Value>,
    /// Claim keys at once instead (a batch that runs again on fresh reads,
    /// after a claim failed inside a commit).
    pub claim_at_once: bool,
    /// Events handed out in this batch, queued ones included: their seqs
    /// are counted from 0 until the commit's function shifts them.
    seq: i64,
    /// Events already written (by an earlier `send_queue`).
    sent_seq: i64,
    /// The resource of each lease read in this transaction.
    seen: HashMap<String, String>,
    /// Statements sent, for /metrics.
    pub round_trips: u64,
}

fn first_text<'s>(s: &'s Stmt<'_>) -> Option<&'s str> {
    match s.args.first() {
        Some(crate::store::db::Arg::Text(v)) => *v,
        Some(crate::store::db::Arg::Owned(v)) => v.as_deref(),
        _ => None,
    }
}

fn text_at(row: &Value, i: usize) -> String {
    row.get(i).and_then(Value::as_str).unwrap_or("").to_owned()
}

/// The checks as the commit's function reads them.
fn checks_json(checks: &[Check]) -> Value {
    Value::Array(
        checks
            .iter()
            .map(|c| match c {
                Check::Lease { id, version } => json!(["lease", id, version]),
                Check::Free { resource } => json!(["free", resource]),
                Check::Token { resource, last } => json!(["token", resource, last]),
                Check::Ports { owner, ids } => json!(["ports", owner, ids]),
            })
            .collect(),
    )
}

impl<'c> Pipeline<'c> {
    /// For a transaction not begun yet on `conn`.
    pub fn new(conn: &'c mut PgConnection) -> Self {
        Self {
            conn,
            txid: None,
            base: None,
            failed: false,
            marked: false,
            lost: false,
            queue: Queue::default(),
            checks: Vec::new(),
            claims: Vec::new(),
            claim_at_once: false,
            seq: 0,
            sent_seq: 0,
            seen: HashMap::new(),
            round_trips: 0,
        }
    }

    pub fn conn(&mut self) -> &mut PgConnection {
        self.conn
    }

    /// The transaction's id, should its COMMIT's answer be lost; None
    /// while nothing was sent.
    pub fn txid(&self) -> Option<i64> {
        self.txid
    }

    /// BEGIN and take the fleet's lock, followed by `then` (a statement with
    /// its values written in) when there is one, in one round trip: its
    /// rows.
    async fn begin(&mut self, then: Option<String>) -> Result<Vec<PgRow>> {
        let sql = match then {
            Some(then) => format!("{BEGIN}; {then}"),
            None => BEGIN.to_owned(),
        };
        self.round_trips += 1;
        let out = simple(self.conn, sql).await;
        // BEGIN's own result first.
        let mut results = self.note(out)?.into_iter().skip(1);
        self.took_lock(results.next())?;
        Ok(results.next().unwrap_or_default())
    }

    /// The row of the fleet's lock (`BEGIN`): the transaction's id and the
    /// event seq.
    fn took_lock(&mut self, rows: Option<Vec<PgRow>>) -> Result<()> {
        let lock = rows.and_then(|rows| rows.into_iter().next());
        let lock = lock.ok_or_else(|| StoreError::Other("event_seq has no row".into()))?;
        self.txid = Some(lock.int(0)?);
        self.base = Some(lock.int(1)?);
        Ok(())
    }

    async fn begun(&mut self) -> Result<()> {
        if self.txid.is_none() {
            self.begin(None).await?;
        }
        Ok(())
    }

    /// The rows of `s` read with BEGIN, when it is the transaction's first
    /// statement: one round trip fewer for every batch. None when it is
    /// not, or is not one of `PREPARED` (BEGIN then goes alone).
    async fn first(&mut self, s: &Stmt<'_>) -> Result<Option<Vec<PgRow>>> {
        if self.txid.is_some() {
            return Ok(None);
        }
        let prepared = PREPARED.iter().find(|(_, sql)| *sql == s.sql);
        let call = prepared.and_then(|(name, _)| execute(name, &s.args));
        // Queued writes (which need no BEGIN to be queued) go before any read.
        match call.filter(|_| self.queue.is_empty()) {
            Some(sql) => self.begin(Some(sql)).await.map(Some),
            None => self.begin(None).await.map(|_| None),
        }
    }

    fn note<T>(&mut self, out: Result<T>) -> Result<T> {
        self.failed |= out.is_err();
        out
    }

    /// Whether statement `s`, a read, may see what is queued.
    fn sees_queue(&self, s: &Stmt<'_>) -> bool {
        if self.queue.is_empty() {
            return false;
        }
        let key = first_text(s).unwrap_or("");
        if s.sql == LEASE_LOCKED {
            self.queue.leases.contains_key(key)
        } else if s.sql == CURRENT_LOCKED {
            // It reads the resource's token counter too.
            self.queue.unknown_resource
                || self.queue.resources.contains(key)
                || self.queue.token_rows.contains_key(key)
        } else if s.sql == NEXT_TOKEN {
            self.queue.token_rows.contains_key(key)
        } else {
            s.sql != PORTS_OF
        }
    }

    /// The call of `holdfast_write` for the checks and what is queued
    /// (both left empty), `notices` on `channel`, and `marker` (key and
    /// value) if any. Its values are dollar-quoted literals: no escapes
    /// inside, and a tag that none of them contains.
    fn write_call(
        &mut self,
        channel: &str,
        notices: &[Notice],
        marker: Option<(&str, &str)>,
    ) -> String {
        let q = std::mem::take(&mut self.queue);
        let checks = std::mem::take(&mut self.checks);
        let claims = std::mem::take(&mut self.claims);
        let seq_from = self.sent_seq;
        self.sent_seq = self.seq;
        let text = |rows: Vec<Value>| Value::Array(rows).to_string();
        let notices: Vec<Value> = notices.iter().map(|n| json!([n.rest, n.seq])).collect();
        let locking = self.txid.is_some() || marker.is_some();
        let (key, value) = marker.unwrap_or_default();
        let values = [
            checks_json(&checks).to_string(),
            text(q.updates),
            text(q.inserts),
            text(q.events),
            text(q.tokens),
            text(notices),
            channel.to_owned(),
            key.to_owned(),
            value.to_owned(),
            text(claims),
        ];
        let tag = dollar_tag(&values.each_ref().map(String::as_str));
        let [
            checks,
            updates,
            inserts,
            events,
            tokens,
            notices,
            channel,
            key,
            value,
            claims,
        ] = values.map(|v| format!("{tag}{v}{tag}"));
        let (key, value) = match marker {
            Some(_) => (key, value),
            None => ("NULL".to_owned(), "NULL".to_owned()),
        };
        format!(
            "SELECT pg_temp.holdfast_write({checks}::jsonb, {locking}, {updates}::jsonb, {inserts}::jsonb, \
             {events}::jsonb, {tokens}::jsonb, {seq_from}, {channel}, {notices}::jsonb, \
             {key}, {value}, {claims}::jsonb)"
        )
    }

    /// Verify the checks and write what is queued, before a statement that
    /// may see the writes or write itself.
    async fn send_queue(&mut self) -> Result<()> {
        if self.queue.is_empty() && self.checks.is_empty() && self.claims.is_empty() {
            return Ok(());
        }
        let call = self.write_call("", &[], None);
        self.round_trips += 1;
        let out = exec(self.conn, call).await;
        self.note(out)
    }

    /// Verify the checks, write what is queued, send `notices` on
    /// `channel`, and COMMIT, in one round trip; the shift of the batch's
    /// event seqs (see `FUNCTION`), if it could be read. A transaction not begun yet begins in
    /// the same round trip, and records `marker` (its id is not known
    /// before its answer). A batch that only read, from the cache, verifies
    /// its checks in one statement of its own. An error leaves the
    /// transaction open (aborted, when the write failed) for the caller to
    /// roll back.
    pub async fn commit(
        &mut self,
        channel: &str,
        notices: &[Notice],
        marker: (&str, &str),
    ) -> Result<Option<i64>> {
        let writes = !(self.queue.is_empty() && notices.is_empty() && self.claims.is_empty());
        let checked = !self.checks.is_empty();
        let sql = match (self.txid, writes) {
            (None, false) if !checked => return Ok(Some(0)),
            (None, false) => self.write_call(channel, &[], None),
            (Some(_), false) if !checked => "COMMIT".to_owned(),
            (Some(_), _) => {
                let call = self.write_call(channel, notices, None);
                format!("{call}; COMMIT")
            }
            (None, true) => {
                self.marked = true;
                let call = self.write_call(channel, notices, Some(marker));
                format!("{BEGIN}; {call}; COMMIT")
            }
        };
        self.round_trips += 1;
        let out = match simple_raw(self.conn, sql).await {
            Ok(out) => out,
            Err(e) => {
                self.lost = !refused(&e);
                return Err(super::map_err(e));
            }
        };
        // Committed: what follows only tells more. Should it not read
        // (it cannot, short of a bug), the transaction's id and the shift
        // stay unknown (None), not the commit.
        let mut results = out.into_iter();
        if self.marked {
            // BEGIN's, then the lock's.
            results.next();
            let _ = self.took_lock(results.next());
        }
        Ok(
            match results.next().and_then(|rows| rows.into_iter().next()) {
                Some(row) if writes || checked => row.int(0).ok(),
                _ => self.base,
            },
        )
    }

    fn queue_update(&mut self, row: Value) {
        let id = text_at(&row, 0);
        match self.queue.leases.get(&id).copied() {
            Some((true, i)) => {
                if let Some(insert) = self.queue.inserts.get_mut(i) {
                    for (from, to) in UPDATE_INTO_INSERT.into_iter().enumerate() {
                        insert[to] = row[from].clone();
                    }
                }
            }
            Some((false, i)) => self.queue.updates[i] = row,
            None => {
                match self.seen.get(&id) {
                    Some(resource) => {
                        self.queue.resources.insert(resource.clone());
                    }
                    None => self.queue.unknown_resource = true,
                }
                self.queue
                    .leases
                    .insert(id, (false, self.queue.updates.len()));
                self.queue.updates.push(row);
            }
        }
    }

    fn queue_insert(&mut self, row: Value) {
        let (id, resource) = (text_at(&row, 0), text_at(&row, 1));
        self.seen.insert(id.clone(), resource.clone());
        self.queue.resources.insert(resource);
        self.queue
            .leases
            .insert(id, (true, self.queue.inserts.len()));
        self.queue.inserts.push(row);
    }

    /// The row of `key`'s claim by `request_id`, if it is queued still.
    fn queued_claim(&mut self, key: &str, request_id: &str) -> Option<&mut Value> {
        self.claims
            .iter_mut()
            .find(|c| c[0] == key && c[2] == request_id)
    }

    fn queue_token(&mut self, row: Value) {
        let resource = text_at(&row, 0);
        match self.queue.token_rows.get(&resource) {
            Some(&i) => self.queue.tokens[i] = row,
            None => {
                self.queue
                    .token_rows
                    .insert(resource, self.queue.tokens.len());
                self.queue.tokens.push(row);
            }
        }
    }
}

impl Exec for Pipeline<'_> {
    type Row = PgRow;

    fn fetch<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<Vec<PgRow>>> {
        Box::pin(async move {
            let leases = s.sql == LEASE_LOCKED || s.sql == CURRENT_LOCKED;
            let rows = match self.first(&s).await? {
                Some(rows) => rows,
                None => {
                    if self.sees_queue(&s) {
                        self.send_queue().await?;
                    }
                    self.round_trips += 1;
                    let out = self.conn.fetch(s).await;
                    self.note(out)?
                }
            };
            if leases {
                for r in &rows {
                    if let (Some(id), Some(resource)) = (r.opt_text(0)?, r.opt_text(1)?) {
                        self.seen.insert(id, resource);
                    }
                }
            }
            Ok(rows)
        })
    }

    fn execute<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.begun().await?;
            self.send_queue().await?;
            self.round_trips += 1;
            let out = self.conn.execute(s).await;
            self.note(out)
        })
    }

    fn execute_one<'a>(&'a mut self, s: Stmt<'a>, what: String) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.begun().await?;
            self.send_queue().await?;
            self.round_trips += 1;
            let out = self.conn.execute_one(s, what).await;
            self.note(out)
        })
    }

    /// Queued; an update that finds no lease fails the send (and so the
    /// batch), as `execute_one` would have failed the job.
    fn execute_hot<'a>(
        &'a mut self,
        hot: Hot,
        s: Stmt<'a>,
        _what: Option<String>,
    ) -> BoxFuture<'a, Result<()>> {
        let row = json_row(s);
        match hot {
            Hot::LeaseInsert => self.queue_insert(row),
            Hot::LeaseUpdate | Hot::LeaseRenewal => self.queue_update(row),
            Hot::Token => self.queue_token(row),
        }
        Box::pin(async { Ok(()) })
    }

    /// Queued, under the batch's own count (see `FUNCTION`): no round trip
    /// to learn the database's seq first.
    fn append_event<'a>(&'a mut self, at: Millis, body: &'a str) -> BoxFuture<'a, Result<i64>> {
        self.seq += 1;
        self.queue.events.push(json!([self.seq, at, body]));
        let seq = self.seq;
        Box::pin(async move { Ok(seq) })
    }

    fn last_event_seq(&mut self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            self.begun().await?;
            Ok(self.base.unwrap_or(0) + self.seq)
        })
    }

    fn locks_rows(&self) -> bool {
        true
    }

    fn queue_claim(&mut self, claim: &crate::store::KeyClaim<'_>) -> bool {
        if self.claim_at_once {
            return false;
        }
        self.claims
            .push(json_row(crate::store::rows::claim_args(claim)));
        true
    }

    fn created_queued(&mut self, key: &str, request_id: &str) -> bool {
        // The run's column of `claim_sql!`: none, so never taken over.
        self.queued_claim(key, request_id)
            .map(|c| c[5] = Value::Null)
            .is_some()
    }

    fn answer_queued(&mut self, key: &str, request_id: &str, answer: (u16, &str, &str)) -> bool {
        let Some(Value::Array(row)) = self.queued_claim(key, request_id) else {
            return false;
        };
        // After `claim_sql!`'s seven parameters (see `FUNCTION`).
        row.truncate(7);
        row.extend([json!(answer.0), json!(answer.1), json!(answer.2)]);
        true
    }

    fn guard(&mut self, checks: Vec<Check>) {
        self.checks.extend(checks);
    }
}
