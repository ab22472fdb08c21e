//! What the two databases differ in, in one place. Statements are written
//! once, with `$N` parameters (which sqlx's SQLite driver reads as `?N`),
//! as a `Stmt` of plain values; each driver binds those values and decodes
//! columns (`Cols`) its own way, and maps its errors to `StoreError`.

use sqlx::Database;

use super::{BoxFuture, Result, StoreError};
use crate::model::KeyClaim;
use crate::time::Millis;

/// A parameter value, as every statement of the stores binds it.
#[derive(Debug, Clone)]
pub enum Arg<'a> {
    Text(Option<&'a str>),
    Owned(Option<String>),
    Int(Option<i64>),
    Bool(bool),
}

/// One statement and its parameters, `$1` first.
#[derive(Debug)]
pub struct Stmt<'a> {
    pub sql: &'a str,
    pub args: Vec<Arg<'a>>,
}

impl<'a> Stmt<'a> {
    pub fn new(sql: &'a str) -> Self {
        Self {
            sql,
            args: Vec::new(),
        }
    }

    pub fn text(mut self, v: &'a str) -> Self {
        self.args.push(Arg::Text(Some(v)));
        self
    }

    pub fn opt_text(mut self, v: Option<&'a str>) -> Self {
        self.args.push(Arg::Text(v));
        self
    }

    pub fn owned(mut self, v: Option<String>) -> Self {
        self.args.push(Arg::Owned(v));
        self
    }

    pub fn int(mut self, v: i64) -> Self {
        self.args.push(Arg::Int(Some(v)));
        self
    }

    pub fn opt_int(mut self, v: Option<i64>) -> Self {
        self.args.push(Arg::Int(v));
        self
    }

    pub fn flag(mut self, v: bool) -> Self {
        self.args.push(Arg::Bool(v));
        self
    }
}

/// A statement's parameters as a JSON row, for a statement that writes
/// many such rows at once (the writers' grouped hot writes).
pub fn json_row(s: Stmt<'_>) -> serde_json::Value {
    use serde_json::json;
    let value = |a: Arg<'_>| match a {
        Arg::Text(v) => json!(v),
        Arg::Owned(v) => json!(v),
        Arg::Int(v) => json!(v),
        Arg::Bool(v) => json!(v),
    };
    serde_json::Value::Array(s.args.into_iter().map(value).collect())
}

/// The columns of a row, as the records use them.
pub trait Cols {
    fn opt_text(&self, i: usize) -> Result<Option<String>>;
    fn opt_int(&self, i: usize) -> Result<Option<i64>>;
    fn flag(&self, i: usize) -> Result<bool>;

    fn text(&self, i: usize) -> Result<String> {
        self.opt_text(i)?.ok_or_else(|| null_column(i))
    }

    fn int(&self, i: usize) -> Result<i64> {
        self.opt_int(i)?.ok_or_else(|| null_column(i))
    }
}

fn null_column(i: usize) -> StoreError {
    StoreError::Other(format!("column {i} is null where a value is required"))
}

/// Where the shared statements run: a connection of either database,
/// SQLite's writer (`sqlite::direct`), or PostgreSQL's, which defers what
/// it may (see `postgres::pipeline`).
pub trait Exec: Send {
    type Row: Cols + Send;
    fn fetch<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<Vec<Self::Row>>>;
    /// Run a statement whose outcome the caller does not read; it may be
    /// run later, with the next fetch or the commit, which then fail with it.
    fn execute<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<()>>;
    /// As `execute`, for a statement that must change exactly one row:
    /// otherwise it fails, saying `what` vanished.
    fn execute_one<'a>(&'a mut self, s: Stmt<'a>, what: String) -> BoxFuture<'a, Result<()>>;
    /// Append an event under the next seq and return it: in the fleet's
    /// count, or in the batch's, shifted at commit (PostgreSQL's writer,
    /// `postgres::pipeline`).
    fn append_event<'a>(&'a mut self, at: Millis, body: &'a str) -> BoxFuture<'a, Result<i64>>;
    /// The last seq handed out (which retention never lowers).
    fn last_event_seq(&mut self) -> BoxFuture<'_, Result<i64>>;
    /// Whether reads of rows this transaction may change must lock them
    /// (`FOR UPDATE`): true where writes outside it can reach the same
    /// rows (PostgreSQL's one-statement renewals); SQLite's single writer
    /// has none.
    fn locks_rows(&self) -> bool {
        false
    }

    /// Verify `checks` (of entries of the writer's cache that an earlier
    /// transaction left, `cache::Check`) before this transaction writes
    /// anything: a store with a guarded cache (PostgreSQL's) fails the
    /// transaction with `StoreError::Stale` when one does not hold.
    fn guard(&mut self, checks: Vec<super::cache::Check>) {
        let _ = checks;
    }

    /// Queue a request's key claim with the transaction's writes, where
    /// the store checks claims inside its commit (PostgreSQL's writer: one
    /// that finds the key held fails the transaction as
    /// `StoreError::Stale`, so that its jobs run again on fresh reads,
    /// which claim at once): true if queued. Else the caller claims now
    /// (`rows::claim_key`).
    fn queue_claim(&mut self, claim: &KeyClaim<'_>) -> bool {
        let _ = claim;
        false
    }

    /// Mark the queued claim of `key` by `request_id`, if there is one, as
    /// having created a record (`rows::key_created`): true if there was.
    fn created_queued(&mut self, key: &str, request_id: &str) -> bool {
        let _ = (key, request_id);
        false
    }

    /// Keep `answer` with the queued claim of `key` by `request_id`, if
    /// there is one, to be written with it (`rows::answer_key`): true if
    /// there was.
    fn answer_queued(&mut self, key: &str, request_id: &str, answer: (u16, &str, &str)) -> bool {
        let _ = (key, request_id, answer);
        false
    }

    /// As `execute`, or `execute_one` with `what`, for a write of kind
    /// `hot`, which PostgreSQL's writer sends grouped with others of its
    /// kind, and SQLite's may narrow (`Hot::LeaseRenewal`).
    fn execute_hot<'a>(
        &'a mut self,
        hot: Hot,
        s: Stmt<'a>,
        what: Option<String>,
    ) -> BoxFuture<'a, Result<()>> {
        let _ = hot;
        self.execute_checked(s, what)
    }

    /// `execute_one` with `what`, else `execute`.
    fn execute_checked<'a>(
        &'a mut self,
        s: Stmt<'a>,
        what: Option<String>,
    ) -> BoxFuture<'a, Result<()>> {
        match what {
            Some(what) => self.execute_one(s, what),
            None => self.execute(s),
        }
    }
}

/// The writes the hot paths make again and again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hot {
    /// `rows::INSERT_LEASE`.
    LeaseInsert,
    /// `rows::UPDATE_LEASE`.
    LeaseUpdate,
    /// `rows::UPDATE_LEASE` of a lease whose TTL, expiry and renewal time
    /// alone change: a store may write those columns only
    /// (`rows::RENEW_LEASE`).
    LeaseRenewal,
    /// `rows::SET_TOKEN`.
    Token,
}

/// One of the two databases.
pub trait Db: Database<Connection: Exec> {
    /// As `/readyz` names the store.
    const KIND: &'static str;
    /// Renewals may be answered before they reach stable storage (a
    /// single-host store that stretches TTLs after a crash instead).
    const RELAXED_RENEWALS: bool;
    /// A keyed request's answer (or the release of its key) is written by
    /// one statement of its own, outside the write transactions
    /// (`Backend::settle_key`).
    const KEYS_SETTLED_ALONE: bool;
    /// Servers of other runs may be using the database at the same time
    /// (a fleet); else one server at a time holds it, and every run but
    /// its own has ended.
    const SHARED: bool;
}

/// A statement that changed `n` rows where it had to change `expected`.
pub fn vanished(what: &str, n: u64, expected: u64) -> Result<()> {
    if n == expected {
        Ok(())
    } else {
        Err(StoreError::Other(format!("{what} vanished during update")))
    }
}

/// For a failure to get a connection from `pool`: the database cannot be
/// reached, unless every connection is merely in use. (sqlx answers a
/// refused connect it kept retrying with the same timeout as a full pool.)
pub fn conn_err<D: Database>(pool: &sqlx::Pool<D>, e: sqlx::Error) -> StoreError {
    match e {
        sqlx::Error::PoolTimedOut if pool.size() >= pool.options().get_max_connections() => {
            StoreError::Busy
        }
        e => StoreError::Unavailable(format!("cannot reach the database: {e}")),
    }
}

/// Bind `args` to `sql` for a driver whose value types include these.
pub(crate) fn query<'q, D>(
    sql: &'q str,
    args: Vec<Arg<'q>>,
) -> sqlx::query::Query<'q, D, <D as Database>::Arguments<'q>>
where
    D: Database,
    Option<&'q str>: sqlx::Encode<'q, D> + sqlx::Type<D>,
    Option<String>: sqlx::Encode<'q, D> + sqlx::Type<D>,
    Option<i64>: sqlx::Encode<'q, D> + sqlx::Type<D>,
    bool: sqlx::Encode<'q, D> + sqlx::Type<D>,
{
    let mut q = sqlx::query(sql);
    for a in args {
        q = match a {
            Arg::Text(v) => q.bind(v),
            Arg::Owned(v) => q.bind(v),
            Arg::Int(v) => q.bind(v),
            Arg::Bool(v) => q.bind(v),
        };
    }
    q
}

/// One row of one column.
pub async fn scalar<E: Exec + ?Sized>(c: &mut E, s: Stmt<'_>) -> Result<Option<i64>> {
    match c.fetch(s).await?.first() {
        Some(r) => r.opt_int(0),
        None => Ok(None),
    }
}

pub(crate) fn decode_err(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Other(format!("stored {what} does not decode: {e}"))
}

pub(crate) fn from_json<T: serde::de::DeserializeOwned>(
    what: &str,
    s: Option<String>,
) -> Result<Option<T>> {
    s.map(|s| serde_json::from_str(&s))
        .transpose()
        .map_err(|e| decode_err(what, e))
}

pub(crate) fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| StoreError::Other(e.to_string()))
}
