//! The writer's connection, called on the task that runs a batch. sqlx runs
//! each SQLite connection on a thread of its own, and every call there is a
//! hand-off between threads and back, two wake-ups that cost more than the
//! statements themselves (`perf` of renewals at C=1: half of the server's
//! CPU in the scheduler). Through rusqlite a statement runs where it is
//! called: a lone request runs from its socket to its commit on one thread.
//! The thread waits for the commit's fsync, as sqlx's would; only one batch
//! runs at a time, so at most one runtime thread waits so.

use std::path::Path;
use std::time::Duration;

use rusqlite::types::Value;
use rusqlite::{Connection, OpenFlags};

use crate::store::db::{Arg, Cols, Exec, Hot, Stmt, vanished};
use crate::store::rows::{RENEW_LEASE, insert_event};
use crate::store::{BoxFuture, Result, StoreError};
use crate::time::Millis;

/// Statements stay prepared: the writer runs a few dozen texts again and again.
const PREPARED: usize = 256;

pub struct Direct {
    conn: Connection,
    /// The last event seq handed out. The single writer hands them out
    /// itself, so that appending an event reads nothing.
    pub seq: i64,
}

/// A row, read out of its statement.
pub struct Row(Vec<Value>);

fn map_err(e: rusqlite::Error) -> StoreError {
    match &e {
        rusqlite::Error::SqliteFailure(f, _) => super::by_code(f.extended_code, &e),
        _ => StoreError::Other(e.to_string()),
    }
}

/// The number `N` of a parameter named `$N` (or `?N`), as sqlx's SQLite
/// driver reads the shared statements' parameters.
fn parameter_number(name: &str) -> Option<usize> {
    name.strip_prefix(['$', '?'])?.parse().ok()
}

impl Direct {
    /// Open the database at `path`, which exists and is migrated.
    pub fn open(path: &Path, busy_timeout: Duration, seq: i64) -> Result<Self> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags)
            .map_err(|e| StoreError::Unavailable(format!("opening {}: {e}", path.display())))?;
        conn.busy_timeout(busy_timeout).map_err(map_err)?;
        conn.set_prepared_statement_cache_capacity(PREPARED);
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA temp_store = MEMORY",
        )
        .map_err(map_err)?;
        Ok(Self { conn, seq })
    }

    /// Run `sql`, one statement without parameters (kept prepared, as
    /// the others: BEGIN, SAVEPOINT and the like cost a parse each otherwise).
    pub fn batch(&mut self, sql: &str) -> Result<()> {
        self.run(Stmt::new(sql)).map(|_| ())
    }

    /// A transaction is open (SQLite ends one by itself on some errors:
    /// disk full, I/O).
    pub fn in_transaction(&self) -> bool {
        !self.conn.is_autocommit()
    }

    /// Run `s` to its end: the rows it returned and the rows it changed.
    pub fn run(&mut self, s: Stmt<'_>) -> Result<(Vec<Row>, u64)> {
        let mut stmt = self.conn.prepare_cached(s.sql).map_err(map_err)?;
        for i in 1..=stmt.parameter_count() {
            let n = match stmt.parameter_name(i) {
                Some(name) => parameter_number(name).ok_or_else(|| {
                    StoreError::Other(format!("parameter {name} of a statement is not $N"))
                })?,
                None => i,
            };
            let arg = s.args.get(n - 1).ok_or_else(|| {
                StoreError::Other(format!("statement parameter ${n} has no value"))
            })?;
            match arg {
                Arg::Text(v) => stmt.raw_bind_parameter(i, v),
                Arg::Owned(v) => stmt.raw_bind_parameter(i, v),
                Arg::Int(v) => stmt.raw_bind_parameter(i, v),
                Arg::Bool(v) => stmt.raw_bind_parameter(i, v),
            }
            .map_err(map_err)?;
        }
        let width = stmt.column_count();
        let mut found = Vec::new();
        let mut rows = stmt.raw_query();
        while let Some(row) = rows.next().map_err(map_err)? {
            let values = (0..width)
                .map(|i| row.get::<_, Value>(i))
                .collect::<rusqlite::Result<_>>()
                .map_err(map_err)?;
            found.push(Row(values));
        }
        drop(rows);
        Ok((found, self.conn.changes()))
    }
}

fn column(row: &Row, i: usize) -> Result<&Value> {
    row.0
        .get(i)
        .ok_or_else(|| StoreError::Other(format!("a row has no column {i}")))
}

fn mistyped(i: usize, v: &Value) -> StoreError {
    StoreError::Other(format!("column {i} holds {:?}", v.data_type()))
}

impl Cols for Row {
    fn opt_text(&self, i: usize) -> Result<Option<String>> {
        match column(self, i)? {
            Value::Null => Ok(None),
            Value::Text(t) => Ok(Some(t.clone())),
            v => Err(mistyped(i, v)),
        }
    }

    fn opt_int(&self, i: usize) -> Result<Option<i64>> {
        match column(self, i)? {
            Value::Null => Ok(None),
            Value::Integer(n) => Ok(Some(*n)),
            v => Err(mistyped(i, v)),
        }
    }

    fn flag(&self, i: usize) -> Result<bool> {
        match column(self, i)? {
            Value::Integer(n) => Ok(*n != 0),
            v => Err(mistyped(i, v)),
        }
    }
}

impl Exec for Direct {
    type Row = Row;

    fn fetch<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<Vec<Row>>> {
        Box::pin(std::future::ready(self.run(s).map(|(rows, _)| rows)))
    }

    fn execute<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<()>> {
        Box::pin(std::future::ready(self.run(s).map(|_| ())))
    }

    fn execute_one<'a>(&'a mut self, s: Stmt<'a>, what: String) -> BoxFuture<'a, Result<()>> {
        let done = self.run(s).and_then(|(_, n)| vanished(&what, n, 1));
        Box::pin(std::future::ready(done))
    }

    fn append_event<'a>(&'a mut self, at: Millis, body: &'a str) -> BoxFuture<'a, Result<i64>> {
        let seq = self.seq + 1;
        let done = self.run(insert_event(seq, at, body)).map(|_| {
            self.seq = seq;
            seq
        });
        Box::pin(std::future::ready(done))
    }

    fn last_event_seq(&mut self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(std::future::ready(Ok(self.seq)))
    }

    fn execute_hot<'a>(
        &'a mut self,
        hot: Hot,
        s: Stmt<'a>,
        what: Option<String>,
    ) -> BoxFuture<'a, Result<()>> {
        let s = match hot {
            Hot::LeaseRenewal => Stmt {
                sql: RENEW_LEASE,
                args: s.args,
            },
            Hot::LeaseUpdate | Hot::LeaseInsert | Hot::Token => s,
        };
        self.execute_checked(s, what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn direct() -> (Direct, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.db");
        Connection::open(&path).expect("create");
        let d = Direct::open(&path, Duration::from_secs(1), 0).expect("open");
        (d, dir)
    }

    #[test]
    fn parameters_are_bound_by_their_number_wherever_they_stand() {
        let (mut d, _dir) = direct();
        let s = Stmt::new("SELECT $2, $1, $2 + 1, $3, $4")
            .text("a")
            .int(7)
            .flag(true)
            .opt_text(None);
        let (rows, _) = d.run(s).expect("run");
        let row = &rows[0];
        assert_eq!(row.int(0).expect("$2"), 7);
        assert_eq!(row.text(1).expect("$1"), "a");
        assert_eq!(row.int(2).expect("$2 + 1"), 8);
        assert!(row.flag(3).expect("$3"));
        assert_eq!(row.opt_text(4).expect("$4"), None);
        assert!(row.int(1).is_err(), "text is not read as a number");
        assert!(row.text(4).is_err(), "null is not read as text");
    }

    #[test]
    fn a_statement_short_of_values_fails_instead_of_binding_null() {
        let (mut d, _dir) = direct();
        let err = d.run(Stmt::new("SELECT $1, $2").int(1)).err();
        assert!(matches!(err, Some(StoreError::Other(e)) if e.contains("$2")));
    }
}
