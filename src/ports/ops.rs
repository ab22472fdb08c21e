//! Port reservations inside write transactions.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::ops::RangeInclusive;

use serde_json::Value;

use crate::events::{Subject, append};
use crate::leases::ops::Ctx;
use crate::model::{EventType, PortOwner, PortRecord};
use crate::store::{Result, Tx};

/// A refusal of a port request.
#[derive(Debug, Clone)]
pub enum PortError {
    NotFound,
    /// The owner is not current with that token; `current` is what is there now.
    Fenced(Box<Value>),
    Exhausted,
}

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
async fn end(tx: &mut dyn Tx, cx: Ctx<'_>, rec: &mut PortRecord) -> Result<()> {
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

/// The owner's record as it is now, when it is not current with `token`.
async fn owner_fenced(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    owner: &PortOwner,
) -> Result<Option<Result<Value, PortError>>> {
    let Some(target) = owner.target() else {
        return Ok(Some(Err(PortError::NotFound)));
    };
    if owner.process.is_some() {
        let Some(p) = tx.process(&target.id).await? else {
            return Ok(Some(Err(PortError::NotFound)));
        };
        if p.state.is_current() && p.token == target.token {
            return Ok(None);
        }
        let view = crate::processes::ops::view(tx, cx, p).await?;
        return Ok(Some(Ok(serde_json::to_value(view).unwrap_or(Value::Null))));
    }
    match crate::leases::ops::current_parent(tx, cx, &target.id, target.token).await? {
        Ok(_) => Ok(None),
        Err(crate::leases::LeaseError::ParentFenced(Some(l))) => {
            Ok(Some(Ok(serde_json::to_value(l).unwrap_or(Value::Null))))
        }
        Err(_) => Ok(Some(Err(PortError::NotFound))),
    }
}

pub async fn reserve(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    host_id: &str,
    owner: PortOwner,
    names: Vec<String>,
    range: RangeInclusive<u16>,
) -> Result<Result<Vec<PortRecord>, PortError>> {
    match owner_fenced(tx, cx, &owner).await? {
        None => {}
        Some(Ok(current)) => return Ok(Err(PortError::Fenced(Box::new(current)))),
        Some(Err(e)) => return Ok(Err(e)),
    }
    let Some(picked) = pick(tx, host_id, &names, range).await? else {
        return Ok(Err(PortError::Exhausted));
    };
    Ok(Ok(insert(tx, cx, host_id, &owner, picked).await?))
}

/// Release one reservation with its owner's token.
pub async fn release(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    host_id: &str,
    port: u16,
    token: i64,
) -> Result<Result<PortRecord, PortError>> {
    let Some(mut rec) = tx.current_port(host_id, port).await? else {
        return Ok(Err(PortError::NotFound));
    };
    // The owner's token now: a process's changes when the reconciler claims it.
    let current = match (&rec.owner.process, &rec.owner.lease) {
        (Some(p), _) => tx.process(&p.id).await?.map(|p| p.token),
        (None, Some(l)) => Some(l.token),
        (None, None) => None,
    };
    if current != Some(token) {
        return Ok(Err(PortError::Fenced(Box::new(
            serde_json::to_value(&rec).unwrap_or(Value::Null),
        ))));
    }
    end(tx, cx, &mut rec).await?;
    Ok(Ok(rec))
}
