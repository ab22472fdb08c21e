//! Port reservations inside write transactions.

use std::ops::RangeInclusive;

use serde_json::Value;

use crate::model::{PortOwner, PortRecord};
use crate::store::{Result, Tx};
use crate::tx::Ctx;
use crate::tx::ports::{end, insert, pick};

/// A refusal of a port request.
#[derive(Debug, Clone)]
pub enum PortError {
    NotFound,
    /// The owner is not current with that token; `current` is what is there now.
    Fenced(Box<Value>),
    Exhausted,
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
    owner_id: Option<&str>,
) -> Result<Result<PortRecord, PortError>> {
    let Some(mut rec) = tx.current_port(host_id, port).await? else {
        return Ok(Err(PortError::NotFound));
    };
    // The owner's token now: a process's changes when the reconciler claims it.
    let (owner, current) = match (&rec.owner.process, &rec.owner.lease) {
        (Some(p), _) => (Some(&p.id), tx.process(&p.id).await?.map(|p| p.token)),
        (None, Some(l)) => (Some(&l.id), Some(l.token)),
        (None, None) => (None, None),
    };
    let named_another = owner_id.is_some_and(|id| owner.is_none_or(|o| o != id));
    if current != Some(token) || named_another {
        return Ok(Err(PortError::Fenced(Box::new(
            serde_json::to_value(&rec).unwrap_or(Value::Null),
        ))));
    }
    end(tx, cx, &mut rec).await?;
    Ok(Ok(rec))
}
