//! The process transaction scripts against a real SQLite store, a staged
//! host and a clock the test moves: confirm, heartbeat, finish, stop, the
//! watcher's exit, and the reconciler's claim, with the events each appends.

use std::sync::Arc;

use serde_json::json;

use super::ops::{self, Create, Outcome, ProcError, StopStart, Stopped};
use crate::caller::{Caller, Peer};
use crate::host::Host;
use crate::host::fake::FakeHost;
use crate::host::signal::OwnIds;
use crate::leases;
use crate::model::{
    Command, Exit, Identity, LeaseView, Liveness, LivenessReason, ProcessRecord, ProcessState,
    ProcessView, TokenRef,
};
use crate::tx::fixture::{Fixture, assert_events, run};

const TTL: i64 = 10_000;

const ADMIN: Caller = Caller {
    admin: true,
    ordinary_token: false,
    peer: Peer::Tcp,
};

fn create_cmd() -> Create {
    Create {
        id: uuid::Uuid::now_v7().to_string(),
        kind: "job".into(),
        operation_id: None,
        lease: None,
        owner: None,
        ttl_ms: None,
        metadata: Default::default(),
        command: None,
        logs: None,
        port_names: Vec::new(),
        port_range: 20000..=29999,
    }
}

/// A record kept by heartbeats every `TTL`, from `owner` if any.
fn kept(owner: Option<Identity>) -> Create {
    Create {
        owner,
        ttl_ms: Some(TTL),
        ..create_cmd()
    }
}

/// A record owned by `lease`, naming it with `token`.
fn owned_by(lease: &LeaseView, token: i64) -> Create {
    Create {
        lease: Some(TokenRef {
            id: lease.id.clone(),
            token,
        }),
        ..create_cmd()
    }
}

/// Register a `starting` record.
async fn register(fx: &Fixture, c: Create) -> ProcessRecord {
    let host_id = fx.host.local().host_id.clone();
    let (rec, _) = run!(fx, |tx, cx| ops::create(tx, cx, &host_id, c)).expect("registered");
    assert_eq!((rec.state, rec.token), (ProcessState::Starting, 1));
    rec
}

async fn confirm(fx: &Fixture, id: &str, token: i64, ident: Identity) -> Outcome<ProcessView> {
    let id = id.to_owned();
    run!(fx, |tx, cx| ops::confirm(tx, cx, &id, token, ident, true))
}

/// Register and confirm a live process; its identity too.
async fn running(fx: &Fixture, c: Create) -> (ProcessRecord, Identity) {
    let rec = register(fx, c).await;
    let ident = fx.host.spawn();
    let v = confirm(fx, &rec.id, rec.token, ident.clone())
        .await
        .expect("confirmed");
    assert_eq!(v.state, ProcessState::Running);
    (fx.process(&rec.id).await, ident)
}

async fn heartbeat(fx: &Fixture, id: &str, token: i64) -> Outcome<ProcessView> {
    let id = id.to_owned();
    run!(fx, |tx, cx| ops::heartbeat(tx, cx, &id, token, None))
}

async fn finish(fx: &Fixture, id: &str, token: i64) -> Outcome<ProcessView> {
    finish_as(fx, id, token, false).await
}

async fn finish_as(fx: &Fixture, id: &str, token: i64, host_gone: bool) -> Outcome<ProcessView> {
    let id = id.to_owned();
    run!(fx, |tx, cx| ops::finish(
        tx,
        cx,
        &id,
        token,
        ops::Finish {
            state: ProcessState::Failed,
            reason: Some("crashed".to_owned()),
            exit_code: Some(3),
            host_gone,
        }
    ))
}

async fn begin_stop(fx: &Fixture, id: &str, token: i64) -> Outcome<StopStart> {
    let id = id.to_owned();
    let host_id = fx.host.local().host_id.clone();
    run!(fx, |tx, cx| ops::begin_stop(
        tx,
        cx,
        &id,
        token,
        OwnIds::read(),
        &host_id,
        ADMIN
    ))
}

async fn claim(fx: &Fixture, id: &str) -> Option<ProcessRecord> {
    let id = id.to_owned();
    run!(fx, |tx, cx| ops::claim(tx, cx, &id))
}

async fn exited(fx: &Fixture, id: &str, pid: i32, code: i32) {
    let id = id.to_owned();
    let exit = Exit {
        code: Some(code),
        signal: None,
    };
    run!(fx, |tx, cx| ops::exited(tx, cx, &id, pid, exit, "exited"));
}

#[tokio::test]
async fn confirm_runs_a_registered_process_once() {
    let mut fx = Fixture::new().await;
    let mark = fx.mark().await;
    let rec = register(&fx, create_cmd()).await;
    fx.now += 5;
    let ident = fx.host.spawn();
    let v = confirm(&fx, &rec.id, 1, ident.clone())
        .await
        .expect("confirmed");
    assert_eq!((v.state, v.pid), (ProcessState::Running, Some(ident.pid)));
    assert_eq!(v.status, Some(Liveness::Live));
    assert_eq!(v.started_at, Some(fx.now));
    let again = confirm(&fx, &rec.id, 1, ident.clone())
        .await
        .expect("idempotent");
    assert_eq!(again.started_at, v.started_at);
    assert_events!(
        fx,
        mark,
        &[
            ("process.registered", &rec.id),
            ("process.running", &rec.id)
        ]
    );
    let other = confirm(&fx, &rec.id, 1, fx.host.spawn()).await;
    assert!(matches!(other, Err(ProcError::Fenced(_))), "{other:?}");
    let wrong = confirm(&fx, &rec.id, 2, ident).await;
    assert!(matches!(wrong, Err(ProcError::Fenced(_))), "{wrong:?}");
    assert_eq!(fx.process(&rec.id).await.identity, v.identity);
}

/// The service on the fixture's store and fake host, with a reaper that
/// never runs: nothing here is reaped behind a test's back.
fn processes(fx: &Fixture) -> Arc<super::Processes> {
    let host: Arc<dyn Host> = fx.host.clone();
    let reaper = Arc::new(crate::host::spawn::Reaper::default());
    super::Processes::new(fx.store.clone(), host, reaper, fx.dir.path()).expect("processes")
}

/// Pids of live (not zombie) processes whose command line holds `marker`.
fn running_with(marker: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        if !zombie && String::from_utf8_lossy(&cmdline).contains(marker) {
            found.push(pid);
        }
    }
    found
}

/// A spawn of a shell that keeps `marker` in its command line and waits.
fn sleeper(marker: &str) -> super::CreateRequest {
    super::CreateRequest {
        kind: "job".into(),
        operation_id: None,
        lease: None,
        owner: None,
        ttl_ms: None,
        metadata: Default::default(),
        command: Some(Command {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "sleep 300; true".into(),
                marker.to_owned(),
            ],
            cwd: None,
            env: Default::default(),
        }),
        ports: Vec::new(),
    }
}

/// Kill what a test left running under `marker`; what was found. A child
/// just sent SIGKILL is given up to 5 s to exit first (the signal is acted
/// on when the child next runs, which a busy machine may delay).
async fn kill_survivors(marker: &str) -> Vec<i32> {
    for pid in running_with(marker) {
        let fd = rustix::process::Pid::from_raw(pid).and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
        });
        if let Some(fd) = fd {
            let _ = tokio::time::timeout(
                std::time::Duration::from_secs(5),
                crate::host::watch::exited(fd),
            )
            .await;
        }
    }
    let survivors = running_with(marker);
    for pid in &survivors {
        let group = format!("-{pid}");
        let _ = std::process::Command::new("kill")
            .args(["-9", "--", &group])
            .status();
    }
    survivors
}

#[tokio::test]
async fn a_child_whose_identity_cannot_be_read_is_not_left_running() {
    let fx = Fixture::new().await;
    // The fake host knows no real pid: reading the new child's identity fails.
    let procs = processes(&fx);
    let marker = format!("holdfast-untracked-{}", uuid::Uuid::now_v7());
    let got = procs.create(sleeper(&marker), 20000..=29999, ADMIN).await;
    let survivors = kill_survivors(&marker).await;
    assert!(matches!(got, Err(super::Error::Unverifiable(_))), "{got:?}");
    assert_eq!(survivors, Vec::<i32>::new(), "the child was left running");
}

#[tokio::test]
async fn a_child_whose_record_ended_before_it_was_recorded_is_killed() {
    let fx = Fixture::new().await;
    // The real host, so that the child's identity reads and verifies; the
    // reaper never runs, so the killed child stays a zombie (not running).
    let host: Arc<dyn Host> = Arc::new(crate::host::ProcHost::new(
        crate::host::LocalFacts::read(None).expect("local facts"),
    ));
    let reaper = Arc::new(crate::host::spawn::Reaper::default());
    let procs = super::Processes::new(fx.store.clone(), host.clone(), reaper, fx.dir.path())
        .expect("processes");
    let pause = Arc::new(super::Pause::default());
    *procs.pause_after_spawn.lock().expect("lock") = Some(pause.clone());
    let marker = format!("holdfast-ended-early-{}", uuid::Uuid::now_v7());
    let spawning = tokio::spawn({
        let procs = procs.clone();
        let req = sleeper(&marker);
        async move { procs.create(req, 20000..=29999, ADMIN).await }
    });
    pause.reached.notified().await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut started = running_with(&marker);
    while started.is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        started = running_with(&marker);
    }
    let current = fx
        .backend()
        .current_processes(&host.local().host_id)
        .await
        .expect("current");
    let [rec] = current.as_slice() else {
        panic!("one record expected: {current:?}");
    };
    assert_eq!(rec.state, ProcessState::Starting);
    let params = super::stop::StopParams {
        grace: std::time::Duration::from_secs(1),
        force: true,
        reason: "test".into(),
    };
    let stopped = procs
        .stop(rec.id.clone(), 1, params, ADMIN)
        .await
        .expect("stop a starting record");
    assert_eq!(stopped.state, ProcessState::Stopped);
    pause.resume.notify_one();
    let got = spawning.await.expect("join");
    let survivors = kill_survivors(&marker).await;
    // One process, or two for a moment: `sh` and its fork for `sleep`,
    // which carries sh's command line until it execs.
    assert!(
        !started.is_empty(),
        "the child ran while the spawn was held"
    );
    assert!(
        matches!(got, Err(super::Error::Proc(ProcError::Fenced(_)))),
        "{got:?}"
    );
    assert_eq!(survivors, Vec::<i32>::new(), "the child was left running");
    let after = fx.process(&rec.id).await;
    assert_eq!(
        (after.state, after.end_reason.as_deref()),
        (ProcessState::Stopped, Some("stopped_before_start"))
    );
}

#[tokio::test]
async fn confirm_of_an_absent_or_unreadable_pid_records_nothing() {
    let fx = Fixture::new().await;
    let procs = processes(&fx);
    let rec = register(&fx, create_cmd()).await;
    let mark = fx.mark().await;

    let gone = fx.host.spawn();
    fx.host.kill(gone.pid);
    let got = procs
        .confirm(rec.id.clone(), 1, gone.pid, None, false, ADMIN)
        .await;
    assert!(
        matches!(got, Err(super::Error::ProcessNotFound(p)) if p == gone.pid),
        "{got:?}"
    );
    let denied = fx.host.spawn();
    fx.host.deny(denied.pid);
    let got = procs
        .confirm(rec.id.clone(), 1, denied.pid, None, false, ADMIN)
        .await;
    assert!(matches!(got, Err(super::Error::Unverifiable(_))), "{got:?}");

    let now = fx.process(&rec.id).await;
    assert_eq!((now.state, now.identity), (ProcessState::Starting, None));
    assert_events!(fx, mark, &[]);
}

#[tokio::test]
async fn heartbeat_is_fenced_by_token_and_by_the_end() {
    let mut fx = Fixture::new().await;
    let (rec, ident) = running(&fx, kept(None)).await;
    let mark = fx.mark().await;
    fx.now += TTL - 1;
    let v = heartbeat(&fx, &rec.id, 1).await.expect("heartbeat");
    assert_eq!(v.expires_at, Some(fx.now + TTL));
    assert_eq!(fx.process(&rec.id).await.expires_at, Some(fx.now + TTL));
    match heartbeat(&fx, &rec.id, 2).await {
        Err(ProcError::Fenced(v)) => assert_eq!(v.token, 1, "the current record is shown"),
        other => panic!("wrong token: {other:?}"),
    }
    fx.host.kill(ident.pid);
    finish(&fx, &rec.id, 1).await.expect("finished");
    let ended = heartbeat(&fx, &rec.id, 1).await;
    assert!(matches!(ended, Err(ProcError::Fenced(_))), "{ended:?}");
    assert_events!(
        fx,
        mark,
        &[("process.failed", &rec.id)],
        "heartbeats are not events"
    );
}

#[tokio::test]
async fn finish_refuses_a_live_process_and_is_idempotent_after() {
    let fx = Fixture::new().await;
    let (rec, ident) = running(&fx, create_cmd()).await;
    let mark = fx.mark().await;
    let alive = finish(&fx, &rec.id, 1).await;
    assert!(
        matches!(alive, Err(ProcError::ProcessAlive(_))),
        "{alive:?}"
    );
    assert_eq!(fx.process(&rec.id).await.state, ProcessState::Running);

    fx.host.kill(ident.pid);
    for _ in 0..2 {
        let v = finish(&fx, &rec.id, 1).await.expect("finished");
        assert_eq!(v.state, ProcessState::Failed);
        assert_eq!(v.end_reason.as_deref(), Some("crashed"));
        assert_eq!(v.exit.code, Some(3));
        assert_eq!(v.status_reason, Some(LivenessReason::PidAbsent));
    }
    assert_events!(fx, mark, &[("process.failed", &rec.id)]);
}

/// A lease held by a live owner, for a process to belong to.
async fn lease(fx: &Fixture) -> LeaseView {
    let cmd = leases::Acquire {
        resource: "r".into(),
        holder: "a".into(),
        ttl_ms: None,
        owner: Some(fx.host.spawn()),
        parent: None,
        reserve: false,
        metadata: Default::default(),
    };
    run!(fx, |tx, cx| leases::ops::acquire(tx, cx, cmd))
        .expect("lease")
        .lease
}

#[tokio::test]
async fn a_process_is_claimed_once_its_lease_ended_and_gets_a_new_token() {
    let fx = Fixture::new().await;
    let l = lease(&fx).await;
    let c = owned_by(&l, l.token);
    let (rec, _) = running(&fx, c).await;
    assert!(claim(&fx, &rec.id).await.is_none(), "lease still current");

    let (id, token) = (l.id.clone(), l.token);
    run!(fx, |tx, cx| leases::ops::release(tx, cx, &id, token)).expect("released");
    let mark = fx.mark().await;
    let claimed = claim(&fx, &rec.id).await.expect("claimed");
    assert_eq!((claimed.state, claimed.token), (ProcessState::Orphaned, 2));
    assert_eq!(fx.process(&rec.id).await, claimed);
    let events = fx.events_after(mark).await;
    assert_events!(fx, mark, &[("process.orphaned", &rec.id)]);
    assert_eq!(events[0]["detail"], json!({"reason": "lease_ended"}));
    assert!(claim(&fx, &rec.id).await.is_none(), "claimed once");
    let old = heartbeat(&fx, &rec.id, 1).await;
    assert!(matches!(old, Err(ProcError::Fenced(_))), "{old:?}");
}

#[tokio::test]
async fn a_process_is_claimed_when_its_heartbeat_ttl_passed_and_its_owner_is_not_live() {
    let mut fx = Fixture::new().await;
    let owner = fx.host.spawn();
    let (rec, _) = running(&fx, kept(Some(owner.clone()))).await;

    fx.host.kill(owner.pid);
    fx.now += TTL - 1;
    assert!(claim(&fx, &rec.id).await.is_none(), "TTL not passed");
    fx.now += 1;
    fx.host.reuse(owner.pid);
    let claimed = claim(&fx, &rec.id).await.expect("claimed");
    assert_eq!((claimed.state, claimed.token), (ProcessState::Orphaned, 2));
}

#[tokio::test]
async fn a_live_or_unverifiable_owner_keeps_its_process_past_the_heartbeat_ttl() {
    let live: fn(&FakeHost, i32) = |_, _| {};
    for stage in [live, FakeHost::deny, FakeHost::unreadable] {
        let mut fx = Fixture::new().await;
        let owner = fx.host.spawn();
        let (rec, _) = running(&fx, kept(Some(owner.clone()))).await;
        stage(&fx.host, owner.pid);
        let mark = fx.mark().await;
        fx.now += 10 * TTL;
        assert!(claim(&fx, &rec.id).await.is_none());
        let now = fx.process(&rec.id).await;
        assert_eq!((now.state, now.token), (ProcessState::Running, 1));
        assert_events!(fx, mark, &[]);
    }
}

/// Views a script would show of `id`, as a list would.
async fn view_of(fx: &Fixture, id: &str) -> ProcessView {
    let id = id.to_owned();
    run!(fx, |tx, cx| async move {
        let rec = tx.process(&id).await?.expect("exists");
        ops::view(tx, cx, rec).await
    })
}

#[tokio::test]
async fn an_unconfirmed_record_whose_owner_is_gone_ends_in_its_claim() {
    let mut fx = Fixture::new().await;
    let owner = fx.host.spawn();
    let with_op = |owner: &Identity| Create {
        operation_id: Some("op-1".into()),
        port_names: vec!["http".into()],
        ..kept(Some(owner.clone()))
    };
    let rec = register(&fx, with_op(&owner)).await;
    fx.host.kill(owner.pid);
    fx.now += TTL;
    let mark = fx.mark().await;
    assert!(claim(&fx, &rec.id).await.is_none(), "nothing to signal");
    let now = view_of(&fx, &rec.id).await;
    assert_eq!(
        (now.state, now.token, now.end_reason.as_deref()),
        (ProcessState::Stopped, 2, Some("orphan_reconciled"))
    );
    assert_eq!(now.ports.len(), 0, "its ports are freed: {now:?}");
    assert_eq!(
        fx.types_after(mark).await,
        ["process.orphaned", "port.released", "process.stopped"],
        "one transaction claims it, frees its port and ends it"
    );
    assert!(claim(&fx, &rec.id).await.is_none(), "claimed once");
    assert!(matches!(
        finish(&fx, &rec.id, 1).await,
        Err(ProcError::Fenced(_))
    ));

    let host_id = fx.host.local().host_id.clone();
    let c = with_op(&owner);
    let next = run!(fx, |tx, cx| ops::create(tx, cx, &host_id, c));
    assert!(
        next.is_ok(),
        "the operation id is free once it ended: {next:?}"
    );
}

#[tokio::test]
async fn an_orphan_ends_stopped_when_its_tree_settled() {
    let mut fx = Fixture::new().await;
    let (rec, _) = running(&fx, kept(None)).await;
    fx.now += TTL;
    let claimed = claim(&fx, &rec.id).await.expect("claimed");
    let mark = fx.mark().await;
    end_orphan(&fx, &rec.id, claimed.token, Stopped::NotSettled, true).await;
    end_orphan(&fx, &rec.id, claimed.token, Stopped::NotSettled, false).await;
    end_orphan(&fx, &rec.id, 1, Stopped::Settled(Exit::default()), false).await;
    assert_eq!(fx.process(&rec.id).await.state, ProcessState::Orphaned);
    let killed = Exit {
        code: None,
        signal: Some(9),
    };
    end_orphan(&fx, &rec.id, claimed.token, Stopped::Settled(killed), false).await;
    let now = fx.process(&rec.id).await;
    assert_eq!(now.state, ProcessState::Stopped);
    assert_eq!(now.end_reason.as_deref(), Some("orphan_reconciled"));
    assert_eq!(now.exit, killed);
    assert_events!(
        fx,
        mark,
        &[
            ("process.kill_failed", &rec.id),
            ("process.stopped", &rec.id)
        ]
    );
}

async fn end_orphan(fx: &Fixture, id: &str, token: i64, outcome: Stopped, first: bool) {
    let id = id.to_owned();
    run!(fx, |tx, cx| ops::end_orphan(
        tx, cx, &id, token, outcome, first
    ));
}

#[tokio::test]
async fn exited_ends_a_running_record_and_only_informs_a_stopping_one() {
    let fx = Fixture::new().await;
    let (a, ia) = running(&fx, create_cmd()).await;
    let (b, ib) = running(&fx, create_cmd()).await;
    let mark = fx.mark().await;

    exited(&fx, &a.id, ia.pid + 1_000, 0).await;
    assert_eq!(
        fx.process(&a.id).await.state,
        ProcessState::Running,
        "other pid"
    );
    exited(&fx, &a.id, ia.pid, 7).await;
    let now = fx.process(&a.id).await;
    assert_eq!((now.state, now.exit.code), (ProcessState::Exited, Some(7)));
    assert_eq!(now.end_reason.as_deref(), Some("exited"));

    assert!(matches!(
        begin_stop(&fx, &b.id, 1).await,
        Ok(StopStart::Signal(_))
    ));
    exited(&fx, &b.id, ib.pid, 0).await;
    let now = fx.process(&b.id).await;
    assert_eq!(
        (now.state, now.exit.code),
        (ProcessState::Stopping, Some(0))
    );
    assert_events!(fx, mark, &[("process.exited", &a.id)]);
}

#[tokio::test]
async fn a_stop_that_finds_the_pid_reused_ends_it_exited_with_identity_mismatch() {
    let fx = Fixture::new().await;
    let (rec, ident) = running(&fx, create_cmd()).await;
    let Ok(StopStart::Signal(stopping)) = begin_stop(&fx, &rec.id, 1).await else {
        panic!("a running process is signalled");
    };
    assert_eq!(stopping.state, ProcessState::Stopping);
    assert_eq!(fx.process(&rec.id).await.state, ProcessState::Stopping);

    fx.host.reuse(ident.pid);
    let mark = fx.mark().await;
    let id = rec.id.clone();
    let got = run!(fx, |tx, cx| ops::end_stop(
        tx,
        cx,
        &id,
        1,
        Stopped::Reused,
        None
    ));
    match got {
        Err(ProcError::IdentityMismatch(v)) => {
            assert_eq!(v.state, ProcessState::Exited);
            assert_eq!(v.status_reason, Some(LivenessReason::PidReused));
        }
        other => panic!("{other:?}"),
    }
    let now = fx.process(&rec.id).await;
    assert_eq!(now.state, ProcessState::Exited);
    assert_eq!(now.end_reason.as_deref(), Some("pid_reused"));
    assert_events!(fx, mark, &[("process.exited", &rec.id)]);
}

#[tokio::test]
async fn stop_refuses_a_remote_process_and_ends_a_starting_one_unsignalled() {
    let fx = Fixture::new().await;
    let rec = register(&fx, create_cmd()).await;
    confirm(&fx, &rec.id, 1, fx.host.remote())
        .await
        .expect("confirmed");
    let remote = begin_stop(&fx, &rec.id, 1).await;
    assert!(matches!(remote, Err(ProcError::RemoteProcess(_))));
    let finished = finish(&fx, &rec.id, 1).await;
    assert!(
        matches!(finished, Err(ProcError::RemoteProcess(_))),
        "finish leaves a remote process to its host: {finished:?}"
    );
    let now = fx.process(&rec.id).await;
    assert_eq!((now.state, now.token), (ProcessState::Running, 1));
    // The admin's word that its host is gone ends it, fenced still, and
    // its event says so.
    let wrong = finish_as(&fx, &rec.id, 2, true).await;
    assert!(matches!(wrong, Err(ProcError::Fenced(_))), "{wrong:?}");
    let mark = fx.mark().await;
    let gone = finish_as(&fx, &rec.id, 1, true).await.expect("ended");
    assert_eq!(
        (gone.state, gone.end_reason.as_deref()),
        (ProcessState::Failed, Some("crashed"))
    );
    let events = fx.events_after(mark).await;
    let ended = events
        .iter()
        .find(|e| e["type"] == "process.failed")
        .expect("process.failed");
    assert_eq!(
        ended["detail"],
        serde_json::json!({"host_gone": true}),
        "{events:?}"
    );
    // It does not stand in for this host's own check: a process of another
    // PID namespace here, or a live one, keeps its record.
    let contained = register(&fx, create_cmd()).await;
    confirm(&fx, &contained.id, 1, fx.host.other_namespace())
        .await
        .expect("confirmed");
    let kept = finish_as(&fx, &contained.id, 1, true).await;
    assert!(matches!(kept, Err(ProcError::RemoteProcess(_))), "{kept:?}");
    let (live, _) = running(&fx, create_cmd()).await;
    let kept = finish_as(&fx, &live.id, 1, true).await;
    assert!(matches!(kept, Err(ProcError::ProcessAlive(_))), "{kept:?}");

    let starting = register(&fx, create_cmd()).await;
    match begin_stop(&fx, &starting.id, 1).await {
        Ok(StopStart::Done(v)) => {
            assert_eq!(v.state, ProcessState::Stopped);
            assert_eq!(v.end_reason.as_deref(), Some("stopped_before_start"));
        }
        Ok(StopStart::Signal(_)) => panic!("nothing to signal"),
        Err(e) => panic!("{e:?}"),
    }
    let wrong = begin_stop(&fx, &starting.id, 2).await;
    assert!(matches!(wrong, Err(ProcError::Fenced(_))));
}

#[tokio::test]
async fn a_process_needs_a_current_lease_to_be_created() {
    let fx = Fixture::new().await;
    let l = lease(&fx).await;
    let c = owned_by(&l, l.token + 1);
    let host_id = fx.host.local().host_id.clone();
    let mark = fx.mark().await;
    let got = run!(fx, |tx, cx| ops::create(tx, cx, &host_id, c));
    assert!(matches!(got, Err(ProcError::LeaseFenced(Some(_)))));
    assert_events!(fx, mark, &[]);
}

#[tokio::test]
async fn a_pass_keeps_and_counts_a_process_whose_owner_cannot_be_verified() {
    let fx = Fixture::new().await;
    let owner = fx.host.spawn();
    // Its TTL ran out long ago on the pass's (real) clock.
    let (rec, _) = running(&fx, kept(Some(owner.clone()))).await;
    let procs = processes(&fx);
    fx.host.deny(owner.pid);
    let pass = procs.reconcile().await.expect("pass");
    assert_eq!((pass.claimed, pass.unverified), (0, 1));
    assert_eq!(fx.process(&rec.id).await.state, ProcessState::Running);
    fx.host.kill(owner.pid);
    let pass = procs.reconcile().await.expect("pass");
    assert_eq!((pass.claimed, pass.unverified), (1, 0));
    assert_eq!(fx.process(&rec.id).await.token, 2);
}

#[tokio::test]
async fn log_files_whose_record_is_gone_are_swept_and_the_others_kept() {
    let fx = Fixture::new().await;
    let procs = processes(&fx);
    let kept = register(&fx, create_cmd()).await;
    let logs = fx.dir.path().join("logs");
    let stray = uuid::Uuid::now_v7().to_string();
    let files = |id: &str| {
        [
            logs.join(format!("{id}.out")),
            logs.join(format!("{id}.err")),
        ]
    };
    for f in files(&kept.id).iter().chain(&files(&stray)) {
        std::fs::write(f, "output").expect("write");
    }
    // Not a log file: never touched.
    let other = logs.join("notes.txt");
    std::fs::write(&other, "mine").expect("write");

    assert_eq!(procs.sweep_logs().await, 2);
    assert!(
        files(&stray).iter().all(|f| !f.exists()),
        "the leftovers went"
    );
    assert!(
        files(&kept.id).iter().all(|f| f.exists()),
        "a record's logs stay"
    );
    assert!(other.exists());
    assert_eq!(procs.sweep_logs().await, 0, "nothing left to sweep");
}
