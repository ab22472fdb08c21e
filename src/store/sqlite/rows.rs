//! SQL and row decoding, shared by the writer (inside its transaction) and
//! the read pool.

use rusqlite::{Connection, OptionalExtension, Row, params};

use super::map_err;
use crate::model::{EventRow, LeaseFilter, LeaseRecord, LeaseState, ParentRef};
use crate::store::sql::{self, LEASE_COLS, LEASE_CURRENT};
use crate::store::{Result, StoreError};
use crate::time::Millis;

fn decode_err(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Other(format!("stored {what} does not decode: {e}"))
}

/// Columns as read, before the JSON members are parsed.
struct RawLease {
    rec: LeaseRecord,
    state: String,
    owner: Option<String>,
    metadata: String,
}

fn raw(r: &Row<'_>) -> rusqlite::Result<RawLease> {
    let parent_id: Option<String> = r.get(6)?;
    let parent = match parent_id {
        Some(id) => Some(ParentRef {
            id,
            resource: r.get::<_, Option<String>>(7)?.unwrap_or_default(),
            token: r.get::<_, Option<i64>>(8)?.unwrap_or_default(),
        }),
        None => None,
    };
    Ok(RawLease {
        rec: LeaseRecord {
            id: r.get(0)?,
            resource: r.get(1)?,
            token: r.get(2)?,
            holder: r.get(3)?,
            state: LeaseState::Active,
            owner: None,
            parent,
            ttl_ms: r.get(9)?,
            expires_at: r.get(10)?,
            acquired_at: r.get(11)?,
            renewed_at: r.get(12)?,
            ended_at: r.get(13)?,
            end_reason: r.get(14)?,
            metadata: Default::default(),
        },
        state: r.get(4)?,
        owner: r.get(5)?,
        metadata: r.get(15)?,
    })
}

fn finish(raw: RawLease) -> Result<LeaseRecord> {
    let mut rec = raw.rec;
    rec.state =
        LeaseState::parse(&raw.state).ok_or_else(|| decode_err("lease state", &raw.state))?;
    rec.owner = raw
        .owner
        .map(|o| serde_json::from_str(&o))
        .transpose()
        .map_err(|e| decode_err("owner", e))?;
    rec.metadata = serde_json::from_str(&raw.metadata).map_err(|e| decode_err("metadata", e))?;
    Ok(rec)
}

fn leases(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Result<Vec<LeaseRecord>> {
    let mut stmt = conn.prepare_cached(sql).map_err(map_err)?;
    let rows = stmt.query_map(params, raw).map_err(map_err)?;
    rows.map(|r| r.map_err(map_err).and_then(finish)).collect()
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| StoreError::Other(e.to_string()))
}

pub fn lease(conn: &Connection, id: &str) -> Result<Option<LeaseRecord>> {
    let sql = format!("SELECT {LEASE_COLS} FROM leases WHERE id = ?1");
    Ok(leases(conn, &sql, [id])?.pop())
}

pub fn current_lease(conn: &Connection, resource: &str) -> Result<Option<LeaseRecord>> {
    let sql = format!("SELECT {LEASE_COLS} FROM leases WHERE resource = ?1 AND {LEASE_CURRENT}");
    Ok(leases(conn, &sql, [resource])?.pop())
}

pub fn next_token(conn: &Connection, resource: &str) -> Result<i64> {
    conn.prepare_cached(
        "INSERT INTO resources (resource, last_token) VALUES (?1, 1) \
         ON CONFLICT (resource) DO UPDATE SET last_token = last_token + 1 \
         RETURNING last_token",
    )
    .and_then(|mut s| s.query_row([resource], |r| r.get(0)))
    .map_err(map_err)
}

pub fn insert_lease(conn: &Connection, l: &LeaseRecord) -> Result<()> {
    let owner = l.owner.as_ref().map(to_json).transpose()?;
    let sql = format!(
        "INSERT INTO leases ({LEASE_COLS}) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)"
    );
    let mut stmt = conn.prepare_cached(&sql).map_err(map_err)?;
    stmt.execute(params![
        l.id,
        l.resource,
        l.token,
        l.holder,
        l.state.as_str(),
        owner,
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
    ])
    .map_err(map_err)?;
    Ok(())
}

pub fn update_lease(conn: &Connection, l: &LeaseRecord) -> Result<()> {
    let owner = l.owner.as_ref().map(to_json).transpose()?;
    let mut stmt = conn
        .prepare_cached(
            "UPDATE leases SET state = ?1, owner = ?2, ttl_ms = ?3, expires_at = ?4, \
             renewed_at = ?5, ended_at = ?6, end_reason = ?7 WHERE id = ?8",
        )
        .map_err(map_err)?;
    let n = stmt
        .execute(params![
            l.state.as_str(),
            owner,
            l.ttl_ms,
            l.expires_at,
            l.renewed_at,
            l.ended_at,
            l.end_reason,
            l.id
        ])
        .map_err(map_err)?;
    if n != 1 {
        return Err(StoreError::Other(format!(
            "lease {} vanished during update",
            l.id
        )));
    }
    Ok(())
}

pub fn append_event(conn: &Connection, at: Millis, body: &str) -> Result<i64> {
    conn.prepare_cached("INSERT INTO events (at, body) VALUES (?1, ?2) RETURNING seq")
        .and_then(|mut s| s.query_row(params![at, body], |r| r.get(0)))
        .map_err(map_err)
}

pub fn set_meta(conn: &Connection, key: &str, value: &str) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO meta (key, value) VALUES (?1, ?2) \
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
    )
    .and_then(|mut s| s.execute([key, value]))
    .map_err(map_err)?;
    Ok(())
}

pub fn meta(conn: &Connection, key: &str) -> Result<Option<String>> {
    conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
        .optional()
        .map_err(map_err)
}

/// Push every current lease's expiry out to at least now + its TTL.
pub fn extend_current_ttls(conn: &Connection, now: Millis) -> Result<usize> {
    let sql = format!(
        "UPDATE leases SET expires_at = MAX(expires_at, ?1 + ttl_ms) WHERE {LEASE_CURRENT} AND ttl_ms IS NOT NULL"
    );
    conn.execute(&sql, [now]).map_err(map_err)
}

pub fn list_leases(conn: &Connection, f: &LeaseFilter) -> Result<Vec<LeaseRecord>> {
    let (sql, args) = sql::list_leases('?', f);
    leases(conn, &sql, rusqlite::params_from_iter(args))
}

pub fn leases_to_reconcile(conn: &Connection, now: Millis) -> Result<Vec<LeaseRecord>> {
    let sql = format!(
        "SELECT {LEASE_COLS} FROM leases WHERE {LEASE_CURRENT} AND owner IS NOT NULL \
         UNION SELECT {LEASE_COLS} FROM leases WHERE {LEASE_CURRENT} AND expires_at <= ?1"
    );
    leases(conn, &sql, [now])
}

pub fn count_current_leases(conn: &Connection) -> Result<i64> {
    let sql = format!("SELECT count(*) FROM leases WHERE {LEASE_CURRENT}");
    conn.query_row(&sql, [], |r| r.get(0)).map_err(map_err)
}

pub fn events(conn: &Connection, after: i64, limit: u32) -> Result<Vec<EventRow>> {
    let mut stmt = conn
        .prepare_cached("SELECT seq, body FROM events WHERE seq > ?1 ORDER BY seq LIMIT ?2")
        .map_err(map_err)?;
    let rows = stmt
        .query_map(params![after, limit], |r| {
            Ok(EventRow {
                seq: r.get(0)?,
                payload: r.get(1)?,
            })
        })
        .map_err(map_err)?;
    rows.map(|r| r.map_err(map_err)).collect()
}

/// The last seq handed out, as PostgreSQL's `event_seq` counts it: kept by
/// AUTOINCREMENT in `sqlite_sequence`, so it holds when retention has
/// removed every event (where `MAX(seq)` would go back to 0).
pub fn last_event_seq(conn: &Connection) -> Result<i64> {
    conn.query_row(
        "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)",
        [],
        |r| r.get(0),
    )
    .map_err(map_err)
}

pub fn pruned_through(conn: &Connection) -> Result<i64> {
    Ok(meta(conn, "pruned_through")?
        .and_then(|v| v.parse().ok())
        .unwrap_or(0))
}

pub fn prune_events(
    conn: &Connection,
    keep_last: Option<u64>,
    older_than: Option<Millis>,
) -> Result<i64> {
    let mut through = pruned_through(conn)?;
    if let Some(keep) = keep_last {
        let max = last_event_seq(conn)?;
        through = through.max(max - i64::try_from(keep).unwrap_or(i64::MAX));
    }
    if let Some(before) = older_than {
        let seq: Option<i64> = conn
            .query_row("SELECT MAX(seq) FROM events WHERE at < ?1", [before], |r| {
                r.get(0)
            })
            .map_err(map_err)?;
        through = through.max(seq.unwrap_or(0));
    }
    if through > pruned_through(conn)? {
        conn.prepare_cached("DELETE FROM events WHERE seq <= ?1")
            .and_then(|mut s| s.execute([through]))
            .map_err(map_err)?;
        set_meta(conn, "pruned_through", &through.to_string())?;
    }
    Ok(through)
}
