//! The writer's statements, sent to SQLite in as few round trips as the
//! jobs allow. sqlx runs each SQLite connection on a thread of its own, so
//! every call is a round trip between threads, which costs more than most
//! statements themselves. Statements whose outcome a job does not read
//! (inserts, updates, the transaction's own BEGIN and COMMIT) are queued,
//! and sent with the next statement that returns rows, or with the commit,
//! as one multi-statement query: SQLite runs them in order and stops at the
//! first that fails. Event seqs are handed out here, which the single
//! writer can do, so that appending an event needs no answer.
//!
//! The writes of the hot paths are kept as rows and sent as one statement
//! (see `hot`).

use std::borrow::Cow;

use futures_util::TryStreamExt;
use prometheus_client::metrics::counter::Counter;
use serde_json::{Value, json};
use sqlx::sqlite::SqliteRow;
use sqlx::{Either, Sqlite, SqliteConnection};

use super::hot::{self, EVENTS, KINDS, LEASE_INSERTS, LEASE_UPDATES, TOKENS};
use super::map_err;
use crate::store::db::{Arg, Exec, Hot, Stmt, json_row, query, vanished};
use crate::store::rows::{UPDATE_INTO_INSERT, UPDATE_LEASE};
use crate::store::{BoxFuture, Result, StoreError};
use crate::time::Millis;

/// Sends of up to this many statements stay prepared for the next time,
/// and larger ones whose jobs' statements are all one text.
const KEEP_PREPARED: usize = 8;

/// The owner of a batch's own statements (BEGIN, COMMIT, grouped rows of
/// several jobs), which belong to no one job: when one fails, every job
/// gets its error.
pub const BATCH: usize = usize::MAX;

/// How the writer opens every transaction.
pub const BEGIN: &str = "BEGIN IMMEDIATE";

/// A failed send: the job that queued the statement that failed, and why.
#[derive(Debug)]
pub struct Failed {
    pub owner: usize,
    pub error: StoreError,
}

/// A queued statement, with its parameters numbered from `$1`.
#[derive(Debug)]
struct Item {
    sql: Cow<'static, str>,
    args: Vec<Arg<'static>>,
    /// The job that queued it.
    owner: usize,
    /// For one that must change so many rows, and what vanished otherwise.
    must_change: Option<(u64, String)>,
}

impl Item {
    fn raw(sql: &'static str, owner: usize) -> Self {
        Self {
            sql: Cow::Borrowed(sql),
            args: Vec::new(),
            owner,
            must_change: None,
        }
    }
}

pub struct Pipeline<'c> {
    conn: &'c mut SqliteConnection,
    items: Vec<Item>,
    /// Grouped rows of each kind, with the job that wrote each.
    groups: [Vec<(usize, Value)>; 4],
    /// The job whose statements are being queued now.
    pub owner: usize,
    /// The job whose queued statement failed in the last failed send made
    /// for a job's own read (which returns only the error to that job).
    pub failed_owner: Option<usize>,
    /// The last event seq handed out, queued events included.
    pub seq: i64,
    /// Sends so far.
    sends: u64,
    /// Counts every send, for /metrics.
    trips: Option<Counter>,
    /// Where the current job's statements begin, if it gets a savepoint
    /// there when it first sends (see `begin_job`), and the job.
    savepoint_at: Option<(Mark, usize)>,
}

/// The pipeline at one moment, to go back to.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    items: usize,
    groups: [usize; 4],
    sends: u64,
    seq: i64,
}

/// `sql` with every `$N` parameter renumbered to `$(N + by)`. The shared
/// statements use `$` for nothing else.
fn shift(sql: &str, by: usize) -> String {
    if by == 0 {
        return sql.to_owned();
    }
    let mut out = String::with_capacity(sql.len() + 8);
    let mut rest = sql;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..=i]);
        rest = &rest[i + 1..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        match rest[..digits].parse::<usize>() {
            Ok(n) => out.push_str(&(n + by).to_string()),
            Err(_) => out.push_str(&rest[..digits]),
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    out
}

fn owned(a: Arg<'_>) -> Arg<'static> {
    match a {
        Arg::Text(v) => Arg::Owned(v.map(str::to_owned)),
        Arg::Owned(v) => Arg::Owned(v),
        Arg::Int(v) => Arg::Int(v),
        Arg::Bool(v) => Arg::Bool(v),
    }
}

/// A JSON row as the parameters of the one-row statement. SQLite's NULL
/// has no type, so a null needs none either.
fn row_args(row: Value) -> Vec<Arg<'static>> {
    let arg = |v: Value| match v {
        Value::String(s) => Arg::Owned(Some(s)),
        Value::Number(n) => Arg::Int(n.as_i64()),
        Value::Bool(b) => Arg::Bool(b),
        _ => Arg::Int(None),
    };
    match row {
        Value::Array(values) => values.into_iter().map(arg).collect(),
        one => vec![arg(one)],
    }
}

/// Of rows keyed by their first value, the last of each key, in order.
fn last_of_each(rows: Vec<(usize, Value)>) -> Vec<(usize, Value)> {
    let mut last = std::collections::HashMap::new();
    for (i, (_, r)) in rows.iter().enumerate() {
        last.insert(r[0].to_string(), i);
    }
    rows.into_iter()
        .enumerate()
        .filter(|(i, (_, r))| last.get(&r[0].to_string()) == Some(i))
        .map(|(_, row)| row)
        .collect()
}

/// The one statement writing `rows` (of each kind). A lease updated
/// twice, or a counter set twice, needs only its last row: each row is the
/// whole state.
fn hot_item(mut rows: [Vec<(usize, Value)>; 4]) -> Item {
    if rows[LEASE_UPDATES].len() == 1 && rows.iter().map(Vec::len).sum::<usize>() == 1 {
        // A lone renewal: the plain statement, without JSON or the trigger.
        let (owner, row) = rows[LEASE_UPDATES].remove(0);
        return Item {
            sql: Cow::Borrowed(UPDATE_LEASE),
            args: row_args(row),
            owner,
            must_change: Some((1, "a lease".into())),
        };
    }
    let mut owners = rows.iter().flatten().map(|r| r.0);
    let first = owners.next().unwrap_or(BATCH);
    let owner = if owners.all(|o| o == first) {
        first
    } else {
        BATCH
    };
    let mut expected = 0;
    let mut args: Vec<Arg<'static>> = Vec::with_capacity(5);
    for (kind, rows) in rows.into_iter().enumerate() {
        let rows = match kind {
            LEASE_UPDATES | TOKENS => last_of_each(rows),
            _ => rows,
        };
        if kind == LEASE_UPDATES {
            expected = rows.len() as i64;
        }
        let array = (!rows.is_empty())
            .then(|| Value::Array(rows.into_iter().map(|r| r.1).collect()).to_string());
        args.push(Arg::Owned(array));
    }
    args.push(Arg::Int(Some(expected)));
    Item {
        sql: Cow::Borrowed(hot::WRITE),
        args,
        owner,
        must_change: None,
    }
}

impl<'c> Pipeline<'c> {
    pub fn new(conn: &'c mut SqliteConnection, seq: i64) -> Self {
        Self {
            conn,
            items: Vec::new(),
            groups: Default::default(),
            owner: 0,
            failed_owner: None,
            seq,
            sends: 0,
            trips: None,
            savepoint_at: None,
        }
    }

    /// Counting every send in `trips` too.
    pub fn counted(mut self, trips: &Counter) -> Self {
        self.trips = Some(trips.clone());
        self
    }

    /// The statements queued from now on are job `owner`'s. With
    /// `savepoint`, the first send that carries any of them first sets a
    /// savepoint where they begin, so that the job can be undone alone
    /// once SQLite has seen some of it. A job that sends nothing never gets
    /// one: it is undone by forgetting what it queued (`undo_to`).
    pub fn begin_job(&mut self, owner: usize, savepoint: bool) -> Mark {
        self.owner = owner;
        self.failed_owner = None;
        let mark = self.mark();
        self.savepoint_at = savepoint.then_some((mark, owner));
        mark
    }

    pub fn mark(&self) -> Mark {
        Mark {
            items: self.items.len(),
            groups: self.groups.each_ref().map(Vec::len),
            sends: self.sends,
            seq: self.seq,
        }
    }

    /// Forget what was queued since `mark`, and the seqs handed out since.
    /// True when nothing was sent since, so the database never saw it;
    /// false when some of it was sent (the queue is then cleared).
    pub fn undo_to(&mut self, mark: Mark) -> bool {
        self.seq = mark.seq;
        if self.sends != mark.sends {
            self.clear();
            return false;
        }
        // Rows grouped before the mark may since have become statements,
        // placed in front of the savepoint's place (see `place`), which
        // then counts them.
        let (items, groups) = match self.savepoint_at {
            Some((at, _)) if at.sends == mark.sends => (at.items, at.groups),
            _ => (mark.items, mark.groups),
        };
        self.items.truncate(items);
        for (group, len) in self.groups.iter_mut().zip(groups) {
            group.truncate(len);
        }
        self.savepoint_at = None;
        true
    }

    /// Queue a statement without parameters.
    pub fn queue_raw(&mut self, sql: &'static str) {
        self.items.push(Item::raw(sql, self.owner));
    }

    /// `s` as a statement of the current job.
    fn item(&self, s: Stmt<'_>, must_change_one: Option<String>) -> Item {
        Item {
            sql: Cow::Owned(s.sql.to_owned()),
            args: s.args.into_iter().map(owned).collect(),
            owner: self.owner,
            must_change: must_change_one.map(|what| (1, what)),
        }
    }

    fn queue(&mut self, s: Stmt<'_>, must_change_one: Option<String>) {
        let item = self.item(s, must_change_one);
        self.items.push(item);
    }

    /// Forget what is queued.
    pub fn clear(&mut self) {
        self.items.clear();
        self.groups = Default::default();
        self.savepoint_at = None;
    }

    /// Turn the grouped rows of `kinds` into a statement, in order with
    /// the queue: rows written before the current job's savepoint go in
    /// front of it (so that undoing the job cannot undo them), the job's own
    /// after.
    fn place(&mut self, kinds: &[usize]) {
        let mut rows: [Vec<(usize, Value)>; 4] = Default::default();
        for &kind in kinds {
            rows[kind] = std::mem::take(&mut self.groups[kind]);
        }
        if rows.iter().all(Vec::is_empty) {
            return;
        }
        if let Some((at, _)) = &mut self.savepoint_at
            && at.sends == self.sends
        {
            let mut before: [Vec<(usize, Value)>; 4] = Default::default();
            for &kind in kinds {
                let n = at.groups[kind].min(rows[kind].len());
                before[kind] = rows[kind].drain(..n).collect();
                at.groups[kind] = 0;
            }
            if before.iter().any(|r| !r.is_empty()) {
                self.items.insert(at.items, hot_item(before));
                at.items += 1;
            }
        }
        if rows.iter().any(|r| !r.is_empty()) {
            self.items.push(hot_item(rows));
        }
    }

    /// Send everything queued as one query.
    pub async fn send(&mut self) -> Result<Vec<SqliteRow>, Failed> {
        self.send_with(None).await
    }

    /// Send everything queued, then `tail`, as one query: the rows it returned.
    async fn send_with(&mut self, tail: Option<Item>) -> Result<Vec<SqliteRow>, Failed> {
        self.place(&KINDS);
        if let Some((at, owner)) = self.savepoint_at.take()
            && at.sends == self.sends
        {
            self.items
                .insert(at.items, Item::raw("SAVEPOINT job", owner));
        }
        self.items.extend(tail);
        if self.items.is_empty() {
            return Ok(Vec::new());
        }
        let items = std::mem::take(&mut self.items);
        self.sends += 1;
        if let Some(t) = &self.trips {
            t.inc();
        }
        let mut sql = String::new();
        let mut args = Vec::new();
        let mut first_text: Option<&str> = None;
        let mut mixed = false;
        for item in &items {
            if item.owner != BATCH && !item.sql.starts_with("SAVEPOINT") {
                match first_text {
                    None => first_text = Some(&item.sql),
                    Some(first) => mixed |= first != item.sql,
                }
            }
            sql.push_str(&shift(&item.sql, args.len()));
            sql.push_str(";\n");
            args.extend(item.args.iter().cloned());
        }
        let keep = items.len() <= KEEP_PREPARED || !mixed;
        let mut rows = Vec::new();
        let mut done = 0;
        // Deprecated as an interface common to all drivers (sqlx#3108): only
        // SQLite runs several statements of one prepared query, each result
        // in turn, which is what this needs. Pinned by the writer's tests.
        #[allow(deprecated)]
        let mut results = query::<Sqlite>(&sql, args)
            .persistent(keep)
            .fetch_many(&mut *self.conn);
        loop {
            let item = match results.try_next().await {
                Ok(Some(item)) => item,
                Ok(None) => break,
                Err(e) => {
                    return Err(Failed {
                        owner: items.get(done).map_or(BATCH, |q| q.owner),
                        error: map_err(e),
                    });
                }
            };
            match item {
                Either::Right(row) => rows.push(row),
                Either::Left(result) => {
                    if let Some(q) = items.get(done)
                        && let Some((n, what)) = &q.must_change
                        && let Err(error) = vanished(what, result.rows_affected(), *n)
                    {
                        return Err(Failed {
                            owner: q.owner,
                            error,
                        });
                    }
                    done += 1;
                    // The last statement's result is the last item: not
                    // waiting for the channel to close saves a wake-up.
                    if done == items.len() {
                        break;
                    }
                }
            }
        }
        Ok(rows)
    }

    /// Whether the transaction, about to commit, is made only of hot
    /// writes, nothing of it sent yet: its BEGIN is then dropped and the
    /// one statement runs on its own, in a transaction of its own, which
    /// SQLite commits as it would the whole (atomically, at the same sync
    /// level). Two statements less, and their wake-ups: a lone renewal's
    /// (whose one row goes as the plain UPDATE), acquire's or release's,
    /// and whole batches of them.
    fn lone_write(&mut self) -> bool {
        let pragmas = self
            .items
            .iter()
            .take_while(|i| i.sql.starts_with("PRAGMA"))
            .count();
        let lone = self.sends == 0
            && self.savepoint_at.is_none()
            && matches!(&self.items[pragmas..], [begin, write]
                if begin.sql == BEGIN && (write.sql == hot::WRITE || write.sql == UPDATE_LEASE));
        if lone {
            self.items.remove(pragmas);
        }
        lone
    }

    /// Forget what is queued and roll the transaction back. Its outcome
    /// does not matter: SQLite may already have rolled back by itself.
    pub async fn rollback(&mut self) {
        self.clear();
        let _ = self.finish("ROLLBACK").await;
    }

    /// Send what is queued, then the statement `sql` (COMMIT).
    pub async fn finish(&mut self, sql: &'static str) -> Result<Vec<SqliteRow>, Failed> {
        self.place(&KINDS);
        if sql == "COMMIT" && self.lone_write() {
            return self.send_with(None).await;
        }
        self.send_with(Some(Item::raw(sql, BATCH))).await
    }

    fn group(&mut self, kind: usize, row: Value) {
        self.groups[kind].push((self.owner, row));
    }

    /// An update of a lease. Updates are sent before inserts, so an update
    /// of a lease whose insert is still queued changes that insert's row
    /// instead (when the same job queued it), or first turns what is queued
    /// into statements.
    fn group_update(&mut self, update: Value) {
        let owner = self.owner;
        let queued = self.groups[LEASE_INSERTS]
            .iter_mut()
            .rev()
            .find(|(_, r)| r[0] == update[0]);
        match queued {
            Some((o, insert)) if *o == owner => {
                for (from, to) in UPDATE_INTO_INSERT.into_iter().enumerate() {
                    insert[to] = update[from].clone();
                }
            }
            Some(_) => {
                self.place(&KINDS);
                self.group(LEASE_UPDATES, update);
            }
            None => self.group(LEASE_UPDATES, update),
        }
    }
}

impl Exec for Pipeline<'_> {
    type Row = SqliteRow;

    fn fetch<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<Vec<SqliteRow>>> {
        let tail = self.item(s, None);
        Box::pin(async move {
            self.send_with(Some(tail)).await.map_err(|f| {
                self.failed_owner = Some(f.owner);
                f.error
            })
        })
    }

    fn execute<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<()>> {
        self.queue(s, None);
        Box::pin(std::future::ready(Ok(())))
    }

    fn execute_one<'a>(&'a mut self, s: Stmt<'a>, what: String) -> BoxFuture<'a, Result<()>> {
        self.queue(s, Some(what));
        Box::pin(std::future::ready(Ok(())))
    }

    fn append_event<'a>(&'a mut self, at: Millis, body: &'a str) -> BoxFuture<'a, Result<i64>> {
        self.seq += 1;
        let seq = self.seq;
        self.group(EVENTS, json!([seq, at, body]));
        Box::pin(std::future::ready(Ok(seq)))
    }

    /// Queued events first become statements, so that a statement queued
    /// after this (retention's DELETE) runs after them.
    fn last_event_seq(&mut self) -> BoxFuture<'_, Result<i64>> {
        self.place(&[EVENTS]);
        Box::pin(std::future::ready(Ok(self.seq)))
    }

    /// Kept as a row of its kind's group. A lease is only updated after
    /// it was read in the same transaction; the group still checks that
    /// each of its leases was there.
    fn execute_hot<'a>(
        &'a mut self,
        hot: Hot,
        s: Stmt<'a>,
        _what: Option<String>,
    ) -> BoxFuture<'a, Result<()>> {
        let row = json_row(s);
        match hot {
            Hot::LeaseInsert => self.group(LEASE_INSERTS, row),
            Hot::LeaseUpdate => self.group_update(row),
            Hot::Token => self.group(TOKENS, row),
        }
        Box::pin(std::future::ready(Ok(())))
    }
}

#[cfg(test)]
mod tests {
    use super::shift;

    #[test]
    fn parameters_are_renumbered_and_nothing_else_changes() {
        assert_eq!(
            shift("UPDATE t SET a = $1, b = $12 WHERE id = $2", 3),
            "UPDATE t SET a = $4, b = $15 WHERE id = $5"
        );
        assert_eq!(shift("SELECT $1", 0), "SELECT $1");
        assert_eq!(shift("no parameters", 7), "no parameters");
        assert_eq!(shift("a lone $ stays", 2), "a lone $ stays");
    }

    #[tokio::test]
    async fn only_a_transaction_of_hot_writes_goes_without_begin_and_commit() {
        use crate::store::db::{Exec, Hot, Stmt};
        use crate::store::rows::{SET_TOKEN, UPDATE_LEASE};
        use sqlx::Connection;
        let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .expect("open");
        let mut p = super::Pipeline::new(&mut conn, 0);
        p.queue_raw("PRAGMA synchronous = FULL");
        p.queue_raw(super::BEGIN);
        p.execute_hot(Hot::LeaseUpdate, Stmt::new(UPDATE_LEASE), None)
            .await
            .expect("queued");
        p.execute_hot(Hot::Token, Stmt::new(SET_TOKEN), None)
            .await
            .expect("queued");
        p.append_event(1, "{}").await.expect("queued");
        p.place(&super::KINDS);
        assert!(p.lone_write());
        let sent: Vec<&str> = p.items.iter().map(|i| &*i.sql).collect();
        assert_eq!(sent, ["PRAGMA synchronous = FULL", super::hot::WRITE]);

        p.clear();
        p.queue_raw(super::BEGIN);
        p.execute(Stmt::new("DELETE FROM meta"))
            .await
            .expect("queued");
        p.execute_hot(Hot::Token, Stmt::new(SET_TOKEN), None)
            .await
            .expect("queued");
        p.place(&super::KINDS);
        assert!(!p.lone_write(), "another statement needs the transaction");
        assert_eq!(p.items.len(), 3);
    }
}
