//! SQL and row decoding for leases, events and meta, used inside write
//! transactions and by reads alike.

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use super::map_err;
use crate::model::{EventRow, LeaseFilter, LeaseRecord, LeaseState, ParentRef};
use crate::store::sql::{self, LEASE_COLS, LEASE_CURRENT};
use crate::store::{Result, StoreError};
use crate::time::Millis;

pub(super) fn decode_err(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Other(format!("stored {what} does not decode: {e}"))
}

pub(super) fn from_json<T: serde::de::DeserializeOwned>(
    what: &str,
    s: Option<String>,
) -> Result<Option<T>> {
    s.map(|s| serde_json::from_str(&s))
        .transpose()
        .map_err(|e| decode_err(what, e))
}

pub(super) fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| StoreError::Other(e.to_string()))
}

fn lease_row(r: &PgRow) -> Result<LeaseRecord> {
    let parent = match r.try_get::<Option<String>, _>(6).map_err(map_err)? {
        Some(id) => Some(ParentRef {
            id,
            resource: r
                .try_get::<Option<String>, _>(7)
                .map_err(map_err)?
                .unwrap_or_default(),
            token: r
                .try_get::<Option<i64>, _>(8)
                .map_err(map_err)?
                .unwrap_or_default(),
        }),
        None => None,
    };
    let state: String = r.try_get(4).map_err(map_err)?;
    let metadata: String = r.try_get(15).map_err(map_err)?;
    Ok(LeaseRecord {
        id: r.try_get(0).map_err(map_err)?,
        resource: r.try_get(1).map_err(map_err)?,
        token: r.try_get(2).map_err(map_err)?,
        holder: r.try_get(3).map_err(map_err)?,
        state: LeaseState::parse(&state).ok_or_else(|| decode_err("lease state", &state))?,
        owner: from_json("owner", r.try_get(5).map_err(map_err)?)?,
        parent,
        ttl_ms: r.try_get(9).map_err(map_err)?,
        expires_at: r.try_get(10).map_err(map_err)?,
        acquired_at: r.try_get(11).map_err(map_err)?,
        renewed_at: r.try_get(12).map_err(map_err)?,
        ended_at: r.try_get(13).map_err(map_err)?,
        end_reason: r.try_get(14).map_err(map_err)?,
        metadata: serde_json::from_str(&metadata).map_err(|e| decode_err("metadata", e))?,
    })
}

fn leases(rows: Vec<PgRow>) -> Result<Vec<LeaseRecord>> {
    rows.iter().map(lease_row).collect()
}

pub async fn lease(c: &mut PgConnection, id: &str) -> Result<Option<LeaseRecord>> {
    let sql = format!("SELECT {LEASE_COLS} FROM leases WHERE id = $1");
    let rows = sqlx::query(&sql)
        .bind(id)
        .fetch_all(c)
        .await
        .map_err(map_err)?;
    Ok(leases(rows)?.pop())
}

/// The current lease of `resource`. No row lock: the transaction already
/// holds the fleet's write lock (see `writer`), and `FOR UPDATE` would cost
/// a write to the row.
pub async fn current_lease(c: &mut PgConnection, resource: &str) -> Result<Option<LeaseRecord>> {
    let sql = format!("SELECT {LEASE_COLS} FROM leases WHERE resource = $1 AND {LEASE_CURRENT}");
    let rows = sqlx::query(&sql)
        .bind(resource)
        .fetch_all(c)
        .await
        .map_err(map_err)?;
    Ok(leases(rows)?.pop())
}

pub async fn next_token(c: &mut PgConnection, resource: &str) -> Result<i64> {
    sqlx::query_scalar(
        "INSERT INTO resources (resource, last_token) VALUES ($1, 1) \
         ON CONFLICT (resource) DO UPDATE SET last_token = resources.last_token + 1 \
         RETURNING last_token",
    )
    .bind(resource)
    .fetch_one(c)
    .await
    .map_err(map_err)
}

pub async fn insert_lease(c: &mut PgConnection, l: &LeaseRecord) -> Result<()> {
    let sql = format!(
        "INSERT INTO leases ({LEASE_COLS}) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)"
    );
    sqlx::query(&sql)
        .bind(&l.id)
        .bind(&l.resource)
        .bind(l.token)
        .bind(&l.holder)
        .bind(l.state.as_str())
        .bind(l.owner.as_ref().map(to_json).transpose()?)
        .bind(l.parent.as_ref().map(|p| p.id.as_str()))
        .bind(l.parent.as_ref().map(|p| p.resource.as_str()))
        .bind(l.parent.as_ref().map(|p| p.token))
        .bind(l.ttl_ms)
        .bind(l.expires_at)
        .bind(l.acquired_at)
        .bind(l.renewed_at)
        .bind(l.ended_at)
        .bind(&l.end_reason)
        .bind(to_json(&l.metadata)?)
        .execute(c)
        .await
        .map_err(map_err)?;
    Ok(())
}

pub async fn update_lease(c: &mut PgConnection, l: &LeaseRecord) -> Result<()> {
    let done = sqlx::query(
        "UPDATE leases SET state = $1, owner = $2, ttl_ms = $3, expires_at = $4, \
         renewed_at = $5, ended_at = $6, end_reason = $7 WHERE id = $8",
    )
    .bind(l.state.as_str())
    .bind(l.owner.as_ref().map(to_json).transpose()?)
    .bind(l.ttl_ms)
    .bind(l.expires_at)
    .bind(l.renewed_at)
    .bind(l.ended_at)
    .bind(&l.end_reason)
    .bind(&l.id)
    .execute(c)
    .await
    .map_err(map_err)?;
    if done.rows_affected() != 1 {
        return Err(StoreError::Other(format!(
            "lease {} vanished during update",
            l.id
        )));
    }
    Ok(())
}

/// Take the next seq from the counter row (which the transaction already
/// holds locked) and append the event under it.
pub async fn append_event(c: &mut PgConnection, at: Millis, body: &str) -> Result<i64> {
    sqlx::query_scalar(
        "WITH s AS (UPDATE event_seq SET seq = seq + 1 RETURNING seq) \
         INSERT INTO events (seq, at, body) SELECT seq, $1, $2 FROM s RETURNING seq",
    )
    .bind(at)
    .bind(body)
    .fetch_one(c)
    .await
    .map_err(map_err)
}

pub async fn set_meta(c: &mut PgConnection, key: &str, value: &str) -> Result<()> {
    sqlx::query(
        "INSERT INTO meta (key, value) VALUES ($1, $2) \
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
    )
    .bind(key)
    .bind(value)
    .execute(c)
    .await
    .map_err(map_err)?;
    Ok(())
}

pub async fn list_leases(c: &mut PgConnection, f: &LeaseFilter) -> Result<Vec<LeaseRecord>> {
    let (sql, args) = sql::list_leases('$', f);
    let mut q = sqlx::query(&sql);
    for a in args {
        q = q.bind(a);
    }
    leases(q.fetch_all(c).await.map_err(map_err)?)
}

pub async fn leases_to_reconcile(c: &mut PgConnection, now: Millis) -> Result<Vec<LeaseRecord>> {
    let sql = format!(
        "SELECT {LEASE_COLS} FROM leases WHERE {LEASE_CURRENT} AND owner IS NOT NULL \
         UNION SELECT {LEASE_COLS} FROM leases WHERE {LEASE_CURRENT} AND expires_at <= $1"
    );
    leases(
        sqlx::query(&sql)
            .bind(now)
            .fetch_all(c)
            .await
            .map_err(map_err)?,
    )
}

pub async fn count(c: &mut PgConnection, sql: &str) -> Result<i64> {
    sqlx::query_scalar(sql).fetch_one(c).await.map_err(map_err)
}

pub async fn count_current_leases(c: &mut PgConnection) -> Result<i64> {
    count(
        c,
        &format!("SELECT count(*) FROM leases WHERE {LEASE_CURRENT}"),
    )
    .await
}

pub async fn events(c: &mut PgConnection, after: i64, limit: u32) -> Result<Vec<EventRow>> {
    let rows = sqlx::query("SELECT seq, body FROM events WHERE seq > $1 ORDER BY seq LIMIT $2")
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(c)
        .await
        .map_err(map_err)?;
    rows.iter()
        .map(|r| {
            Ok(EventRow {
                seq: r.try_get(0).map_err(map_err)?,
                payload: r.try_get(1).map_err(map_err)?,
            })
        })
        .collect()
}

/// The last seq handed out: every event up to it is committed, since seqs
/// are taken under the counter's row lock and become visible in order.
pub async fn last_event_seq(c: &mut PgConnection) -> Result<i64> {
    count(c, "SELECT seq FROM event_seq").await
}

pub async fn pruned_through(c: &mut PgConnection) -> Result<i64> {
    let v: Option<String> =
        sqlx::query_scalar("SELECT value FROM meta WHERE key = 'pruned_through'")
            .fetch_optional(&mut *c)
            .await
            .map_err(map_err)?;
    Ok(v.and_then(|v| v.parse().ok()).unwrap_or(0))
}

pub async fn prune_events(
    c: &mut PgConnection,
    keep_last: Option<u64>,
    older_than: Option<Millis>,
) -> Result<i64> {
    let before = pruned_through(c).await?;
    let mut through = before;
    if let Some(keep) = keep_last {
        let max = last_event_seq(c).await?;
        through = through.max(max - i64::try_from(keep).unwrap_or(i64::MAX));
    }
    if let Some(at) = older_than {
        let seq: Option<i64> = sqlx::query_scalar("SELECT max(seq) FROM events WHERE at < $1")
            .bind(at)
            .fetch_one(&mut *c)
            .await
            .map_err(map_err)?;
        through = through.max(seq.unwrap_or(0));
    }
    if through > before {
        sqlx::query("DELETE FROM events WHERE seq <= $1")
            .bind(through)
            .execute(&mut *c)
            .await
            .map_err(map_err)?;
        set_meta(c, "pruned_through", &through.to_string()).await?;
    }
    Ok(through)
}
