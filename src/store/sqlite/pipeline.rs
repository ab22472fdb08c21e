//! The writer's statements, sent to SQLite in as few round trips as the
//! jobs allow. sqlx runs each SQLite connection on a thread of its own, so
//! every call is a round trip between threads, which costs more than most
//! statements themselves. Statements whose outcome a job does not read
//! (inserts, updates, the transaction's own BEGIN, SAVEPOINT and COMMIT)
//! are queued, and sent with the next statement that returns rows, or with
//! the commit, as one multi-statement query: SQLite runs them in order and
//! stops at the first that fails. Event seqs are handed out here, which
//! the single writer can do, so that appending an event needs no answer.

use futures_util::TryStreamExt;
use sqlx::sqlite::SqliteRow;
use sqlx::{Either, Sqlite, SqliteConnection};

use super::map_err;
use crate::store::db::{Arg, Exec, Stmt, query};
use crate::store::{BoxFuture, Result, StoreError};
use crate::time::Millis;

/// Sends of up to this many statements stay prepared for the next time:
/// the few combinations that lone requests make. A larger send stays
/// prepared only when its jobs' statements are all one text (a batch of
/// renewals: the same query whenever the batch is that size); a mix is
/// nearly always a new combination, prepared for that once.
const KEEP_PREPARED: usize = 8;

/// The owner of a batch's own statements (BEGIN, COMMIT), which belong to
/// no job: when one fails, every job gets its error.
pub const BATCH: usize = usize::MAX;

/// A failed send: the job that queued the statement that failed, and why.
#[derive(Debug)]
pub struct Failed {
    pub owner: usize,
    pub error: StoreError,
}

/// A queued statement: the job that queued it, and for one that must
/// change exactly one row, what vanished otherwise.
#[derive(Debug)]
struct Queued {
    owner: usize,
    must_change_one: Option<String>,
}

pub struct Pipeline<'c> {
    conn: &'c mut SqliteConnection,
    sql: String,
    args: Vec<Arg<'static>>,
    queued: Vec<Queued>,
    /// The job whose statements are being queued now.
    pub owner: usize,
    /// The job whose queued statement failed in the last failed send made
    /// for a job's own read (which returns only the error to that job).
    pub failed_owner: Option<usize>,
    /// The last event seq handed out, queued events included.
    pub seq: i64,
    /// Sends so far.
    sends: u64,
    /// The text of the first job statement queued, and whether another
    /// text was queued since.
    first_text: Option<String>,
    mixed: bool,
    /// Where the current job's statements begin, if it gets a savepoint
    /// there when it first sends (see `begin_job`).
    savepoint_at: Option<(Mark, usize)>,
}

/// The pipeline at one moment, to go back to.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    sql: usize,
    args: usize,
    queued: usize,
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

impl<'c> Pipeline<'c> {
    pub fn new(conn: &'c mut SqliteConnection, seq: i64) -> Self {
        Self {
            conn,
            sql: String::new(),
            args: Vec::new(),
            queued: Vec::new(),
            owner: 0,
            failed_owner: None,
            seq,
            sends: 0,
            first_text: None,
            mixed: false,
            savepoint_at: None,
        }
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
            sql: self.sql.len(),
            args: self.args.len(),
            queued: self.queued.len(),
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
        self.sql.truncate(mark.sql);
        self.args.truncate(mark.args);
        self.queued.truncate(mark.queued);
        self.savepoint_at = None;
        true
    }

    /// Queue a statement without parameters.
    pub fn queue_raw(&mut self, sql: &'static str) {
        self.queue(Stmt::new(sql), None);
    }

    fn queue(&mut self, s: Stmt<'_>, must_change_one: Option<String>) {
        if self.owner != BATCH {
            match &self.first_text {
                None => self.first_text = Some(s.sql.to_owned()),
                Some(first) => self.mixed |= first != s.sql,
            }
        }
        self.sql.push_str(&shift(s.sql, self.args.len()));
        self.sql.push_str(";\n");
        self.args.extend(s.args.into_iter().map(owned));
        self.queued.push(Queued {
            owner: self.owner,
            must_change_one,
        });
    }

    /// Forget what is queued.
    pub fn clear(&mut self) {
        self.sql.clear();
        self.args.clear();
        self.queued.clear();
        self.savepoint_at = None;
        self.first_text = None;
        self.mixed = false;
    }

    /// Send everything queued as one query: the rows it returned.
    pub async fn send(&mut self) -> Result<Vec<SqliteRow>, Failed> {
        if self.queued.is_empty() {
            return Ok(Vec::new());
        }
        if let Some((at, owner)) = self.savepoint_at.take()
            && at.sends == self.sends
        {
            // No parameters: those after it keep their numbers.
            self.sql.insert_str(at.sql, "SAVEPOINT job;\n");
            let job = Queued {
                owner,
                must_change_one: None,
            };
            self.queued.insert(at.queued, job);
        }
        let sql = std::mem::take(&mut self.sql);
        let args = std::mem::take(&mut self.args);
        let queued = std::mem::take(&mut self.queued);
        let keep = queued.len() <= KEEP_PREPARED || !self.mixed;
        self.first_text = None;
        self.mixed = false;
        self.sends += 1;
        let mut rows = Vec::new();
        let mut done = 0;
        // Deprecated as an interface common to all drivers (sqlx#3108): only
        // SQLite runs several statements of one prepared query, each result
        // in turn, which is what this needs. Pinned by the tests below.
        #[allow(deprecated)]
        let mut results = query::<Sqlite>(&sql, args)
            .persistent(keep)
            .fetch_many(&mut *self.conn);
        loop {
            let next = results.try_next().await;
            let item = match next {
                Ok(Some(item)) => item,
                Ok(None) => break,
                Err(e) => {
                    return Err(Failed {
                        owner: queued.get(done).map_or(self.owner, |q| q.owner),
                        error: map_err(e),
                    });
                }
            };
            match item {
                Either::Right(row) => rows.push(row),
                Either::Left(result) => {
                    if let Some(q) = queued.get(done)
                        && let Some(what) = &q.must_change_one
                        && result.rows_affected() != 1
                    {
                        let error = StoreError::Other(format!("{what} vanished during update"));
                        let owner = q.owner;
                        return Err(Failed { owner, error });
                    }
                    done += 1;
                }
            }
        }
        Ok(rows)
    }
}

impl Exec for Pipeline<'_> {
    type Row = SqliteRow;

    fn fetch<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<Vec<SqliteRow>>> {
        self.queue(s, None);
        Box::pin(async move {
            self.send().await.map_err(|f| {
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
        let s = Stmt::new("INSERT INTO events (seq, at, body) VALUES ($1, $2, $3)");
        self.queue(s.int(seq).int(at).text(body), None);
        Box::pin(std::future::ready(Ok(seq)))
    }

    fn last_event_seq(&mut self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(std::future::ready(Ok(self.seq)))
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
}
