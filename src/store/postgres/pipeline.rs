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
use crate::store::db::{Cols, Exec, Hot, Stmt, json_row};
use crate::store::rows::{CURRENT_LOCKED, LEASE_LOCKED, NEXT_TOKEN, PORTS_OF, UPDATE_INTO_INSERT};
use crate::store::sql::lease_cols;
use crate::store::{BoxFuture, Result, StoreError};
use crate::time::Millis;

/// Writes the queued rows of each kind (JSON arrays of rows): lease updates
/// first (an update only keeps a lease current or ends it, and an ended
/// lease must make way before a new current one on its resource is
/// inserted), then lease inserts, events, token counters; moves the event
/// counter to `last_seq` and sends the notifications. A temporary function,
/// created on every connection (`install`): no migration carries it, and a
/// holdfast of another version on the same database never sees it.
const FUNCTION: &str = concat!(
    "CREATE OR REPLACE FUNCTION pg_temp.holdfast_write(
        lease_updates jsonb, lease_inserts jsonb, new_events jsonb, tokens jsonb,
        last_seq bigint, channel text, notices jsonb) RETURNS void LANGUAGE plpgsql AS $fn$
    DECLARE
        u jsonb;
        changed bigint;
    BEGIN
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
        INSERT INTO leases (",
    lease_cols!(),
    ") SELECT j->>0, j->>1, (j->>2)::bigint, j->>3, j->>4, j->>5, j->>6, j->>7,
            (j->>8)::bigint, (j->>9)::bigint, (j->>10)::bigint, (j->>11)::bigint,
            (j->>12)::bigint, (j->>13)::bigint, j->>14, j->>15
            FROM jsonb_array_elements(lease_inserts) AS j;
        INSERT INTO events (seq, at, body) SELECT (j->>0)::bigint, (j->>1)::bigint, j->>2
            FROM jsonb_array_elements(new_events) AS j;
        INSERT INTO resources (resource, last_token) SELECT j->>0, (j->>1)::bigint
            FROM jsonb_array_elements(tokens) AS j
            ON CONFLICT (resource) DO UPDATE SET last_token = excluded.last_token;
        IF last_seq IS NOT NULL THEN
            UPDATE event_seq SET seq = last_seq;
        END IF;
        PERFORM pg_notify(channel, p) FROM jsonb_array_elements_text(notices) AS p;
    END
    $fn$"
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
    Box::pin(async move {
        let mut out = vec![Vec::new()];
        let mut items = sqlx::Executor::fetch_many(conn, sql.as_str());
        while let Some(item) = items.try_next().await.map_err(super::map_err)? {
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
    /// read when it can carry it, else alone.
    txid: Option<i64>,
    /// A statement of the current job failed (which aborts the transaction).
    pub failed: bool,
    queue: Queue,
    /// The last event seq handed out, queued events included.
    seq: i64,
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

impl<'c> Pipeline<'c> {
    /// For a transaction not begun yet on `conn`.
    pub fn new(conn: &'c mut PgConnection) -> Self {
        Self {
            conn,
            txid: None,
            failed: false,
            queue: Queue::default(),
            seq: 0,
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
        let lock = results.next().and_then(|rows| rows.into_iter().next());
        let lock = lock.ok_or_else(|| StoreError::Other("event_seq has no row".into()))?;
        self.txid = Some(lock.int(0)?);
        self.seq = lock.int(1)?;
        Ok(results.next().unwrap_or_default())
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

    /// The call of `holdfast_write` for what is queued (the queue is left
    /// empty) and `notices` (JSON messages) on `channel`. Its values are
    /// dollar-quoted literals: no escapes inside, and a tag that none of
    /// them contains.
    fn write_call(&mut self, channel: &str, notices: &[String]) -> String {
        let q = std::mem::take(&mut self.queue);
        let last_seq = match q.events.is_empty() {
            true => "NULL".to_owned(),
            false => self.seq.to_string(),
        };
        let text = |rows: Vec<Value>| Value::Array(rows).to_string();
        let values = [
            text(q.updates),
            text(q.inserts),
            text(q.events),
            text(q.tokens),
            json!(notices).to_string(),
            channel.to_owned(),
        ];
        let tag = dollar_tag(&values.each_ref().map(String::as_str));
        let [updates, inserts, events, tokens, notices, channel] =
            values.map(|v| format!("{tag}{v}{tag}"));
        format!(
            "SELECT pg_temp.holdfast_write({updates}::jsonb, {inserts}::jsonb, \
             {events}::jsonb, {tokens}::jsonb, {last_seq}, {channel}, {notices}::jsonb)"
        )
    }

    /// Write what is queued, before a statement that may see it.
    async fn send_queue(&mut self) -> Result<()> {
        if self.queue.is_empty() {
            return Ok(());
        }
        let call = self.write_call("", &[]);
        self.round_trips += 1;
        let out = exec(self.conn, call).await;
        self.note(out)
    }

    /// Write what is queued, send `notices` on `channel`, and COMMIT, in one
    /// round trip: one simple query of two statements. An error leaves the
    /// transaction open (aborted, when the write failed) for the caller to
    /// roll back.
    pub async fn commit(&mut self, channel: &str, notices: &[String]) -> Result<()> {
        if self.queue.is_empty() && notices.is_empty() {
            if self.txid.is_none() {
                return Ok(());
            }
            self.round_trips += 1;
            return exec(self.conn, "COMMIT").await;
        }
        self.begun().await?;
        let call = self.write_call(channel, notices);
        self.round_trips += 1;
        exec(self.conn, format!("{call}; COMMIT")).await
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

    fn append_event<'a>(&'a mut self, at: Millis, body: &'a str) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            self.begun().await?;
            self.seq += 1;
            self.queue.events.push(json!([self.seq, at, body]));
            Ok(self.seq)
        })
    }

    fn last_event_seq(&mut self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            self.begun().await?;
            Ok(self.seq)
        })
    }

    fn locks_rows(&self) -> bool {
        true
    }
}
