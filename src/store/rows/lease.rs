//! Leases and the fencing-token counter.

use crate::model::{LeaseFilter, LeaseRecord, LeaseState, ParentRef};
use crate::store::db::{Cols, Exec, Stmt, decode_err, from_json, scalar, to_json};
use crate::store::sql::{self, lease_cols, lease_current};
use crate::store::{Result, StoreError};
use crate::time::Millis;

fn lease_row(r: &impl Cols) -> Result<LeaseRecord> {
    let parent = match r.opt_text(6)? {
        Some(id) => Some(ParentRef {
            id,
            resource: r.opt_text(7)?.unwrap_or_default(),
            token: r.opt_int(8)?.unwrap_or_default(),
        }),
        None => None,
    };
    let state = r.text(4)?;
    Ok(LeaseRecord {
        id: r.text(0)?,
        resource: r.text(1)?,
        token: r.int(2)?,
        holder: r.text(3)?,
        state: LeaseState::parse(&state).ok_or_else(|| decode_err("lease state", &state))?,
        owner: from_json("owner", r.opt_text(5)?)?,
        parent,
        ttl_ms: r.opt_int(9)?,
        expires_at: r.opt_int(10)?,
        acquired_at: r.int(11)?,
        renewed_at: r.opt_int(12)?,
        ended_at: r.opt_int(13)?,
        end_reason: r.opt_text(14)?,
        metadata: serde_json::from_str(&r.text(15)?).map_err(|e| decode_err("metadata", e))?,
    })
}

async fn leases<E: Exec + ?Sized>(c: &mut E, s: Stmt<'_>) -> Result<Vec<LeaseRecord>> {
    c.fetch(s).await?.iter().map(lease_row).collect()
}

pub async fn lease<E: Exec + ?Sized>(c: &mut E, id: &str) -> Result<Option<LeaseRecord>> {
    const SQL: &str = concat!("SELECT ", lease_cols!(), " FROM leases WHERE id = $1");
    Ok(leases(c, Stmt::new(SQL).text(id)).await?.pop())
}

/// The current lease of `resource`. No row lock: every write transaction
/// already excludes the others (SQLite's one writer, PostgreSQL's lock).
pub async fn current_lease<E: Exec + ?Sized>(
    c: &mut E,
    resource: &str,
) -> Result<Option<LeaseRecord>> {
    const SQL: &str = concat!(
        "SELECT ",
        lease_cols!(),
        " FROM leases WHERE resource = $1 AND ",
        lease_current!()
    );
    Ok(leases(c, Stmt::new(SQL).text(resource)).await?.pop())
}

pub async fn next_token<E: Exec + ?Sized>(c: &mut E, resource: &str) -> Result<i64> {
    let s = Stmt::new(
        "INSERT INTO resources (resource, last_token) VALUES ($1, 1) \
         ON CONFLICT (resource) DO UPDATE SET last_token = resources.last_token + 1 \
         RETURNING last_token",
    );
    scalar(c, s.text(resource))
        .await?
        .ok_or_else(|| StoreError::Other("no token was returned".into()))
}

/// Record `token` as the last of `resource`, when the caller counted it.
pub async fn set_token<E: Exec + ?Sized>(c: &mut E, resource: &str, token: i64) -> Result<()> {
    let s = Stmt::new(
        "INSERT INTO resources (resource, last_token) VALUES ($1, $2) \
         ON CONFLICT (resource) DO UPDATE SET last_token = excluded.last_token",
    );
    c.execute(s.text(resource).int(token)).await
}

/// The columns of `l`, in the order of `lease_cols!`, as JSON values.
pub fn lease_values(l: &LeaseRecord) -> Result<serde_json::Value> {
    Ok(serde_json::json!([
        l.id,
        l.resource,
        l.token,
        l.holder,
        l.state.as_str(),
        l.owner.as_ref().map(to_json).transpose()?,
        l.parent.as_ref().map(|p| p.id.as_str()),
        l.parent.as_ref().map(|p| p.resource.as_str()),
        l.parent.as_ref().map(|p| p.token),
        l.ttl_ms,
        l.expires_at,
        l.acquired_at,
        l.renewed_at,
        l.ended_at,
        l.end_reason,
        to_json(&l.metadata)?,
    ]))
}

pub async fn insert_lease<E: Exec + ?Sized>(c: &mut E, l: &LeaseRecord) -> Result<()> {
    const SQL: &str = concat!(
        "INSERT INTO leases (",
        lease_cols!(),
        ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)"
    );
    let s = Stmt::new(SQL)
        .text(&l.id)
        .text(&l.resource)
        .int(l.token)
        .text(&l.holder)
        .text(l.state.as_str())
        .owned(l.owner.as_ref().map(to_json).transpose()?)
        .opt_text(l.parent.as_ref().map(|p| p.id.as_str()))
        .opt_text(l.parent.as_ref().map(|p| p.resource.as_str()))
        .opt_int(l.parent.as_ref().map(|p| p.token))
        .opt_int(l.ttl_ms)
        .opt_int(l.expires_at)
        .int(l.acquired_at)
        .opt_int(l.renewed_at)
        .opt_int(l.ended_at)
        .opt_text(l.end_reason.as_deref())
        .owned(Some(to_json(&l.metadata)?));
    c.execute(s).await
}

pub async fn update_lease<E: Exec + ?Sized>(c: &mut E, l: &LeaseRecord) -> Result<()> {
    let s = Stmt::new(
        "UPDATE leases SET state = $1, owner = $2, ttl_ms = $3, expires_at = $4, \
         renewed_at = $5, ended_at = $6, end_reason = $7 WHERE id = $8",
    )
    .text(l.state.as_str())
    .owned(l.owner.as_ref().map(to_json).transpose()?)
    .opt_int(l.ttl_ms)
    .opt_int(l.expires_at)
    .opt_int(l.renewed_at)
    .opt_int(l.ended_at)
    .opt_text(l.end_reason.as_deref())
    .text(&l.id);
    c.execute_one(s, format!("lease {}", l.id)).await
}

pub async fn list_leases<E: Exec + ?Sized>(c: &mut E, f: &LeaseFilter) -> Result<Vec<LeaseRecord>> {
    let page = sql::list_leases(f);
    leases(c, page.stmt()).await
}

pub async fn leases_to_reconcile<E: Exec + ?Sized>(
    c: &mut E,
    now: Millis,
) -> Result<Vec<LeaseRecord>> {
    const SQL: &str = concat!(
        "SELECT ",
        lease_cols!(),
        " FROM leases WHERE ",
        lease_current!(),
        " AND owner IS NOT NULL UNION SELECT ",
        lease_cols!(),
        " FROM leases WHERE ",
        lease_current!(),
        " AND expires_at <= $1"
    );
    leases(c, Stmt::new(SQL).int(now)).await
}

pub async fn count_current_leases<E: Exec + ?Sized>(c: &mut E) -> Result<i64> {
    super::count(
        c,
        concat!("SELECT count(*) FROM leases WHERE ", lease_current!()),
    )
    .await
}
