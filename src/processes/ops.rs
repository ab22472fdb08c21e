//! Process mutations as transaction scripts: each runs inside one write
//! transaction, re-reads the record, checks its token, and appends its events.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;

use serde_json::{Value, json};

use crate::caller::Caller;
use crate::events::{Subject, append};
use crate::host::signal::OwnIds;
use crate::leases::ops::current_parent;
use crate::leases::{LeaseError, rules::expiry};
use crate::model::{
    Command, EventType, Exit, Identity, Liveness, LivenessReason, Logs, PortOwner, ProcessRecord,
    ProcessState, ProcessView, TokenRef,
};
use crate::store::{Result, Tx};
use crate::tx::Ctx;
use crate::tx::ports;

/// A refusal the contract names; the store's state is still committed.
#[derive(Debug, Clone)]
pub enum ProcError {
    NotFound,
    Fenced(Box<ProcessView>),
    OperationInProgress(Box<ProcessView>),
    /// The owning lease is not current (`parent_fenced`).
    LeaseFenced(Option<Box<crate::model::LeaseView>>),
    ProcessAlive(Box<ProcessView>),
    RemoteProcess(Box<ProcessView>),
    Forbidden(String),
    PortsExhausted,
    /// The pid is now another process; nothing was signalled.
    IdentityMismatch(Box<ProcessView>),
    NotSettled(Box<ProcessView>),
}

impl ProcError {
    /// The contract's code for this refusal.
    pub fn code(&self) -> crate::model::Code {
        use crate::model::Code;
        match self {
            Self::NotFound => Code::NotFound,
            Self::Fenced(_) => Code::Fenced,
            Self::OperationInProgress(_) => Code::OperationInProgress,
            Self::LeaseFenced(_) => Code::ParentFenced,
            Self::ProcessAlive(_) => Code::ProcessAlive,
            Self::RemoteProcess(_) => Code::RemoteProcess,
            Self::Forbidden(_) => Code::Forbidden,
            Self::PortsExhausted => Code::PortsExhausted,
            Self::IdentityMismatch(_) => Code::IdentityMismatch,
            Self::NotSettled(_) => Code::ProcessTreeNotSettled,
        }
    }
}

pub type Outcome<T> = std::result::Result<T, ProcError>;

/// The process as the API shows it, with its ports and its identity judged now.
pub async fn view(tx: &mut dyn Tx, cx: Ctx<'_>, rec: ProcessRecord) -> Result<ProcessView> {
    let ports: BTreeMap<String, u16> = tx
        .ports_of(&rec.id)
        .await?
        .into_iter()
        .map(|p| (p.name, p.port))
        .collect();
    let judged = rec.identity.as_ref().map(|i| cx.host.judge(i));
    Ok(ProcessView::new(rec, judged, ports))
}

async fn boxed(tx: &mut dyn Tx, cx: Ctx<'_>, rec: &ProcessRecord) -> Result<Box<ProcessView>> {
    Ok(Box::new(view(tx, cx, rec.clone()).await?))
}

async fn event(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    kind: EventType,
    rec: &ProcessRecord,
    detail: Value,
) -> Result<ProcessView> {
    let v = view(tx, cx, rec.clone()).await?;
    append(tx, cx.now, kind, Subject::Process(&v), detail).await?;
    Ok(v)
}

/// End a current process in `state`, free its ports, and record why.
async fn end(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    rec: &mut ProcessRecord,
    state: ProcessState,
    reason: String,
) -> Result<ProcessView> {
    end_with(tx, cx, rec, state, reason, Value::Null).await
}

/// `end`, with `detail` in its event.
async fn end_with(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    rec: &mut ProcessRecord,
    state: ProcessState,
    reason: String,
    detail: Value,
) -> Result<ProcessView> {
    rec.state = state;
    rec.ended_at = Some(cx.now);
    rec.end_reason = Some(reason);
    tx.update_process(rec).await?;
    tx.require_durable();
    ports::release_all(tx, cx, &rec.id).await?;
    event(tx, cx, EventType::of_process(state), rec, detail).await
}

/// A process record about to be created.
#[derive(Clone)]
pub struct Create {
    pub id: String,
    pub kind: String,
    pub operation_id: Option<String>,
    pub lease: Option<TokenRef>,
    pub owner: Option<Identity>,
    pub ttl_ms: Option<i64>,
    pub metadata: serde_json::Map<String, Value>,
    pub command: Option<Command>,
    pub logs: Option<Logs>,
    pub port_names: Vec<String>,
    pub port_range: RangeInclusive<u16>,
}

/// Record a `starting` process, with its ports, after checking that its
/// operation id is free and its lease current. Nothing is written when a
/// check fails.
pub async fn create(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    host_id: &str,
    c: Create,
) -> Result<Outcome<(ProcessRecord, BTreeMap<String, u16>)>> {
    if let Some(op) = &c.operation_id
        && let Some(other) = tx.process_by_operation(op).await?
    {
        return Ok(Err(ProcError::OperationInProgress(
            boxed(tx, cx, &other).await?,
        )));
    }
    if let Some(l) = &c.lease {
        match current_parent(tx, cx, &l.id, l.token).await? {
            Ok(_) => {}
            Err(LeaseError::ParentFenced(v)) => return Ok(Err(ProcError::LeaseFenced(v))),
            Err(_) => return Ok(Err(ProcError::LeaseFenced(None))),
        }
    }
    let Some(picked) = ports::pick(tx, host_id, &c.port_names, c.port_range).await? else {
        return Ok(Err(ProcError::PortsExhausted));
    };
    let rec = ProcessRecord {
        id: c.id,
        kind: c.kind,
        state: ProcessState::Starting,
        token: 1,
        operation_id: c.operation_id,
        lease: c.lease,
        host_id: host_id.to_owned(),
        identity: None,
        signal_group: false,
        owner: c.owner,
        spawned: c.command.is_some(),
        command: c.command,
        logs: c.logs,
        exit: Exit::default(),
        ttl_ms: c.ttl_ms,
        expires_at: expiry(c.ttl_ms, cx.now),
        created_at: cx.now,
        started_at: None,
        ended_at: None,
        end_reason: None,
        metadata: c.metadata,
    };
    tx.insert_process(&rec).await?;
    event(tx, cx, EventType::ProcessRegistered, &rec, Value::Null).await?;
    let owner = PortOwner {
        process: Some(TokenRef {
            id: rec.id.clone(),
            token: rec.token,
        }),
        lease: None,
    };
    let reserved = ports::insert(tx, cx, host_id, &owner, picked).await?;
    let ports = reserved.into_iter().map(|p| (p.name, p.port)).collect();
    Ok(Ok((rec, ports)))
}

/// A spawned or confirmed process is running with this identity; a stop
/// signals the group it leads if `signal_group`.
pub async fn started(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    identity: Identity,
    signal_group: bool,
) -> Result<Outcome<ProcessView>> {
    let Some(mut rec) = tx.process(id).await? else {
        return Ok(Err(ProcError::NotFound));
    };
    if rec.state != ProcessState::Starting {
        return Ok(Err(ProcError::Fenced(boxed(tx, cx, &rec).await?)));
    }
    rec.state = ProcessState::Running;
    rec.identity = Some(identity);
    rec.signal_group = signal_group;
    rec.started_at = Some(cx.now);
    tx.update_process(&rec).await?;
    Ok(Ok(event(
        tx,
        cx,
        EventType::ProcessRunning,
        &rec,
        Value::Null,
    )
    .await?))
}

/// The spawn failed after the record was made: it ends `failed`.
pub async fn spawn_failed(tx: &mut dyn Tx, cx: Ctx<'_>, id: &str, reason: String) -> Result<()> {
    if let Some(mut rec) = tx.process(id).await?
        && rec.state.is_current()
    {
        end(tx, cx, &mut rec, ProcessState::Failed, reason).await?;
    }
    Ok(())
}

async fn fenced(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
) -> Result<Outcome<ProcessRecord>> {
    let Some(rec) = tx.process(id).await? else {
        return Ok(Err(ProcError::NotFound));
    };
    if rec.token != token {
        return Ok(Err(ProcError::Fenced(boxed(tx, cx, &rec).await?)));
    }
    Ok(Ok(rec))
}

pub async fn confirm(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
    identity: Identity,
    signal_group: bool,
) -> Result<Outcome<ProcessView>> {
    let rec = match fenced(tx, cx, id, token).await? {
        Ok(r) => r,
        Err(e) => return Ok(Err(e)),
    };
    let same = rec
        .identity
        .as_ref()
        .is_some_and(|i| i.same_process(&identity));
    if rec.state == ProcessState::Running && same {
        return Ok(Ok(view(tx, cx, rec).await?));
    }
    if rec.state != ProcessState::Starting {
        return Ok(Err(ProcError::Fenced(boxed(tx, cx, &rec).await?)));
    }
    started(tx, cx, id, identity, signal_group).await
}

pub async fn heartbeat(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
    ttl_ms: Option<i64>,
) -> Result<Outcome<ProcessView>> {
    let mut rec = match fenced(tx, cx, id, token).await? {
        Ok(r) => r,
        Err(e) => return Ok(Err(e)),
    };
    if !rec.state.is_current() {
        return Ok(Err(ProcError::Fenced(boxed(tx, cx, &rec).await?)));
    }
    rec.ttl_ms = ttl_ms.or(rec.ttl_ms);
    rec.expires_at = expiry(rec.ttl_ms, cx.now);
    tx.update_process(&rec).await?;
    Ok(Ok(view(tx, cx, rec).await?))
}

/// What a stop request finds.
pub enum StopStart {
    /// Nothing to signal: the answer is this record.
    Done(ProcessView),
    /// Signal this record's process; it is now `stopping` (or stays `orphaned`).
    Signal(ProcessRecord),
}

/// Begin a stop: fence, refuse what must not be signalled, mark `stopping`.
pub async fn begin_stop(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
    own: OwnIds,
    host_id: &str,
    caller: Caller,
) -> Result<Outcome<StopStart>> {
    let mut rec = match fenced(tx, cx, id, token).await? {
        Ok(r) => r,
        Err(e) => return Ok(Err(e)),
    };
    if !rec.state.is_current() {
        return Ok(Ok(StopStart::Done(view(tx, cx, rec).await?)));
    }
    // Nothing was ever confirmed for it: there is nothing to signal.
    if rec.identity.is_none() {
        let v = end(
            tx,
            cx,
            &mut rec,
            ProcessState::Stopped,
            "stopped_before_start".into(),
        )
        .await?;
        return Ok(Ok(StopStart::Done(v)));
    }
    let remote = rec.host_id != host_id
        || rec
            .identity
            .as_ref()
            .is_some_and(|i| cx.host.judge(i).status == Liveness::Remote);
    if remote {
        return Ok(Err(ProcError::RemoteProcess(boxed(tx, cx, &rec).await?)));
    }
    if let Some(why) = rec
        .identity
        .as_ref()
        .filter(|_| !rec.spawned)
        .and_then(|i| own.refusal(i))
    {
        return Ok(Err(ProcError::Forbidden(why)));
    }
    // Checked here, in the transaction, on the identity that will be signalled.
    if let Some(ident) = &rec.identity
        && let Err(why) = caller.may_act_on(ident.uid, own.uid)
    {
        return Ok(Err(ProcError::Forbidden(why)));
    }
    if rec.state == ProcessState::Running {
        rec.state = ProcessState::Stopping;
        tx.update_process(&rec).await?;
    }
    Ok(Ok(StopStart::Signal(rec)))
}

/// How the stop procedure went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// The process and its group are gone; how it ended, when known (the
    /// exit status of our own child).
    Settled(Exit),
    /// Still alive after TERM, grace (and KILL when forced).
    NotSettled,
    /// The pid belongs to another process now: nothing was signalled.
    Reused,
}

/// Keep an exit status learnt late, unless one was recorded already.
fn learn_exit(rec: &mut ProcessRecord, exit: Exit) {
    if rec.exit == Exit::default() {
        rec.exit = exit;
    }
}

/// Record the end of a stop that `begin_stop` began with `token`.
pub async fn end_stop(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
    outcome: Stopped,
    reason: Option<String>,
) -> Result<Outcome<ProcessView>> {
    let mut rec = match fenced(tx, cx, id, token).await? {
        Ok(r) => r,
        Err(e) => return Ok(Err(e)),
    };
    if !rec.state.is_current() {
        return Ok(Ok(view(tx, cx, rec).await?));
    }
    match outcome {
        Stopped::Settled(exit) => {
            learn_exit(&mut rec, exit);
            let reason = reason.unwrap_or_else(|| "stopped".into());
            Ok(Ok(
                end(tx, cx, &mut rec, ProcessState::Stopped, reason).await?
            ))
        }
        Stopped::Reused => {
            let v = end(tx, cx, &mut rec, ProcessState::Exited, "pid_reused".into()).await?;
            Ok(Err(ProcError::IdentityMismatch(Box::new(v))))
        }
        Stopped::NotSettled => {
            if rec.state == ProcessState::Stopping {
                rec.state = ProcessState::Running;
                tx.update_process(&rec).await?;
            }
            Ok(Err(ProcError::NotSettled(boxed(tx, cx, &rec).await?)))
        }
    }
}

/// How the client says a process it ran itself ended.
#[derive(Debug, Clone)]
pub struct Finish {
    pub state: ProcessState,
    pub reason: Option<String>,
    pub exit_code: Option<i32>,
    /// The admin's word that the record's host is gone for good: a record
    /// of another host then ends without the check only that host could make.
    pub host_gone: bool,
}

/// The client reports how a process it runs itself ended.
pub async fn finish(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
    f: Finish,
) -> Result<Outcome<ProcessView>> {
    let mut rec = match fenced(tx, cx, id, token).await? {
        Ok(r) => r,
        Err(e) => return Ok(Err(e)),
    };
    if !rec.state.is_current() {
        return Ok(Ok(view(tx, cx, rec).await?));
    }
    // A process of another host may still run there: only its own host
    // can tell, and a live process never loses its operation id or ports.
    // The admin's word stands in for that host's only when the record is of
    // another host: one of another PID namespace here may well run.
    let mut vouched = false;
    if let Some(j) = rec.identity.as_ref().map(|i| cx.host.judge(i)) {
        match j.status {
            Liveness::Live => {
                return Ok(Err(ProcError::ProcessAlive(boxed(tx, cx, &rec).await?)));
            }
            Liveness::Remote if f.host_gone && j.reason == Some(LivenessReason::OtherHost) => {
                vouched = true;
            }
            Liveness::Remote => {
                return Ok(Err(ProcError::RemoteProcess(boxed(tx, cx, &rec).await?)));
            }
            _ => {}
        }
    }
    if f.exit_code.is_some() {
        rec.exit.code = f.exit_code;
    }
    let reason = f.reason.unwrap_or_else(|| f.state.as_str().to_owned());
    // Its event says that nobody checked it ended, as a break says who broke.
    let detail = if vouched {
        json!({"host_gone": true})
    } else {
        Value::Null
    };
    Ok(Ok(
        end_with(tx, cx, &mut rec, f.state, reason, detail).await?
    ))
}

/// The watched process exited. A `running` record ends `exited`; one being
/// stopped only learns its exit status (the stopper ends it).
pub async fn exited(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    pid: i32,
    exit: Exit,
    reason: &str,
) -> Result<()> {
    let Some(mut rec) = tx.process(id).await? else {
        return Ok(());
    };
    if rec.pid() != Some(pid) {
        return Ok(());
    }
    let known = exit.code.is_some() || exit.signal.is_some();
    match rec.state {
        ProcessState::Running => {
            rec.exit = exit;
            end(tx, cx, &mut rec, ProcessState::Exited, reason.to_owned()).await?;
        }
        _ if known && rec.exit == Exit::default() => {
            rec.exit = exit;
            tx.update_process(&rec).await?;
        }
        _ => {}
    }
    Ok(())
}

/// Why the reconciler would claim `rec`, read inside the transaction.
pub async fn claim_reason(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    rec: &ProcessRecord,
) -> Result<Option<&'static str>> {
    if !super::rules::may_be_claimed(rec.state) {
        return Ok(None);
    }
    let lease = match &rec.lease {
        Some(l) => tx.lease(&l.id).await?,
        None => None,
    };
    let owner = rec.owner.as_ref().map(|o| cx.host.judge(o));
    Ok(super::rules::claim_reason(
        rec,
        lease.as_ref(),
        owner,
        cx.now,
    ))
}

/// The reconciler claims `id` if it still must: a new token fences the old
/// holder, and the record is `orphaned` until its tree is stopped.
pub async fn claim(tx: &mut dyn Tx, cx: Ctx<'_>, id: &str) -> Result<Option<ProcessRecord>> {
    let Some(mut rec) = tx.process(id).await? else {
        return Ok(None);
    };
    let Some(why) = claim_reason(tx, cx, &rec).await? else {
        return Ok(None);
    };
    rec.token += 1;
    let unconfirmed = rec.identity.is_none();
    rec.state = ProcessState::Orphaned;
    tx.update_process(&rec).await?;
    tx.require_durable();
    event(
        tx,
        cx,
        EventType::ProcessOrphaned,
        &rec,
        json!({ "reason": why }),
    )
    .await?;
    if unconfirmed {
        // Never confirmed, it has no process tree to stop: it ends in the
        // claim's own transaction, as a stop of a `starting` record does.
        end_orphan_record(tx, cx, &mut rec).await?;
        return Ok(None);
    }
    Ok(Some(rec))
}

/// An orphan's stop is over: `stopped` as `orphan_reconciled`.
async fn end_orphan_record(tx: &mut dyn Tx, cx: Ctx<'_>, rec: &mut ProcessRecord) -> Result<()> {
    end(
        tx,
        cx,
        rec,
        ProcessState::Stopped,
        "orphan_reconciled".into(),
    )
    .await?;
    Ok(())
}

/// The reconciler's stop of an orphan is over.
pub async fn end_orphan(
    tx: &mut dyn Tx,
    cx: Ctx<'_>,
    id: &str,
    token: i64,
    outcome: Stopped,
    first_failure: bool,
) -> Result<()> {
    let Some(mut rec) = tx.process(id).await? else {
        return Ok(());
    };
    if rec.token != token || rec.state != ProcessState::Orphaned {
        return Ok(());
    }
    match outcome {
        Stopped::Settled(exit) => {
            learn_exit(&mut rec, exit);
            end_orphan_record(tx, cx, &mut rec).await?;
        }
        Stopped::Reused => {
            end(tx, cx, &mut rec, ProcessState::Exited, "pid_reused".into()).await?;
        }
        // Reported once per orphan and server run, not on every retry.
        Stopped::NotSettled if !first_failure => {}
        Stopped::NotSettled => {
            event(
                tx,
                cx,
                EventType::ProcessKillFailed,
                &rec,
                json!({ "reason": "process tree did not settle after SIGKILL" }),
            )
            .await?;
        }
    }
    Ok(())
}
