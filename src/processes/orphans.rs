//! The reconciler's side of managed processes: adopting this host's
//! processes at startup, ending those gone unnoticed, and claiming and
//! stopping orphans. The request paths are in `mod.rs`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, PoisonError};

use super::ops::{self, Stopped};
use super::stop::{self, StopParams, stop_tree};
use super::{DEFAULT_GRACE, Processes, rules};
use crate::host::signal;
use crate::model::{Exit, Identity, ProcessRecord, ProcessState};
use crate::store::StoreError;
use crate::tx::in_tx;

/// The end reason of a stop the server finished after a restart cut it.
const CUT_STOP: &str = "stopped: the stop was cut by a restart and finished after it";

/// What a reconciler pass over processes did.
#[derive(Debug, Default)]
pub struct Pass {
    /// Records claimed as orphans.
    pub claimed: usize,
    /// Records kept past their TTL because their owner cannot be verified.
    pub unverified: usize,
}

enum Verdict {
    Claim,
    Unverified,
    Keep,
}

impl Processes {
    /// At startup: watch the processes of this host that still run, and
    /// end those that exited while the server was down.
    pub async fn adopt(self: &Arc<Self>) -> Result<(), StoreError> {
        for rec in self
            .store
            .backend()
            .current_processes(&self.host_id())
            .await?
        {
            if rec.state == ProcessState::Stopping && rec.identity.is_some() {
                self.finish_cut_stop(rec);
                continue;
            }
            if rec.state == ProcessState::Starting && rec.spawned {
                self.recover_spawn(&rec).await?;
            }
            if rec.identity.is_some()
                && matches!(rec.state, ProcessState::Running | ProcessState::Stopping)
            {
                self.watch(&rec);
            }
        }
        let me = self.clone();
        tokio::spawn(async move {
            let removed = me.sweep_logs().await;
            if removed > 0 {
                tracing::info!(removed, "removed the log files of deleted process records");
            }
        });
        Ok(())
    }

    /// Remove the log files whose process record is gone: retention removes
    /// a record's logs only once its deletion commits, and a crash in
    /// between leaves them behind. A record is written before its log files
    /// are made, so a file found here without one is such a leftover. The
    /// number of files removed.
    pub async fn sweep_logs(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.logs_dir) else {
            return 0;
        };
        let mut by_id: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for path in entries.flatten().map(|e| e.path()) {
            let is_log = path.extension().is_some_and(|x| x == "out" || x == "err");
            if let (true, Some(id)) = (is_log, path.file_stem().and_then(|s| s.to_str())) {
                by_id
                    .entry(id.to_owned())
                    .or_default()
                    .push(path.display().to_string());
            }
        }
        let mut removed = 0;
        for (id, paths) in by_id {
            match self.store.backend().get_process(&id).await {
                Ok(Some(_)) => {}
                Ok(None) => {
                    self.remove_logs(&paths);
                    removed += paths.len();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot look for the records of log files; left for the next start");
                    break;
                }
            }
        }
        removed
    }

    /// A spawn the server stopped in, between recording it and recording its
    /// child. A child that started is found by the log files it holds open
    /// for writing (named by the record's id): the one that leads its group is adopted
    /// as `running`; what is left of a spawn whose leader is gone is killed.
    async fn recover_spawn(self: &Arc<Self>, rec: &ProcessRecord) -> Result<(), StoreError> {
        let files: Vec<&Path> = rec
            .logs
            .iter()
            .flat_map(|l| [Path::new(&l.stdout), Path::new(&l.stderr)])
            .collect();
        let mut found: Vec<Identity> = self
            .host
            .writers_of(&files)
            .into_iter()
            .filter_map(|pid| self.host.observe(pid).ok())
            .filter(|i| self.own.refusal(i).is_none())
            .collect();
        // The child leads the group it was started in, and started before
        // anything it forked.
        found.sort_by_key(|i| {
            let started = i.start_time.parse::<u64>().unwrap_or(u64::MAX);
            (i.pgid != Some(i.pid), started)
        });
        let id = rec.id.clone();
        if let Some(leader) = found.first().filter(|i| i.pgid == Some(i.pid)) {
            let (sid, ident) = (id.clone(), leader.clone());
            if in_tx!(self, true, |tx, cx| ops::started(tx, cx, &sid, ident, true))?.is_ok() {
                tracing::info!(process = %id, pid = leader.pid, "adopted a child spawned before the restart");
                if let Some(now) = self.store.backend().get_process(&id).await? {
                    self.watch(&now);
                }
                return Ok(());
            }
        }
        for ident in &found {
            stop::kill_tree(
                self.host.as_ref(),
                ident,
                None,
                "left by a spawn cut by a restart",
            );
        }
        let mut reason = "spawn_failed: the server restarted while spawning".to_owned();
        if !found.is_empty() {
            reason.push_str(&format!("; {} leftover process(es) killed", found.len()));
        }
        in_tx!(self, true, |tx, cx| ops::spawn_failed(tx, cx, &id, reason))?;
        Ok(())
    }

    /// The reconciler's pass: claim and stop orphans, retry orphans that
    /// would not die, and end records whose process is gone unnoticed.
    pub async fn reconcile(self: &Arc<Self>) -> Result<Pass, StoreError> {
        let mut pass = Pass::default();
        let creates = self.hint().creates;
        let current = self
            .store
            .backend()
            .current_processes(&self.host_id())
            .await?;
        {
            let mut h = self.hint();
            h.maybe = !current.is_empty() || h.creates != creates;
        }
        for rec in current {
            if self
                .claiming
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(&rec.id)
            {
                continue;
            }
            if self.gone_unnoticed(&rec) {
                // Its exit was missed (a watcher could not be set up): end it now.
                let (id, token, pid) = (rec.id.clone(), rec.token, rec.pid().unwrap_or_default());
                // Our own child's status, when the reaper has it: a stop in
                // progress may be racing this pass, and both must say how
                // the process ended.
                let outcome = self
                    .with_child_exit(&id, Stopped::Settled(Exit::default()))
                    .await;
                let exit = match outcome {
                    Stopped::Settled(exit) => exit,
                    _ => Exit::default(),
                };
                match rec.state {
                    ProcessState::Running => {
                        in_tx!(self, true, |tx, cx| ops::exited(
                            tx, cx, &id, pid, exit, "exited"
                        ))?;
                    }
                    _ => {
                        in_tx!(self, true, |tx, cx| ops::end_stop(
                            tx, cx, &id, token, outcome, None
                        ))?
                        .ok();
                    }
                }
                continue;
            }
            let orphan = if rec.state == ProcessState::Orphaned && rec.identity.is_none() {
                // Claimed before it was confirmed by a version that kept
                // such records: nothing to stop, so it ends now.
                let (id, token) = (rec.id.clone(), rec.token);
                let settled = Stopped::Settled(Exit::default());
                in_tx!(self, true, |tx, cx| ops::end_orphan(
                    tx, cx, &id, token, settled, false
                ))?;
                None
            } else if rec.state == ProcessState::Orphaned {
                Some(rec)
            } else {
                match self.claimable(&rec).await? {
                    Verdict::Claim => {
                        // Re-checked inside the transaction.
                        let id = rec.id.clone();
                        let c = in_tx!(self, true, |tx, cx| ops::claim(tx, cx, &id))?;
                        pass.claimed += usize::from(c.is_some());
                        c
                    }
                    Verdict::Unverified => {
                        pass.unverified += 1;
                        self.report_unverified(&rec);
                        None
                    }
                    Verdict::Keep => None,
                }
            };
            if let Some(orphan) = orphan {
                self.stop_orphan(orphan);
            }
        }
        Ok(pass)
    }

    /// Once per record and server run: kept past its TTL on an owner that
    /// cannot be checked.
    fn report_unverified(&self, rec: &ProcessRecord) {
        let first = self
            .unverified
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(rec.id.clone());
        if first {
            tracing::warn!(
                process = %rec.id,
                owner = rec.owner.as_ref().map(|o| o.pid),
                "heartbeat TTL passed but the owner's liveness cannot be checked: the process is kept"
            );
        }
    }

    /// A running or stopping record whose process and group are provably gone.
    fn gone_unnoticed(&self, rec: &ProcessRecord) -> bool {
        let Some(ident) = &rec.identity else {
            return false;
        };
        matches!(rec.state, ProcessState::Running | ProcessState::Stopping)
            && self.host.judge(ident).status == crate::model::Liveness::Dead
            && !rec.pgid().is_some_and(signal::group_alive)
    }

    /// Whether `rec` looks claimable from outside a transaction: its lease
    /// ended, or its TTL passed while its owner is not live. Cheap reads, so
    /// that a pass writes only for records that need it.
    async fn claimable(&self, rec: &ProcessRecord) -> Result<Verdict, StoreError> {
        if !rules::may_be_claimed(rec.state) {
            return Ok(Verdict::Keep);
        }
        let lease = match &rec.lease {
            Some(l) => self.store.backend().get_lease(&l.id).await?,
            None => None,
        };
        let owner = rec.owner.as_ref().map(|o| self.host.judge(o));
        let now = crate::time::now_ms();
        Ok(
            if rules::claim_reason(rec, lease.as_ref(), owner, now).is_some() {
                Verdict::Claim
            } else if rules::kept_unverified(rec, lease.as_ref(), owner, now) {
                Verdict::Unverified
            } else {
                Verdict::Keep
            },
        )
    }

    /// A stop the server was stopped in (the record is `stopping`, its
    /// signals may have been sent): carried to its end with the API's
    /// defaults, so that a process holdfast signalled ends `stopped`, not
    /// `exited` when its exit is noticed. A tree that will not settle is
    /// `running` again, and watched.
    fn finish_cut_stop(self: &Arc<Self>, rec: ProcessRecord) {
        self.hold(&rec.id);
        let me = self.clone();
        tokio::spawn(async move {
            let outcome = me.stop_with_defaults(&rec, "a stop cut by a restart").await;
            let (id, token) = (rec.id.clone(), rec.token);
            let reason = Some(CUT_STOP.to_owned());
            match in_tx!(me, true, |tx, cx| ops::end_stop(
                tx, cx, &id, token, outcome, reason
            )) {
                Ok(Ok(_)) => {
                    tracing::info!(process = %rec.id, "finished a stop cut by the restart")
                }
                Ok(Err(e)) => {
                    tracing::warn!(process = %rec.id, error = ?e, "a stop cut by the restart did not end it")
                }
                Err(e) => {
                    tracing::warn!(process = %rec.id, error = %e, "recording a stop cut by the restart failed")
                }
            }
            if let Ok(Some(now)) = me.store.backend().get_process(&rec.id).await
                && now.state == ProcessState::Running
            {
                me.watch(&now);
            }
            me.release(&rec.id);
        });
    }

    /// Kept from the reconciler's passes while the server stops it.
    fn hold(&self, id: &str) {
        self.claiming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id.to_owned());
    }

    /// Back in the reconciler's passes.
    fn release(&self, id: &str) {
        self.claiming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
    }

    /// Stop `rec`'s tree with the API's defaults (grace, then SIGKILL).
    async fn stop_with_defaults(&self, rec: &ProcessRecord, reason: &str) -> Stopped {
        let params = StopParams {
            grace: DEFAULT_GRACE,
            force: true,
            reason: reason.into(),
        };
        stop_tree(self.host.as_ref(), rec, &params, None).await
    }

    fn stop_orphan(self: &Arc<Self>, rec: ProcessRecord) {
        self.hold(&rec.id);
        let me = self.clone();
        tokio::spawn(async move {
            let outcome = me.stop_with_defaults(&rec, "orphan_reconciled").await;
            let outcome = me.with_child_exit(&rec.id, outcome).await;
            let (id, token) = (rec.id.clone(), rec.token);
            let first_failure = outcome == Stopped::NotSettled
                && me
                    .kill_failed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(rec.id.clone());
            if let Err(e) = in_tx!(me, true, |tx, cx| ops::end_orphan(
                tx,
                cx,
                &id,
                token,
                outcome,
                first_failure
            )) {
                tracing::warn!(process = %rec.id, error = %e, "recording an orphan's stop failed");
            }
            if outcome == Stopped::NotSettled {
                tracing::warn!(process = %rec.id, "orphan's process tree did not settle; will retry");
            }
            me.release(&rec.id);
        });
    }
}
