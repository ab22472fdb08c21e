//! Requests made with an `Idempotency-Key` (see `crate::idempotency`).

use super::super::Result;
use super::super::db::{Cols, Exec, Stmt};
use crate::model::IdempotentRequest;
use crate::time::Millis;

/// Record `key` for the request `request_id`, unless a request recorded it
/// first (since `stale`; an older record is replaced): the request id that
/// holds the key now. One statement, whose update on conflict keeps a live
/// record as it is, so that the row comes back either way; on PostgreSQL it
/// also waits for a concurrent holder's transaction to end.
pub async fn claim_key<E: Exec + ?Sized>(
    c: &mut E,
    key: &str,
    request: &str,
    request_id: &str,
    at: Millis,
    stale: Millis,
) -> Result<String> {
    let s = Stmt::new(
        "INSERT INTO idempotency (key, request, request_id, created_at) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (key) DO UPDATE SET \
         request = CASE WHEN idempotency.created_at < $5 THEN excluded.request ELSE idempotency.request END, \
         request_id = CASE WHEN idempotency.created_at < $5 THEN excluded.request_id ELSE idempotency.request_id END, \
         status = CASE WHEN idempotency.created_at < $5 THEN NULL ELSE idempotency.status END, \
         content_type = CASE WHEN idempotency.created_at < $5 THEN NULL ELSE idempotency.content_type END, \
         body = CASE WHEN idempotency.created_at < $5 THEN NULL ELSE idempotency.body END, \
         created_at = CASE WHEN idempotency.created_at < $5 THEN excluded.created_at ELSE idempotency.created_at END \
         RETURNING request_id",
    )
    .text(key)
    .text(request)
    .text(request_id)
    .int(at)
    .int(stale);
    let rows = c.fetch(s).await?;
    match rows.first() {
        Some(r) => r.text(0),
        None => Err(super::super::StoreError::Other(
            "recording an idempotency key returned nothing".into(),
        )),
    }
}

/// The answer of the request that holds `key`.
pub async fn answer_key<E: Exec + ?Sized>(
    c: &mut E,
    key: &str,
    request_id: &str,
    answer: (u16, &str, &str),
) -> Result<()> {
    let (status, content_type, body) = answer;
    let s = Stmt::new(
        "UPDATE idempotency SET status = $3, content_type = $4, body = $5 \
         WHERE key = $1 AND request_id = $2",
    )
    .text(key)
    .text(request_id)
    .int(i64::from(status))
    .text(content_type)
    .text(body);
    c.execute(s).await
}

/// Let `key` go, if the request `request_id` still holds it.
pub async fn forget_key<E: Exec + ?Sized>(c: &mut E, key: &str, request_id: &str) -> Result<()> {
    let s = Stmt::new("DELETE FROM idempotency WHERE key = $1 AND request_id = $2")
        .text(key)
        .text(request_id);
    c.execute(s).await
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
        "SELECT request, request_id, status, content_type, body, created_at \
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
    }))
}
