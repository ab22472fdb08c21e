//! Managed processes: spawn or register, watch, stop safely, and reclaim the
//! ones whose owner went away. The rules live in `ops` (transactions) and
//! `stop` (signals); this type runs them and keeps the watchers.

pub mod ops;
#[cfg(test)]
mod ops_tests;
mod orphans;
pub mod rules;
pub mod stop;

use crate::tx::in_tx;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::caller::{Caller, Peer};
use crate::host::Host;
use crate::host::signal::{self, OwnIds, Verified};
use crate::host::spawn::{Reaper, SpawnSpec, check_program};
use crate::model::{
    Command, Exit, Identity, Logs, ProcessFilter, ProcessRecord, ProcessView, TokenRef,
};
use crate::store::{Store, StoreError};
use ops::{Create, ProcError, StopStart, Stopped};
use stop::{StopParams, stop_tree};
use tokio::sync::oneshot;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("process refused: {0:?}")]
    Proc(ProcError),
    /// A request member that cannot work (the program cannot be executed, ...).
    #[error("{field}: {detail}")]
    Invalid { field: &'static str, detail: String },
    #[error("no live process with pid {0} on this host")]
    ProcessNotFound(i32),
    #[error("{0}")]
    Unverifiable(String),
    /// The pid is another process than the one the client saw.
    #[error("{0}")]
    Mismatch(String),
}

impl From<ProcError> for Error {
    fn from(e: ProcError) -> Self {
        Self::Proc(e)
    }
}

/// How a spawn that failed after its record was made is answered. The
/// transaction that ends the record returns it, so that a keyed spawn's
/// answer is kept with that change (`idempotency::Claim::answer_with`).
#[derive(Clone, Debug)]
pub enum SpawnFailure {
    /// The child's identity could not be read (it was killed).
    Unverifiable(String),
    /// The program could not be executed.
    CannotExecute(String),
}

impl From<SpawnFailure> for Error {
    fn from(f: SpawnFailure) -> Self {
        match f {
            SpawnFailure::Unverifiable(detail) => Self::Unverifiable(detail),
            SpawnFailure::CannotExecute(e) => Self::Invalid {
                field: "command.argv",
                detail: format!("cannot execute: {e}"),
            },
        }
    }
}

/// A spawn or register request, validated.
pub struct CreateRequest {
    pub kind: String,
    pub operation_id: Option<String>,
    pub lease: Option<TokenRef>,
    pub owner: Option<Identity>,
    pub ttl_ms: Option<i64>,
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub command: Option<Command>,
    pub ports: Vec<String>,
}

pub const DEFAULT_GRACE: Duration = Duration::from_millis(5000);
/// How long a stop that saw our own child go waits for the reaper to hand
/// over its exit status (it is collected on the child's SIGCHLD).
const CHILD_EXIT_WAIT: Duration = Duration::from_secs(2);

pub struct Processes {
    store: Store,
    host: Arc<dyn Host>,
    reaper: Arc<Reaper>,
    own: OwnIds,
    logs_dir: PathBuf,
    /// Orphans whose stop is in progress, so a pass does not start another.
    claiming: Mutex<HashSet<String>>,
    /// Orphans whose `kill_failed` was reported already.
    kill_failed: Mutex<HashSet<String>>,
    /// Records kept on an unverifiable owner whose warning was logged.
    unverified: Mutex<HashSet<String>>,
    /// Exit statuses of our own children, by record id, published as the
    /// reaper collects them: a stop that saw the child go reads how it
    /// ended here instead of racing the transaction that records the exit.
    exits: Mutex<HashMap<String, tokio::sync::watch::Receiver<Option<Exit>>>>,
    /// Records a stop request of this server is stopping now: their exit
    /// status need not be synced on its own (see `record_exit`).
    stopping: Mutex<std::collections::HashSet<String>>,
    /// Whether this host may have current processes.
    hint: Mutex<CurrentHint>,
    /// Where a test holds a spawn between its two transactions.
    #[cfg(test)]
    pub(crate) pause_after_spawn: Mutex<Option<Arc<Pause>>>,
}

/// Bumped before and after every create's first transaction: a pass that
/// read no current process may clear `maybe` only if `creates` did not move.
struct CurrentHint {
    creates: u64,
    maybe: bool,
}

/// A spawn held after the fork, before the child is recorded: `reached`
/// is notified there, and the spawn goes on once `resume` is.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct Pause {
    pub reached: tokio::sync::Notify,
    pub resume: tokio::sync::Notify,
}

impl Processes {
    pub fn new(
        store: Store,
        host: Arc<dyn Host>,
        reaper: Arc<Reaper>,
        data_dir: &Path,
    ) -> std::io::Result<Arc<Self>> {
        let logs_dir = data_dir.join("logs");
        crate::data_dir::create_private_dir(&logs_dir)?;
        Ok(Arc::new(Self {
            store,
            host,
            reaper,
            own: OwnIds::read(),
            logs_dir,
            claiming: Mutex::default(),
            kill_failed: Mutex::default(),
            unverified: Mutex::default(),
            exits: Mutex::default(),
            stopping: Mutex::default(),
            hint: Mutex::new(CurrentHint {
                creates: 0,
                maybe: true,
            }),
            #[cfg(test)]
            pause_after_spawn: Mutex::default(),
        }))
    }

    pub fn host(&self) -> &dyn Host {
        self.host.as_ref()
    }

    /// Remove the log files of records that retention deleted; only files
    /// in this server's own log directory.
    pub fn remove_logs(&self, paths: &[String]) {
        for p in paths.iter().map(Path::new) {
            if p.parent() != Some(self.logs_dir.as_path()) {
                continue;
            }
            if let Err(e) = std::fs::remove_file(p)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove a pruned process's log");
            }
        }
    }

    pub fn host_id(&self) -> String {
        self.host.local().host_id.clone()
    }

    /// Spawn (with `command`) or register (without) a process.
    pub async fn create(
        self: &Arc<Self>,
        req: CreateRequest,
        port_range: RangeInclusive<u16>,
        caller: Caller,
    ) -> Result<ProcessView, Error> {
        if let Some(cmd) = &req.command {
            let cwd = cmd.cwd.as_deref().map(Path::new);
            if let Some(dir) = cwd
                && !dir.is_dir()
            {
                return Err(Error::Invalid {
                    field: "command.cwd",
                    detail: format!("{} is not a directory", dir.display()),
                });
            }
            let argv0 = cmd.argv.first().map_or("", String::as_str);
            check_program(argv0, cwd).map_err(|detail| Error::Invalid {
                field: "command.argv",
                detail,
            })?;
        }
        let id = uuid::Uuid::now_v7().to_string();
        let logs = req.command.as_ref().map(|_| Logs {
            stdout: self
                .logs_dir
                .join(format!("{id}.out"))
                .display()
                .to_string(),
            stderr: self
                .logs_dir
                .join(format!("{id}.err"))
                .display()
                .to_string(),
        });
        let create = Create {
            id: id.clone(),
            kind: req.kind,
            operation_id: req.operation_id,
            lease: req.lease,
            owner: req.owner,
            ttl_ms: req.ttl_ms,
            metadata: req.metadata,
            command: req.command.clone(),
            logs: logs.clone(),
            port_names: req.ports.clone(),
            port_range,
        };
        let host_id = self.host_id();
        // A registration is answered by this commit: it reaches the disk
        // first. A spawn's record need not before the child starts (as a
        // stop's `stopping`, below): a crash of holdfast keeps it (the WAL is
        // written either way), a power loss, which might not, ends the child
        // too, and the commit of the started child, which the answer waits
        // for, makes it durable with it.
        let durable = req.command.is_none();
        self.creating();
        let created = in_tx!(self, durable, |tx, cx| ops::create(
            tx, cx, &host_id, create
        ));
        self.creating();
        let (rec, ports) = created??;
        let (Some(cmd), Some(logs)) = (req.command, logs) else {
            return Ok(self.view(rec, ports));
        };
        let mut env = cmd.env.clone();
        for (i, name) in req.ports.iter().enumerate() {
            let port = ports.get(name).map(u16::to_string).unwrap_or_default();
            if i == 0 {
                env.insert("PORT".into(), port.clone());
            }
            env.insert(crate::model::port_env_var(name), port);
        }
        let spec = SpawnSpec {
            argv: cmd.argv,
            cwd: cmd.cwd.map(PathBuf::from),
            env,
            stdout: PathBuf::from(logs.stdout),
            stderr: PathBuf::from(logs.stderr),
            // Spawning for a caller never raises its privileges.
            run_as: match caller.peer {
                Peer::Unix { uid, gid, .. } if uid != 0 => Some((uid, gid)),
                _ => None,
            },
        };
        let host = self.host.clone();
        let spawned = self.reaper.spawn(&spec, |pid| {
            let observed = host.observe_child(pid);
            if observed.is_err() {
                // Not left running untracked. It is our own child and cannot
                // be reaped while this runs (the reaper's lock is held), so
                // its pid, and the group it leads, are still its own.
                if let Err(e) = signal::signal_group(pid, signal::Sig::Kill) {
                    tracing::warn!(pid, error = %e, "cannot kill a child whose identity could not be read");
                }
            }
            observed
        });
        let (identity, exit_rx) = match spawned {
            // The group is the one it was started in, whatever the read saw:
            // a child that moved out of it at once (setpgid) does not take
            // what it left there out of the stop.
            Ok((Ok(identity), rx)) => (
                Identity {
                    pgid: Some(identity.pid),
                    ..identity
                },
                rx,
            ),
            Ok((Err(e), _)) => {
                let reason = format!("spawn_failed: cannot read the child's identity: {e}");
                let failure = SpawnFailure::Unverifiable(e.to_string());
                return Err(self.fail_spawn(&id, reason, failure).await);
            }
            Err(e) => {
                let reason = format!("spawn_failed: {e}");
                let failure = SpawnFailure::CannotExecute(e.to_string());
                return Err(self.fail_spawn(&id, reason, failure).await);
            }
        };
        #[cfg(test)]
        {
            let pause = locked(&self.pause_after_spawn).take();
            if let Some(p) = pause {
                p.reached.notify_one();
                p.resume.notified().await;
            }
        }
        // Watched before anything else can fail: whatever happens to the
        // record, the child's exit is collected and, while it runs under
        // this record, recorded.
        self.watch_child(id.clone(), identity.pid, exit_rx);
        let (started_id, ident) = (id.clone(), identity.clone());
        let started = in_tx!(self, true, |tx, cx| ops::started(
            tx,
            cx,
            &started_id,
            identity,
            true
        ));
        match started {
            Ok(Ok(view)) => Ok(view),
            Ok(Err(refused)) => {
                // Ended (stopped, claimed) between the two transactions: a
                // child nobody tracks must not run on.
                self.kill_unrecorded(
                    &ident,
                    &id,
                    "its record ended before the child was recorded",
                );
                Err(refused.into())
            }
            Err(e) => {
                self.kill_unrecorded(&ident, &id, "recording the started child failed");
                let reason = format!("spawn_failed: recording the started child failed: {e}");
                let failed_id = id.clone();
                if let Err(e2) = in_tx!(self, true, |tx, cx| ops::spawn_failed(
                    tx, cx, &failed_id, reason
                )) {
                    // Left `starting`: the next start finds the child gone and ends it.
                    tracing::warn!(process = %id, error = %e2, "cannot end a failed spawn's record");
                }
                Err(e.into())
            }
        }
    }

    /// End the record `id` of a spawn that failed: the error to answer,
    /// `failure` once that is kept.
    async fn fail_spawn(
        self: &Arc<Self>,
        id: &str,
        reason: String,
        failure: SpawnFailure,
    ) -> Error {
        let failed_id = id.to_owned();
        let ended = in_tx!(self, true, |tx, cx| async move {
            ops::spawn_failed(tx, cx, &failed_id, reason)
                .await
                .map(|()| failure)
        });
        match ended {
            Ok(failure) => failure.into(),
            Err(e) => e.into(),
        }
    }

    fn hint(&self) -> std::sync::MutexGuard<'_, CurrentHint> {
        locked(&self.hint)
    }

    fn creating(&self) {
        let mut h = self.hint();
        h.creates += 1;
        h.maybe = true;
    }

    /// Whether this host may have current processes, for a pass to look.
    /// Only this server makes records of this host (and finds them again
    /// at startup), so it knows when there can be none.
    pub fn may_have_current(&self) -> bool {
        self.hint().maybe
    }

    /// Collect the exit of our child `pid`, spawned for record `id`.
    fn watch_child(self: &Arc<Self>, id: String, pid: i32, exit_rx: oneshot::Receiver<Exit>) {
        let (exit_tx, exit_watch) = tokio::sync::watch::channel(None);
        locked(&self.exits).insert(id.clone(), exit_watch);
        let me = self.clone();
        tokio::spawn(async move {
            if let Ok(exit) = exit_rx.await {
                exit_tx.send_replace(Some(exit));
                me.record_exit(id.clone(), pid, exit).await;
            }
            locked(&me.exits).remove(&id);
        });
    }

    /// Kill the tree of a child that no current record will track. It is
    /// our own child, verified through its pidfd before the signal.
    fn kill_unrecorded(&self, ident: &Identity, id: &str, why: &str) {
        let pgid = ident.pgid.filter(|g| *g == ident.pid);
        tracing::warn!(process = %id, pid = ident.pid, "killing a spawned child: {why}");
        stop::kill_tree(self.host.as_ref(), ident, pgid, why);
    }

    /// The exit of record `id`'s process, when it is our own child.
    fn exit_watch(&self, id: &str) -> Option<stop::Reaped> {
        locked(&self.exits).get(id).cloned()
    }

    /// The stop's outcome, with the exit status of our own child once the
    /// reaper has it.
    async fn with_child_exit(&self, id: &str, outcome: Stopped) -> Stopped {
        if outcome != Stopped::Settled(Exit::default()) {
            return outcome;
        }
        let Some(mut watch) = self.exit_watch(id) else {
            return outcome;
        };
        match tokio::time::timeout(CHILD_EXIT_WAIT, watch.wait_for(Option::is_some)).await {
            Ok(Ok(exit)) => Stopped::Settled(exit.unwrap_or_default()),
            _ => outcome,
        }
    }

    async fn record_exit(&self, id: String, pid: i32, exit: Exit) {
        let pid_id = id.clone();
        // The exit status of a record being stopped is made durable by the
        // stop's end, which carries it too; should it end the record all the
        // same, `end` asks for durability itself.
        let durable = !locked(&self.stopping).contains(&id);
        let res = in_tx!(self, durable, |tx, cx| ops::exited(
            tx, cx, &pid_id, pid, exit, "exited"
        ));
        if let Err(e) = res {
            tracing::warn!(process = %id, error = %e, "recording an exit failed; the reconciler will retry");
        }
    }

    /// Watch a process that is not our child (confirmed, or found again
    /// after a restart) until it exits; its exit status is then unknown.
    fn watch(self: &Arc<Self>, rec: &ProcessRecord) {
        let Some(ident) = rec.identity.clone() else {
            return;
        };
        let me = self.clone();
        let id = rec.id.clone();
        tokio::spawn(async move {
            match signal::verify(me.host.as_ref(), &ident) {
                Ok(Verified::Same(fd, _)) => crate::host::watch::exited(fd).await,
                Ok(_) => {}
                // Not known to be gone: leave it to the reconciler's sweep.
                Err(e) => {
                    tracing::warn!(process = %id, error = %e, "cannot watch a process");
                    return;
                }
            }
            me.record_exit(id, ident.pid, Exit::default()).await;
        });
    }

    fn view(&self, rec: ProcessRecord, ports: BTreeMap<String, u16>) -> ProcessView {
        let judged = rec.identity.as_ref().map(|i| self.host.judge(i));
        ProcessView::new(rec, judged, ports)
    }

    /// One process as it is now.
    pub async fn get(&self, id: &str) -> Result<Option<ProcessView>, StoreError> {
        let Some(rec) = self.store.backend().get_process(id).await? else {
            return Ok(None);
        };
        Ok(self.with_ports(vec![rec]).await?.pop())
    }

    /// Processes that match `filter`, newest first, as they are now.
    pub async fn list(&self, filter: &ProcessFilter) -> Result<Vec<ProcessView>, StoreError> {
        let recs = self.store.backend().list_processes(filter).await?;
        self.with_ports(recs).await
    }

    /// Where the output of process `id` is written, if the server spawned it.
    pub async fn logs(&self, id: &str) -> Result<Option<Logs>, StoreError> {
        Ok(self
            .store
            .backend()
            .get_process(id)
            .await?
            .and_then(|r| r.logs))
    }

    /// Views of `recs`, with the ports of all of them read in one query.
    async fn with_ports(&self, recs: Vec<ProcessRecord>) -> Result<Vec<ProcessView>, StoreError> {
        let ids: Vec<String> = recs.iter().map(|r| r.id.clone()).collect();
        let mut ports: HashMap<String, BTreeMap<String, u16>> = HashMap::new();
        for p in self.store.backend().owner_ports(&ids).await? {
            if let Some(owner) = p.owner.target() {
                ports
                    .entry(owner.id.clone())
                    .or_default()
                    .insert(p.name, p.port);
            }
        }
        Ok(recs
            .into_iter()
            .map(|rec| {
                let mine = ports.remove(&rec.id).unwrap_or_default();
                self.view(rec, mine)
            })
            .collect())
    }

    pub async fn count_current(&self) -> Result<i64, StoreError> {
        self.store.backend().count_current_processes().await
    }

    /// The identity of `pid`, if the server and `caller` may act on it.
    fn identity_for(&self, pid: i32, caller: Caller) -> Result<Identity, Error> {
        let ident = self.host.observe(pid).map_err(|e| match e {
            crate::host::ObserveError::NotFound(_) => Error::ProcessNotFound(pid),
            other => Error::Unverifiable(other.to_string()),
        })?;
        if let Some(why) = self.own.refusal(&ident) {
            return Err(ProcError::Forbidden(why).into());
        }
        caller
            .may_act_on(ident.uid, self.own.uid)
            .map_err(ProcError::Forbidden)?;
        Ok(ident)
    }

    pub async fn confirm(
        self: &Arc<Self>,
        id: String,
        token: i64,
        pid: i32,
        seen: Option<&str>,
        process_group: bool,
        caller: Caller,
    ) -> Result<ProcessView, Error> {
        let ident = self.identity_for(pid, caller)?;
        if let Some(why) = ident.not_the_one_seen(seen) {
            return Err(Error::Mismatch(why));
        }
        if process_group && ident.pgid != Some(pid) {
            return Err(Error::Invalid {
                field: "process_group",
                detail: format!("pid {pid} does not lead its process group"),
            });
        }
        let view = in_tx!(self, true, |tx, cx| ops::confirm(
            tx,
            cx,
            &id,
            token,
            ident,
            process_group
        ))??;
        if let Some(rec) = self.store.backend().get_process(&view.id).await? {
            self.watch(&rec);
        }
        Ok(view)
    }

    pub async fn heartbeat(
        &self,
        id: String,
        token: i64,
        ttl_ms: Option<i64>,
    ) -> Result<ProcessView, Error> {
        let durable = !self.store.backend().relaxed_renewals();
        Ok(in_tx!(self, durable, |tx, cx| ops::heartbeat(
            tx, cx, &id, token, ttl_ms
        ))??)
    }

    pub async fn stop(
        &self,
        id: String,
        token: i64,
        params: StopParams,
        caller: Caller,
    ) -> Result<ProcessView, Error> {
        let (own, host_id) = (self.own, self.host_id());
        let sid = id.clone();
        let _stopping = Stopping::new(self, &id);
        // Marking it `stopping` need not reach the disk before the signal:
        // a crash of holdfast keeps it (the WAL is written either way), and
        // a power loss, which might not, ends the process too. A stop that
        // ends the record at once makes its own transaction durable, and
        // the stop's answer waits for the durable commit of its end.
        let start = in_tx!(self, false, |tx, cx| ops::begin_stop(
            tx, cx, &sid, token, own, &host_id, caller
        ))??;
        let rec = match start {
            StopStart::Done(view) => return Ok(view),
            StopStart::Signal(rec) => rec,
        };
        let reaped = self.exit_watch(&id);
        let outcome = stop_tree(self.host.as_ref(), &rec, &params, reaped).await;
        let outcome = self.with_child_exit(&id, outcome).await;
        let reason = Some(params.reason);
        Ok(in_tx!(self, true, |tx, cx| ops::end_stop(
            tx, cx, &id, rec.token, outcome, reason
        ))??)
    }

    pub async fn finish(
        &self,
        id: String,
        token: i64,
        finish: ops::Finish,
    ) -> Result<ProcessView, Error> {
        Ok(in_tx!(self, true, |tx, cx| ops::finish(
            tx, cx, &id, token, finish
        ))??)
    }
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A stop request in progress, in `Processes::stopping` while it lives.
struct Stopping<'a> {
    processes: &'a Processes,
    id: String,
}

impl<'a> Stopping<'a> {
    fn new(processes: &'a Processes, id: &str) -> Self {
        locked(&processes.stopping).insert(id.to_owned());
        Self {
            processes,
            id: id.to_owned(),
        }
    }
}

impl Drop for Stopping<'_> {
    fn drop(&mut self) {
        locked(&self.processes.stopping).remove(&self.id);
    }
}
