//! Lease mutations as transaction scripts. Each runs inside one write
//! transaction (see `store::Tx`), re-reads what it depends on, applies the
//! takeover table first, and appends its events before it returns.

use serde_json::{Value, json};

use super::rules::{Verdict, expiry, verdict};
use super::{Acquire, Acquired, LeaseError, Outcome, Reclaimed};
use crate::model::{EventType, Judgement, LeaseRecord, LeaseState, LeaseView, ParentRef};
use crate::store::{Effect, Result, Tx};
use crate::time::Millis;
use crate::tx::Ctx;

/// The owner of `rec` judged now.
fn judge(cx: Ctx<'_>, rec: &LeaseRecord) -> Option<Judgement> {
    rec.owner.as_ref().map(|o| cx.host.judge(o))
}

fn view(rec: &LeaseRecord, owner: Option<Judgement>, now: Millis) -> Box<LeaseView> {
    Box::new(LeaseView::new(rec.clone(), owner, now))
}

async fn append(
    tx: &mut dyn Tx,
    now: Millis,
    kind: EventType,
    lease: &LeaseView,
    detail: Value,
) -> Result<()> {
    crate::events::append(tx, now, kind, crate::events::Subject::Lease(lease), detail).await
}

/// End a current lease and record why.
async fn end(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    rec: &mut LeaseRecord,
    owner: Option<Judgement>,
    state: LeaseState,
    reason: String,
    detail: Value,
) -> Result<()> {
    rec.state = state;
    rec.ended_at = Some(cx.now);
    rec.end_reason = Some(reason);
    tx.update_lease(rec).await?;
    tx.require_durable();
    tx.after_commit(Effect::LeaseEnded(rec.resource.clone()));
    // Reservations end in the same transaction as their owner.
    crate::tx::ports::release_all(tx, cx, &rec.id).await?;
    append(
        tx,
        cx.now,
        EventType::of_lease(state),
        &LeaseView::new(rec.clone(), owner, cx.now),
        detail,
    )
    .await?;
    Ok(())
}

/// Apply the takeover table to `rec` if it is current, ending it when the
/// table says so. Returns its owner's judgement and the verdict.
async fn apply_table(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    rec: &mut LeaseRecord,
) -> Result<(Option<Judgement>, Option<Verdict>)> {
    if !rec.state.is_current() {
        return Ok((None, None));
    }
    let owner = judge(cx, rec);
    let v = verdict(rec, owner, cx.now);
    if let Verdict::End { state, reason } = &v {
        end(tx, cx, rec, owner, *state, reason.clone(), Value::Null).await?;
    }
    Ok((owner, Some(v)))
}

/// The parent `id` if it is current with `token`, else `parent_fenced`.
pub(crate) async fn current_parent(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
) -> Result<Outcome<LeaseRecord>> {
    let Some(mut parent) = tx.lease(id).await? else {
        return Ok(Err(LeaseError::ParentFenced(None)));
    };
    let (owner, _) = apply_table(tx, cx, &mut parent).await?;
    if parent.state.is_current() && parent.token == token {
        Ok(Ok(parent))
    } else {
        Ok(Err(LeaseError::ParentFenced(Some(view(
            &parent, owner, cx.now,
        )))))
    }
}

pub async fn acquire(tx: &mut dyn Tx, cx: Ctx<'_>, cmd: Acquire) -> Result<Outcome<Acquired>> {
    let parent = match &cmd.parent {
        Some((id, token)) => match current_parent(tx, cx, id, *token).await? {
            Ok(p) => Some(ParentRef {
                id: p.id,
                resource: p.resource,
                token: p.token,
            }),
            Err(e) => return Ok(Err(e)),
        },
        None => None,
    };
    let mut reclaimed = None;
    if let Some(mut cur) = tx.current_lease(&cmd.resource).await? {
        let owner = judge(cx, &cur);
        match verdict(&cur, owner, cx.now) {
            Verdict::Held => return Ok(Err(LeaseError::Held(view(&cur, owner, cx.now)))),
            Verdict::OwnerRemote => {
                return Ok(Err(LeaseError::OwnerRemote(view(&cur, owner, cx.now))));
            }
            Verdict::OwnerUnverifiable => {
                return Ok(Err(LeaseError::OwnerUnverifiable(view(
                    &cur, owner, cx.now,
                ))));
            }
            Verdict::End { state, reason } => {
                let detail = json!({ "taken_over_by": cmd.holder });
                end(tx, cx, &mut cur, owner, state, reason.clone(), detail).await?;
                reclaimed = Some(Reclaimed {
                    id: cur.id,
                    token: cur.token,
                    reason,
                });
            }
        }
    }
    let token = tx.next_token(&cmd.resource).await?;
    let rec = LeaseRecord {
        id: uuid::Uuid::now_v7().to_string(),
        resource: cmd.resource,
        token,
        holder: cmd.holder,
        state: if cmd.reserve {
            LeaseState::Reserved
        } else {
            LeaseState::Active
        },
        owner: cmd.owner,
        parent,
        ttl_ms: cmd.ttl_ms,
        expires_at: expiry(cmd.ttl_ms, cx.now),
        acquired_at: cx.now,
        renewed_at: None,
        ended_at: None,
        end_reason: None,
        metadata: cmd.metadata,
    };
    tx.insert_lease(&rec).await?;
    let lease = LeaseView::new(rec.clone(), judge(cx, &rec), cx.now);
    let detail = match &reclaimed {
        Some(r) => json!({ "reclaimed": r }),
        None => Value::Null,
    };
    append(tx, cx.now, EventType::LeaseAcquired, &lease, detail).await?;
    Ok(Ok(Acquired { lease, reclaimed }))
}

/// Load a lease, apply the table, and check that it is current with `token`
/// and that its parent (if any) still is.
async fn fenced_current(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
) -> Result<Outcome<(LeaseRecord, Option<Judgement>)>> {
    let Some(rec) = tx.lease(id).await? else {
        return Ok(Err(LeaseError::NotFound));
    };
    fenced(tx, cx, rec, token).await
}

/// Apply the table to `rec`, just read, and check that it is current with `token`.
async fn fenced(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    mut rec: LeaseRecord,
    token: i64,
) -> Result<Outcome<(LeaseRecord, Option<Judgement>)>> {
    let (owner, _) = apply_table(tx, cx, &mut rec).await?;
    if !rec.state.is_current() || rec.token != token {
        return Ok(Err(LeaseError::Fenced(view(&rec, owner, cx.now))));
    }
    Ok(Ok((rec, owner)))
}

async fn parent_still_current(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    rec: &LeaseRecord,
) -> Result<Outcome<()>> {
    match &rec.parent {
        Some(p) => Ok(current_parent(tx, cx, &p.id, p.token).await?.map(|_| ())),
        None => Ok(Ok(())),
    }
}

pub async fn renew(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
    ttl_ms: Option<i64>,
) -> Result<Outcome<LeaseView>> {
    let (mut rec, owner) = match fenced_current(tx, cx, id, token).await? {
        Ok(found) => found,
        Err(e) => return Ok(Err(e)),
    };
    if let Err(e) = parent_still_current(tx, cx, &rec).await? {
        return Ok(Err(e));
    }
    rec.ttl_ms = ttl_ms.or(rec.ttl_ms);
    rec.expires_at = expiry(rec.ttl_ms, cx.now);
    rec.renewed_at = Some(cx.now);
    tx.update_lease(&rec).await?;
    Ok(Ok(*view(&rec, owner, cx.now)))
}

pub async fn activate(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
    owner: Option<crate::model::Identity>,
) -> Result<Outcome<LeaseView>> {
    let (mut rec, judged) = match fenced_current(tx, cx, id, token).await? {
        Ok(found) => found,
        Err(e) => return Ok(Err(e)),
    };
    if rec.state != LeaseState::Reserved {
        return Ok(Err(LeaseError::NotReserved(view(&rec, judged, cx.now))));
    }
    if let Err(e) = parent_still_current(tx, cx, &rec).await? {
        return Ok(Err(e));
    }
    rec.state = LeaseState::Active;
    if owner.is_some() {
        rec.owner = owner;
    }
    rec.expires_at = expiry(rec.ttl_ms, cx.now);
    rec.renewed_at = Some(cx.now);
    tx.update_lease(&rec).await?;
    let lease = LeaseView::new(rec.clone(), judge(cx, &rec), cx.now);
    append(tx, cx.now, EventType::LeaseActivated, &lease, Value::Null).await?;
    Ok(Ok(lease))
}

pub async fn release(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
) -> Result<Outcome<LeaseView>> {
    Ok(release_ending(tx, cx, id, token)
        .await?
        .map(|(lease, _)| lease))
}

/// `release`, and whether it ended the lease now (not a repeated release).
pub async fn release_ending(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
) -> Result<Outcome<(LeaseView, bool)>> {
    let Some(rec) = tx.lease(id).await? else {
        return Ok(Err(LeaseError::NotFound));
    };
    if rec.state == LeaseState::Released && rec.token == token {
        return Ok(Ok((*view(&rec, judge(cx, &rec), cx.now), false)));
    }
    let (mut rec, owner) = match fenced(tx, cx, rec, token).await? {
        Ok(found) => found,
        Err(e) => return Ok(Err(e)),
    };
    end(
        tx,
        cx,
        &mut rec,
        owner,
        LeaseState::Released,
        "released".into(),
        Value::Null,
    )
    .await?;
    Ok(Ok((*view(&rec, owner, cx.now), true)))
}

/// End a current lease whatever its owner's status; `by` names who asked.
pub async fn break_lease(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    reason: String,
    by: String,
) -> Result<Outcome<LeaseView>> {
    let Some(mut rec) = tx.lease(id).await? else {
        return Ok(Err(LeaseError::NotFound));
    };
    let owner = judge(cx, &rec);
    if !rec.state.is_current() {
        return Ok(Err(LeaseError::Fenced(view(&rec, owner, cx.now))));
    }
    let detail = json!({ "reason": reason, "by": by });
    end(
        tx,
        cx,
        &mut rec,
        owner,
        LeaseState::Broken,
        format!("broken:{reason}"),
        detail,
    )
    .await?;
    Ok(Ok(*view(&rec, owner, cx.now)))
}

/// Apply the table to one lease on the reconciler's behalf; Some when it ended.
pub async fn reconcile(tx: &mut dyn Tx, cx: Ctx<'_>, id: &str) -> Result<Option<LeaseView>> {
    let Some(mut rec) = tx.lease(id).await? else {
        return Ok(None);
    };
    let (owner, verdict) = apply_table(tx, cx, &mut rec).await?;
    Ok(matches!(verdict, Some(Verdict::End { .. })).then(|| *view(&rec, owner, cx.now)))
}
