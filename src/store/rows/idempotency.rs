//! Requests made with an `Idempotency-Key` (see `crate::idempotency`).

use super::super::Result;
use super::super::db::{Cols, Exec, Stmt};
use crate::model::{IdempotentRequest, KeyClaim};
use crate::time::Millis;

/// When a claim replaces the row it meets: the row is stale, or it is the
/// one the claim supersedes and nothing was created under it since.
macro_rules! replaces {
    () => {
        "(idempotency.created_at < $5 OR (idempotency.request_id = $7 \
         AND idempotency.status IS NULL AND idempotency.run_id IS NOT NULL))"
    };
}
pub(crate) use replaces;

/// The statement that records a key (`claim_key`), with its parameters
/// in the order of `claim_args`. PostgreSQL's writer also runs it inside
/// its commit (`postgres::pipeline`), as a function of the same text.
macro_rules! claim_sql {
    () => {
        concat!(
            "INSERT INTO idempotency (key, request, request_id, created_at, run_id) \
             VALUES ($1, $2, $3, $4, $6) ON CONFLICT (key) DO UPDATE SET ",
            "request = CASE WHEN ",
            $crate::store::rows::replaces!(),
            " THEN excluded.request ELSE idempotency.request END, ",
            "request_id = CASE WHEN ",
            $crate::store::rows::replaces!(),
            " THEN excluded.request_id ELSE idempotency.request_id END, ",
            "status = CASE WHEN ",
            $crate::store::rows::replaces!(),
            " THEN NULL ELSE idempotency.status END, ",
            "content_type = CASE WHEN ",
            $crate::store::rows::replaces!(),
            " THEN NULL ELSE idempotency.content_type END, ",
            "body = CASE WHEN ",
            $crate::store::rows::replaces!(),
            " THEN NULL ELSE idempotency.body END, ",
            "run_id = CASE WHEN ",
            $crate::store::rows::replaces!(),
            " THEN excluded.run_id ELSE idempotency.run_id END, ",
            "created_at = CASE WHEN ",
            $crate::store::rows::replaces!(),
            " THEN excluded.created_at ELSE idempotency.created_at END \
             RETURNING request_id",
        )
    };
}
pub(crate) use claim_sql;

/// `claim_sql!`'s parameters.
pub fn claim_args<'a>(claim: &KeyClaim<'a>) -> Stmt<'a> {
    Stmt::new(claim_sql!())
        .text(claim.key)
        .text(claim.request)
        .text(claim.request_id)
        .int(claim.at)
        .int(claim.stale)
        .text(claim.run_id)
        .opt_text(claim.supersedes)
}

/// Record `claim.key` for its request, unless another request recorded it
/// first (see `replaces!`): the request id that holds the key now. One
/// statement, whose update on conflict keeps a live record as it is, so
/// that the row comes back either way; on PostgreSQL it also waits for a
/// concurrent holder's transaction to end.
pub async fn claim_key<E: Exec + ?Sized>(c: &mut E, claim: &KeyClaim<'_>) -> Result<String> {
    let s = claim_args(claim);
    let rows = c.fetch(s).await?;
    match rows.first() {
        Some(r) => r.text(0),
        None => Err(super::super::StoreError::Other(
            "recording an idempotency key returned nothing".into(),
        )),
    }
}

/// The request `request_id` that holds `key` created a record: a retry
/// must not create it again, even once this run has ended.
pub async fn key_created<E: Exec + ?Sized>(c: &mut E, key: &str, request_id: &str) -> Result<()> {
    let s = Stmt::new("UPDATE idempotency SET run_id = NULL WHERE key = $1 AND request_id = $2")
        .text(key)
        .text(request_id);
    c.execute(s).await
}

/// The name a server run's connections to PostgreSQL carry, by which
/// `run_connected` knows it is alive.
pub fn run_application_name(run_id: &str) -> String {
    format!("holdfast {run_id}")
}

/// Whether a server of the run `run_id` is connected to this database
/// (PostgreSQL only: a killed server's sessions end with its sockets).
pub async fn run_connected<E: Exec + ?Sized>(c: &mut E, run_id: &str) -> Result<bool> {
    let s = Stmt::new("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = $1)")
        .owned(Some(run_application_name(run_id)));
    match c.fetch(s).await?.first() {
        Some(r) => r.flag(0),
        None => Ok(false),
    }
}

/// What keeping an answer without waiting for the disk adds to its
/// statement, on PostgreSQL: `synchronous_commit` off for the statement's
/// own transaction (autocommit), whose commit then returns before the WAL
/// is flushed. It survives a crash of this server, not of the database.
macro_rules! relaxed {
    () => {
        "(SELECT set_config('synchronous_commit', 'off', true)) AS relaxed"
    };
}

/// The answer of the request that holds `key`, unless it was answered
/// already (a waiter's, kept by the release that handed it the lease,
/// whose commit it could not learn of). An answered key has no run
/// left: nothing takes it over, nor can a build that predates the column,
/// replacing the row once it is stale, inherit one.
pub async fn answer_key<E: Exec + ?Sized>(
    c: &mut E,
    key: &str,
    request_id: &str,
    answer: (u16, &str, &str),
) -> Result<()> {
    answer_with(
        c,
        "UPDATE idempotency SET status = $3, content_type = $4, body = $5, run_id = NULL \
         WHERE key = $1 AND request_id = $2 AND status IS NULL",
        key,
        request_id,
        answer,
    )
    .await
}

async fn answer_with<E: Exec + ?Sized>(
    c: &mut E,
    sql: &str,
    key: &str,
    request_id: &str,
    answer: (u16, &str, &str),
) -> Result<()> {
    let (status, content_type, body) = answer;
    let s = Stmt::new(sql)
        .text(key)
        .text(request_id)
        .int(i64::from(status))
        .text(content_type)
        .text(body);
    c.execute(s).await
}

/// Let `key` go, if the request `request_id` still holds it unanswered.
pub async fn forget_key<E: Exec + ?Sized>(c: &mut E, key: &str, request_id: &str) -> Result<()> {
    let s =
        Stmt::new("DELETE FROM idempotency WHERE key = $1 AND request_id = $2 AND status IS NULL")
            .text(key)
            .text(request_id);
    c.execute(s).await
}

/// Keep `answer` for the request `request_id` that holds `key` (None: let
/// the key go) in a statement of its own; not `durable`: see `relaxed!`
/// (PostgreSQL only).
pub async fn settle_key<E: Exec + ?Sized>(
    c: &mut E,
    key: &str,
    request_id: &str,
    answer: Option<(u16, &str, &str)>,
    durable: bool,
) -> Result<()> {
    const ANSWER_RELAXED: &str = concat!(
        "UPDATE idempotency SET status = $3, content_type = $4, body = $5, run_id = NULL FROM ",
        relaxed!(),
        " WHERE key = $1 AND request_id = $2 AND status IS NULL"
    );
    const FORGET_RELAXED: &str = concat!(
        "DELETE FROM idempotency USING ",
        relaxed!(),
        " WHERE key = $1 AND request_id = $2 AND status IS NULL"
    );
    match (answer, durable) {
        (Some(a), true) => answer_key(c, key, request_id, a).await,
        (None, true) => forget_key(c, key, request_id).await,
        (Some(a), false) => answer_with(c, ANSWER_RELAXED, key, request_id, a).await,
        (None, false) => {
            let s = Stmt::new(FORGET_RELAXED).text(key).text(request_id);
            c.execute(s).await
        }
    }
}

pub async fn prune_keys<E: Exec + ?Sized>(c: &mut E, before: Millis) -> Result<()> {
    c.execute(Stmt::new("DELETE FROM idempotency WHERE created_at < $1").int(before))
        .await
}

pub async fn idempotent_request<E: Exec + ?Sized>(
    c: &mut E,
    key: &str,
) -> Result<Option<IdempotentRequest>> {
    let s = Stmt::new(
        "SELECT request, request_id, status, content_type, body, created_at, run_id \
         FROM idempotency WHERE key = $1",
    )
    .text(key);
    let Some(r) = c.fetch(s).await?.into_iter().next() else {
        return Ok(None);
    };
    Ok(Some(IdempotentRequest {
        request: r.text(0)?,
        request_id: r.text(1)?,
        status: r.opt_int(2)?.map(|s| u16::try_from(s).unwrap_or(500)),
        content_type: r.opt_text(3)?,
        body: r.opt_text(4)?,
        created_at: r.int(5)?,
        run_id: r.opt_text(6)?,
    }))
}
