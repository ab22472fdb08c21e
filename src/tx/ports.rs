//! Port reservations as every service's transactions keep them: picking
//! free ports, recording them, and ending them with their owner. Leases and
//! processes both use this; it calls back into neither.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::ops::RangeInclusive;

use serde_json::Value;

use super::Ctx;
use crate::events::{Subject, append};
use crate::model::{EventType, PortOwner, PortRecord};
use crate::store::{Result, Tx};

/// Whether `port` can be bound on 127.0.0.1 right now.
fn binds(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Choose a free port for each name, or None when the range has too few.
/// Writes nothing, so a caller may still refuse the request afterwards.
pub async fn pick(
    tx: &mut dyn Tx,
    host_id: &str,
    names: &[String],
    range: RangeInclusive<u16>,
) -> Result<Option<Vec<(String, u16)>>> {
    if names.is_empty() {
        return Ok(Some(Vec::new()));
    }
    let held: HashSet<u16> = tx.held_ports(host_id).await?.into_iter().collect();
    let (lo, hi) = (u32::from(*range.start()), u32::from(*range.end()));
    let size = hi - lo + 1;
    // Start at a random place so that concurrent servers and restarts spread out.
    let start = u32::try_from(RandomState::new().hash_one(host_id) % u64::from(size)).unwrap_or(0);
    let mut picked = Vec::with_capacity(names.len());
    for i in 0..size {
        let Ok(port) = u16::try_from(lo + (start + i) % size) else {
            continue;
        };
        if held.contains(&port) || picked.iter().any(|(_, p)| *p == port) || !binds(port) {
            continue;
        }
        picked.push((names[picked.len()].clone(), port));
        if picked.len() == names.len() {
            return Ok(Some(picked));
        }
    }
    Ok(None)
}

/// Record the picked ports for `owner` and append their events.
pub async fn insert(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    host_id: &str,
    owner: &PortOwner,
    picked: Vec<(String, u16)>,
) -> Result<Vec<PortRecord>> {
    let mut out = Vec::with_capacity(picked.len());
    for (name, port) in picked {
        let rec = PortRecord {
            id: uuid::Uuid::now_v7().to_string(),
            port,
            name,
            owner: owner.clone(),
            host_id: host_id.to_owned(),
            reserved_at: cx.now,
            released_at: None,
        };
        tx.insert_port(&rec).await?;
        append(
            tx,
            cx.now,
            EventType::PortReserved,
            Subject::Port(&rec),
            Value::Null,
        )
        .await?;
        out.push(rec);
    }
    Ok(out)
}

/// End every reservation of `owner_id`, with its events.
pub async fn release_all(tx: &mut dyn Tx, cx: Ctx<'_>, owner_id: &str) -> Result<()> {
    for mut rec in tx.ports_of(owner_id).await? {
        end(tx, cx, &mut rec).await?;
    }
    Ok(())
}

/// End one reservation and append its event.
pub async fn end(tx: &mut dyn Tx, cx: Ctx<'_>, rec: &mut PortRecord) -> Result<()> {
    tx.release_port(&rec.id, cx.now).await?;
    rec.released_at = Some(cx.now);
    append(
        tx,
        cx.now,
        EventType::PortReleased,
        Subject::Port(rec),
        Value::Null,
    )
    .await?;
    Ok(())
}
