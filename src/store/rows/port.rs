//! Port reservations.

use crate::model::{PortOwner, PortRecord, TokenRef};
use crate::store::db::{Cols, Exec, Stmt, decode_err};
use crate::store::sql::{self, port_cols};
use crate::store::{Result, StoreError};
use crate::time::Millis;

fn port_number(v: i64) -> Result<u16> {
    u16::try_from(v).map_err(|e| decode_err("port", e))
}

fn port_row(r: &impl Cols) -> Result<PortRecord> {
    let target = TokenRef {
        id: r.text(5)?,
        token: r.int(6)?,
    };
    let owner = if r.text(4)? == "process" {
        PortOwner {
            process: Some(target),
            lease: None,
        }
    } else {
        PortOwner {
            process: None,
            lease: Some(target),
        }
    };
    Ok(PortRecord {
        id: r.text(0)?,
        host_id: r.text(1)?,
        port: port_number(r.int(2)?)?,
        name: r.text(3)?,
        owner,
        reserved_at: r.int(7)?,
        released_at: r.opt_int(8)?,
    })
}

async fn ports<E: Exec + ?Sized>(c: &mut E, s: Stmt<'_>) -> Result<Vec<PortRecord>> {
    c.fetch(s).await?.iter().map(port_row).collect()
}

pub async fn held_ports<E: Exec + ?Sized>(c: &mut E, host_id: &str) -> Result<Vec<u16>> {
    let s = Stmt::new("SELECT port FROM ports WHERE host_id = $1 AND released_at IS NULL");
    c.fetch(s.text(host_id))
        .await?
        .iter()
        .map(|r| port_number(r.int(0)?))
        .collect()
}

pub async fn current_port<E: Exec + ?Sized>(
    c: &mut E,
    host_id: &str,
    port: u16,
) -> Result<Option<PortRecord>> {
    const SQL: &str = concat!(
        "SELECT ",
        port_cols!(),
        " FROM ports WHERE host_id = $1 AND port = $2 AND released_at IS NULL"
    );
    let s = Stmt::new(SQL).text(host_id).int(i64::from(port));
    Ok(ports(c, s).await?.pop())
}

pub async fn insert_port<E: Exec + ?Sized>(c: &mut E, p: &PortRecord) -> Result<()> {
    const SQL: &str = concat!(
        "INSERT INTO ports (",
        port_cols!(),
        ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
    );
    let target = p
        .owner
        .target()
        .ok_or_else(|| StoreError::Other("a port without an owner".into()))?;
    let s = Stmt::new(SQL)
        .text(&p.id)
        .text(&p.host_id)
        .int(i64::from(p.port))
        .text(&p.name)
        .text(p.owner.kind())
        .text(&target.id)
        .int(target.token)
        .int(p.reserved_at)
        .opt_int(p.released_at);
    c.execute(s).await
}

/// The current reservations of an owner (`$1`), by name.
pub const PORTS_OF: &str = concat!(
    "SELECT ",
    port_cols!(),
    " FROM ports WHERE owner_id = $1 AND released_at IS NULL ORDER BY name"
);

pub async fn ports_of<E: Exec + ?Sized>(c: &mut E, owner_id: &str) -> Result<Vec<PortRecord>> {
    ports(c, Stmt::new(PORTS_OF).text(owner_id)).await
}

pub async fn ports_of_owners<E: Exec + ?Sized>(
    c: &mut E,
    owner_ids: &[String],
) -> Result<Vec<PortRecord>> {
    if owner_ids.is_empty() {
        return Ok(Vec::new());
    }
    let page = sql::ports_of_owners(owner_ids);
    ports(c, page.stmt()).await
}

pub async fn release_port<E: Exec + ?Sized>(c: &mut E, id: &str, at: Millis) -> Result<()> {
    let s = Stmt::new("UPDATE ports SET released_at = $1 WHERE id = $2 AND released_at IS NULL");
    c.execute(s.int(at).text(id)).await
}

/// Current reservations are few (at most one per port and host), so they
/// are sorted by id as they are read, without an index of their own.
pub async fn list_ports<E: Exec + ?Sized>(
    c: &mut E,
    host_id: Option<&str>,
    before_id: Option<&str>,
    limit: u32,
) -> Result<Vec<PortRecord>> {
    let page = sql::list_ports(host_id, before_id, limit);
    ports(c, page.stmt()).await
}
