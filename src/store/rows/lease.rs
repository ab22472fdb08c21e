//! Leases and the fencing-token counter.

use crate::model::{LeaseFilter, LeaseRecord, LeaseState, ParentRef};
use crate::store::db::{Cols, Exec, Hot, Stmt, decode_err, from_json, scalar, to_json};
use crate::store::sql::{self, lease_cols, lease_current};
use crate::store::{Result, StoreError};
use crate::time::Millis;

pub fn lease_row(r: &impl Cols) -> Result<LeaseRecord> {
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

/// A lease by id (`$1`), locked, whether it holds reservations (so that
/// releasing it need not ask), and its row version (`cache::Version`).
/// Columns 16 and 17 are those.
pub const LEASE_LOCKED: &str = concat!(
    "SELECT ",
    lease_cols!(),
    ", EXISTS (SELECT 1 FROM ports WHERE owner_id = $1 AND released_at IS NULL), \
     xmin::text::bigint FROM leases WHERE id = $1 FOR UPDATE"
);

pub async fn lease<E: Exec + ?Sized>(c: &mut E, id: &str) -> Result<Option<LeaseRecord>> {
    const SQL: &str = concat!("SELECT ", lease_cols!(), " FROM leases WHERE id = $1");
    Ok(leases(c, Stmt::new(SQL).text(id)).await?.pop())
}

/// A lease a write transaction may change, as `Locked`. Where `c` locks
/// what it reads (`Exec::locks_rows`, PostgreSQL) the row is locked, and
/// whether the lease holds reservations and its version come with it.
pub async fn lease_to_write<E: Exec + ?Sized>(c: &mut E, id: &str) -> Result<Locked> {
    if !c.locks_rows() {
        return Ok(Locked {
            lease: lease(c, id).await?,
            ..Locked::default()
        });
    }
    let rows = c.fetch(Stmt::new(LEASE_LOCKED).text(id)).await?;
    match rows.first() {
        Some(r) => Ok(Locked {
            lease: Some(lease_row(r)?),
            has_ports: Some(r.flag(16)?),
            version: r.opt_int(17)?,
            last_token: None,
        }),
        None => Ok(Locked::default()),
    }
}

/// A lease read for a write transaction, and what came with it where the
/// store locks what it reads (None elsewhere).
#[derive(Debug, Default)]
pub struct Locked {
    pub lease: Option<LeaseRecord>,
    /// Whether the lease holds reservations.
    pub has_ports: Option<bool>,
    /// The lease row's version (`cache::Version`).
    pub version: Option<i64>,
    /// The resource's last token (None too for a resource never leased).
    pub last_token: Option<i64>,
}

/// The current lease of a resource (`$1`), locked, with its row version,
/// and the resource's last token (so that acquiring it need not count it
/// on in a round trip of its own): one row, whose lease columns are null
/// when none is current; column 16 the version, 17 the token (null for a
/// resource never leased).
pub const CURRENT_LOCKED: &str = concat!(
    "SELECT l.*, (SELECT last_token FROM resources WHERE resource = $1) \
     FROM (SELECT 1) AS one LEFT JOIN LATERAL (SELECT ",
    lease_cols!(),
    ", xmin::text::bigint FROM leases WHERE resource = $1 AND ",
    lease_current!(),
    " FOR UPDATE) AS l ON true"
);

/// The current lease of `resource`.
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

/// The current lease of `resource`, for a write transaction. Those already
/// exclude each other (SQLite's one writer, PostgreSQL's fleet lock); where
/// `c` locks what it reads (PostgreSQL) the row is locked against
/// one-statement renewals all the same, and its version and the resource's
/// last token come with it.
pub async fn current_lease_to_write<E: Exec + ?Sized>(c: &mut E, resource: &str) -> Result<Locked> {
    if !c.locks_rows() {
        return Ok(Locked {
            lease: current_lease(c, resource).await?,
            ..Locked::default()
        });
    }
    let rows = c.fetch(Stmt::new(CURRENT_LOCKED).text(resource)).await?;
    let Some(r) = rows.first() else {
        return Ok(Locked::default());
    };
    let lease = match r.opt_text(0)? {
        Some(_) => Some(lease_row(r)?),
        None => None,
    };
    Ok(Locked {
        lease,
        has_ports: None,
        version: r.opt_int(16)?,
        last_token: r.opt_int(17)?,
    })
}

/// Counts a resource's (`$1`) last token on by one and returns it.
pub const NEXT_TOKEN: &str = "INSERT INTO resources (resource, last_token) VALUES ($1, 1) \
     ON CONFLICT (resource) DO UPDATE SET last_token = resources.last_token + 1 \
     RETURNING last_token";

pub async fn next_token<E: Exec + ?Sized>(c: &mut E, resource: &str) -> Result<i64> {
    let s = Stmt::new(NEXT_TOKEN);
    scalar(c, s.text(resource))
        .await?
        .ok_or_else(|| StoreError::Other("no token was returned".into()))
}

/// Sets a resource's last token: `$1` the resource, `$2` the token.
pub const SET_TOKEN: &str = "INSERT INTO resources (resource, last_token) VALUES ($1, $2) \
     ON CONFLICT (resource) DO UPDATE SET last_token = excluded.last_token";

/// Record `token` as the last of `resource`, when the caller counted it.
pub async fn set_token<E: Exec + ?Sized>(c: &mut E, resource: &str, token: i64) -> Result<()> {
    let s = Stmt::new(SET_TOKEN).text(resource).int(token);
    c.execute_hot(Hot::Token, s, None).await
}

/// Inserts a lease: `$1`.. its columns in the order of `lease_cols!`.
pub const INSERT_LEASE: &str = concat!(
    "INSERT INTO leases (",
    lease_cols!(),
    ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)"
);

/// Updates a lease: `$1` its id, then the columns that change.
pub const UPDATE_LEASE: &str = "UPDATE leases SET state = $2, owner = $3, ttl_ms = $4, \
     expires_at = $5, renewed_at = $6, ended_at = $7, end_reason = $8 WHERE id = $1";

/// `UPDATE_LEASE` of the columns a renewal changes, with the same
/// parameters: SQLite rewrites the entries of every index whose columns
/// (or whose `WHERE`'s) an UPDATE sets, changed or not, and a renewal
/// changes one index (the current leases' expiry) of the five.
pub const RENEW_LEASE: &str =
    "UPDATE leases SET ttl_ms = $4, expires_at = $5, renewed_at = $6 WHERE id = $1";

/// Where each value of an `UPDATE_LEASE` row goes in an `INSERT_LEASE` row.
pub const UPDATE_INTO_INSERT: [usize; 8] = [0, 4, 5, 9, 10, 12, 13, 14];

/// `INSERT_LEASE` for `l`.
pub fn insert_lease_stmt(l: &LeaseRecord) -> Result<Stmt<'_>> {
    Ok(Stmt::new(INSERT_LEASE)
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
        .owned(Some(to_json(&l.metadata)?)))
}

/// `UPDATE_LEASE` for `l`.
pub fn update_lease_stmt(l: &LeaseRecord) -> Result<Stmt<'_>> {
    Ok(Stmt::new(UPDATE_LEASE)
        .text(&l.id)
        .text(l.state.as_str())
        .owned(l.owner.as_ref().map(to_json).transpose()?)
        .opt_int(l.ttl_ms)
        .opt_int(l.expires_at)
        .opt_int(l.renewed_at)
        .opt_int(l.ended_at)
        .opt_text(l.end_reason.as_deref()))
}

pub async fn insert_lease<E: Exec + ?Sized>(c: &mut E, l: &LeaseRecord) -> Result<()> {
    c.execute_hot(Hot::LeaseInsert, insert_lease_stmt(l)?, None)
        .await
}

/// Write `l`; `renewal` when only its TTL, expiry and renewal time change.
pub async fn update_lease<E: Exec + ?Sized>(
    c: &mut E,
    l: &LeaseRecord,
    renewal: bool,
) -> Result<()> {
    let what = format!("lease {}", l.id);
    let hot = if renewal {
        Hot::LeaseRenewal
    } else {
        Hot::LeaseUpdate
    };
    c.execute_hot(hot, update_lease_stmt(l)?, Some(what)).await
}

pub async fn list_leases<E: Exec + ?Sized>(c: &mut E, f: &LeaseFilter) -> Result<Vec<LeaseRecord>> {
    let page = sql::list_leases(f);
    leases(c, page.stmt()).await
}

/// The current leases the reconciler looks at (`$1`, the instant): those
/// with an owner to judge, and those past their expiry. Both halves go
/// through the partial indexes of current leases, however many ended ones
/// are stored (tests in `store::sqlite::writer` and `store::postgres::plans`).
pub const TO_RECONCILE: &str = concat!(
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

pub async fn leases_to_reconcile<E: Exec + ?Sized>(
    c: &mut E,
    now: Millis,
) -> Result<Vec<LeaseRecord>> {
    leases(c, Stmt::new(TO_RECONCILE).int(now)).await
}

pub async fn count_current_leases<E: Exec + ?Sized>(c: &mut E) -> Result<i64> {
    super::count(
        c,
        concat!("SELECT count(*) FROM leases WHERE ", lease_current!()),
    )
    .await
}
