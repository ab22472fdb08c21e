//! The store contract, below HTTP: every operation of `Tx` and `Backend`,
//! driven through the library on the embedded SQLite store and on
//! PostgreSQL (each test runs once per store, as `stores!` does), with the
//! same expected results written once. Records carry fixed ids and times,
//! so what one store answers is exactly what the other must.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use holdfast::model::{
    Command, EventRow, Exit, Identity, LeaseFilter, LeaseRecord, LeaseState, Logs, ParentRef,
    PortOwner, PortRecord, ProcessFilter, ProcessRecord, ProcessState, StateFilter, TokenRef,
};
use holdfast::store::postgres::{PgStore, PoolSettings};
use holdfast::store::sqlite::SqliteStore;
use holdfast::store::{Backend, CommitListener, Effect, KeyClaim, Store, StoreError};
use holdfast::time::Millis;
use serde_json::json;

use crate::stores::{self, stores};

/// A fixed "now": every time in these tests is relative to it.
const T0: Millis = 1_700_000_000_000;

/// Every commit's effects, except the resyncs PostgreSQL's listener sends
/// on its own whenever it (re)connects (they carry `Missed`).
#[derive(Default)]
struct Recorder(Mutex<Vec<Vec<Effect>>>);

impl CommitListener for Recorder {
    fn committed(&self, effects: &[Effect]) {
        if !effects.contains(&Effect::Missed) {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(effects.to_vec());
        }
    }
}

impl Recorder {
    fn take(&self) -> Vec<Vec<Effect>> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Where a store lives: a SQLite file or a PostgreSQL database of its own,
/// which outlives the store so that it can be opened again (a restart).
struct Place {
    dir: tempfile::TempDir,
    url: Option<String>,
}

impl Place {
    async fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = match stores::current() {
            stores::Store::Sqlite => None,
            stores::Store::Postgres => Some(stores::database_for(dir.path()).await),
        };
        Self { dir, url }
    }

    fn sqlite_path(&self) -> PathBuf {
        self.dir.path().join("holdfast.db")
    }

    /// Open (and migrate) the store, as `App::build` does.
    async fn open(&self) -> Opened {
        self.open_on_boot("boot-1").await
    }

    async fn open_on_boot(&self, boot_id: &str) -> Opened {
        let effects = Arc::new(Recorder::default());
        let backend: Arc<dyn Backend> = match &self.url {
            None => Arc::new(
                SqliteStore::open(&self.sqlite_path(), boot_id, T0, effects.clone())
                    .await
                    .expect("open the sqlite store"),
            ),
            Some(url) => {
                let settings = PoolSettings {
                    max_connections: 4,
                    timeout: Duration::from_secs(5),
                };
                Arc::new(
                    PgStore::connect(url, &settings, effects.clone())
                        .await
                        .expect("connect the postgres store"),
                )
            }
        };
        Opened {
            store: Store::new(backend),
            effects,
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        stores::drop_database_of(self.dir.path());
    }
}

struct Opened {
    store: Store,
    effects: Arc<Recorder>,
}

impl Opened {
    fn backend(&self) -> &dyn Backend {
        self.store.backend()
    }

    async fn close(self) {
        self.store.backend().close().await;
    }
}

fn identity(pid: i32) -> Identity {
    Identity {
        pid,
        start_time: "123456".into(),
        pidfd_inode: Some("9001".into()),
        boot_id: "boot-1".into(),
        host_id: "host-a".into(),
        pid_ns: "pid:[4026531836]".into(),
        hostname: "alpha".into(),
        executable: Some("/usr/bin/sleep".into()),
        uid: Some(1000),
        pgid: Some(pid),
        sid: None,
        kernel_thread: false,
    }
}

/// Metadata whose member order is not alphabetical, with text that needs escaping.
fn metadata() -> serde_json::Map<String, serde_json::Value> {
    let v = json!({"zeta": 1, "alpha": {"nested": [1, 2.5, null]}, "text": "é \"q\" \\ ✓"});
    v.as_object().expect("an object").clone()
}

/// A current lease with no owner, parent or TTL.
fn lease(id: &str, resource: &str, token: i64) -> LeaseRecord {
    LeaseRecord {
        id: id.into(),
        resource: resource.into(),
        token,
        holder: "holder-1".into(),
        state: LeaseState::Active,
        owner: None,
        parent: None,
        ttl_ms: None,
        expires_at: None,
        acquired_at: T0,
        renewed_at: None,
        ended_at: None,
        end_reason: None,
        metadata: Default::default(),
    }
}

/// A lease with every column set.
fn full_lease(id: &str, resource: &str, token: i64) -> LeaseRecord {
    LeaseRecord {
        holder: "hölder ✓".into(),
        state: LeaseState::Reserved,
        owner: Some(identity(4242)),
        parent: Some(ParentRef {
            id: "parent-lease".into(),
            resource: "parent/res".into(),
            token: 7,
        }),
        ttl_ms: Some(30_000),
        expires_at: Some(T0 + 30_000),
        renewed_at: Some(T0 + 5),
        metadata: metadata(),
        ..lease(id, resource, token)
    }
}

fn ended(mut l: LeaseRecord, state: LeaseState) -> LeaseRecord {
    l.state = state;
    l.ended_at = Some(T0 + 1_000);
    l.end_reason = Some(state.as_str().into());
    l
}

/// A current process with only the required columns.
fn process(id: &str, host: &str, operation: Option<&str>) -> ProcessRecord {
    ProcessRecord {
        id: id.into(),
        kind: "worker".into(),
        state: ProcessState::Running,
        token: 1,
        operation_id: operation.map(Into::into),
        lease: None,
        host_id: host.into(),
        identity: None,
        signal_group: false,
        owner: None,
        spawned: false,
        command: None,
        logs: None,
        exit: Exit::default(),
        ttl_ms: None,
        expires_at: None,
        created_at: T0,
        started_at: None,
        ended_at: None,
        end_reason: None,
        metadata: Default::default(),
    }
}

fn full_process(id: &str) -> ProcessRecord {
    ProcessRecord {
        kind: "build".into(),
        state: ProcessState::Starting,
        token: 3,
        lease: Some(TokenRef {
            id: "lease-of-proc".into(),
            token: 11,
        }),
        identity: Some(identity(77)),
        signal_group: false,
        owner: Some(identity(78)),
        spawned: true,
        command: Some(Command {
            argv: vec!["sleep".into(), "60".into()],
            cwd: Some("/tmp".into()),
            env: [("B".to_owned(), "2".to_owned()), ("A".into(), "1".into())].into(),
        }),
        logs: Some(Logs {
            stdout: "/var/log/p.out".into(),
            stderr: "/var/log/p.err".into(),
        }),
        exit: Exit {
            code: Some(-1),
            signal: Some(9),
        },
        ttl_ms: Some(10_000),
        expires_at: Some(T0 + 10_000),
        started_at: Some(T0 + 1),
        metadata: metadata(),
        ..process(id, "host-a", Some("op-full"))
    }
}

fn port(id: &str, host: &str, port: u16, name: &str, owner: PortOwner) -> PortRecord {
    PortRecord {
        id: id.into(),
        port,
        name: name.into(),
        owner,
        host_id: host.into(),
        reserved_at: T0,
        released_at: None,
    }
}

fn lease_owner(id: &str, token: i64) -> PortOwner {
    PortOwner {
        process: None,
        lease: Some(TokenRef {
            id: id.into(),
            token,
        }),
    }
}

fn process_owner(id: &str, token: i64) -> PortOwner {
    PortOwner {
        process: Some(TokenRef {
            id: id.into(),
            token,
        }),
        lease: None,
    }
}

/// A unique-index refusal: neither busy nor unavailable, so not retried.
fn assert_refused<T: std::fmt::Debug>(what: &str, r: Result<T, StoreError>) {
    match r {
        Err(StoreError::Other(_)) => {}
        other => panic!("{what}: expected a refusal (StoreError::Other), got {other:?}"),
    }
}

async fn next_token(s: &Store, resource: &'static str) -> i64 {
    s.write(true, move |tx| tx.next_token(resource))
        .await
        .expect("next_token")
}

async fn insert_lease(s: &Store, l: LeaseRecord) -> Result<(), StoreError> {
    s.write(true, move |tx| {
        Box::pin(async move { tx.insert_lease(&l).await })
    })
    .await
}

async fn insert_process(s: &Store, p: ProcessRecord) -> Result<(), StoreError> {
    s.write(true, move |tx| {
        Box::pin(async move { tx.insert_process(&p).await })
    })
    .await
}

async fn insert_port(s: &Store, p: PortRecord) -> Result<(), StoreError> {
    s.write(true, move |tx| {
        Box::pin(async move { tx.insert_port(&p).await })
    })
    .await
}

/// Append `n` events in one transaction; the seqs they were stored under.
async fn append(s: &Store, n: usize, at: Millis) -> Vec<i64> {
    let before = s.backend().last_event_seq().await.expect("last seq");
    s.write(true, move |tx| {
        Box::pin(async move {
            for i in 0..n {
                tx.append_event(at, format!(r#"{{"n":{i}}}"#)).await?;
            }
            Ok(())
        })
    })
    .await
    .expect("append events");
    let rows = s.backend().events(before, 100).await.expect("events");
    seqs(&rows)
}

fn seqs(rows: &[EventRow]) -> Vec<i64> {
    rows.iter().map(|r| r.seq).collect()
}

fn ids<T>(records: &[T], id: impl Fn(&T) -> &str) -> Vec<String> {
    records.iter().map(|r| id(r).to_owned()).collect()
}

stores!(kind_and_durability_are_as_documented);
async fn kind_and_durability_are_as_documented() {
    let place = Place::new().await;
    let s = place.open().await;
    let (kind, relaxed) = match stores::current() {
        stores::Store::Sqlite => ("sqlite", true),
        stores::Store::Postgres => ("postgres", false),
    };
    assert_eq!(s.backend().kind(), kind);
    assert_eq!(s.backend().relaxed_renewals(), relaxed);
    assert_eq!(s.store.ready().await.expect("writable"), kind);
    // A non-durable job that asks to become durable commits like any other.
    s.store
        .write(false, |tx| {
            Box::pin(async move {
                tx.require_durable();
                tx.set_meta("k", "v").await
            })
        })
        .await
        .expect("a renewal-like write that ends up durable");
    s.close().await;
}

stores!(tokens_rise_per_resource_and_survive_a_restart);
async fn tokens_rise_per_resource_and_survive_a_restart() {
    let place = Place::new().await;
    let s = place.open().await;
    assert_eq!(next_token(&s.store, "res/a").await, 1);
    assert_eq!(next_token(&s.store, "res/a").await, 2);
    assert_eq!(
        next_token(&s.store, "res/b").await,
        1,
        "tokens are per resource"
    );
    let in_one_tx = s
        .store
        .write(true, |tx| {
            Box::pin(async move {
                let a = tx.next_token("res/a").await?;
                let b = tx.next_token("res/a").await?;
                Ok((a, b))
            })
        })
        .await
        .expect("two tokens in one transaction");
    assert_eq!(in_one_tx, (3, 4));

    // A job that fails after taking a token keeps nothing: the token was
    // never seen by anyone, so the next one may be the same number.
    let failed = s
        .store
        .write(true, |tx| {
            Box::pin(async move {
                let t = tx.next_token("res/a").await?;
                tx.insert_lease(&lease("rolled-back", "res/a", t)).await?;
                tx.set_meta("rolled-back", "yes").await?;
                Err::<(), _>(StoreError::Other("the job gives up".into()))
            })
        })
        .await;
    assert!(matches!(failed, Err(StoreError::Other(m)) if m == "the job gives up"));
    assert_eq!(
        s.backend().get_lease("rolled-back").await.expect("read"),
        None
    );
    assert_eq!(s.backend().count_current_leases().await.expect("count"), 0);

    // Concurrent writers (grouped into batches) each get a distinct token.
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let store = s.store.clone();
        tasks.push(tokio::spawn(
            async move { next_token(&store, "res/c").await },
        ));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.expect("task"));
    }
    got.sort_unstable();
    assert_eq!(got, (1..=32).collect::<Vec<_>>());

    s.close().await;
    let s = place.open().await;
    assert_eq!(
        next_token(&s.store, "res/a").await,
        5,
        "never reused after a restart"
    );
    assert_eq!(next_token(&s.store, "res/b").await, 2);
    assert_eq!(next_token(&s.store, "res/c").await, 33);
    s.close().await;
}

stores!(a_lease_round_trips_and_one_resource_has_one_current_lease);
async fn a_lease_round_trips_and_one_resource_has_one_current_lease() {
    let place = Place::new().await;
    let s = place.open().await;
    let full = full_lease("lease-1", "res/x", 1);
    insert_lease(&s.store, full.clone()).await.expect("insert");

    // Read back inside a transaction, and outside one.
    let in_tx = s
        .store
        .write(true, |tx| {
            Box::pin(async move {
                Ok((
                    tx.lease("lease-1").await?,
                    tx.current_lease("res/x").await?,
                    tx.lease("nope").await?,
                    tx.current_lease("res/none").await?,
                ))
            })
        })
        .await
        .expect("read in a transaction");
    assert_eq!(in_tx, (Some(full.clone()), Some(full.clone()), None, None));
    assert_eq!(
        s.backend().get_lease("lease-1").await.expect("get"),
        Some(full.clone())
    );
    assert_eq!(s.backend().get_lease("nope").await.expect("get"), None);

    // A second current lease on the resource is refused, and leaves nothing.
    assert_refused(
        "a second current lease",
        insert_lease(&s.store, lease("lease-2", "res/x", 2)).await,
    );
    assert_eq!(s.backend().get_lease("lease-2").await.expect("get"), None);
    // Ended ones do not count, on that resource or on another.
    insert_lease(
        &s.store,
        ended(lease("lease-3", "res/x", 3), LeaseState::Released),
    )
    .await
    .expect("an ended lease beside the current one");
    insert_lease(&s.store, lease("lease-4", "res/y", 1))
        .await
        .expect("another resource");
    assert_eq!(s.backend().count_current_leases().await.expect("count"), 2);

    // update_lease writes the mutable fields; the rest stay as inserted.
    let mut changed = ended(full.clone(), LeaseState::Expired);
    changed.owner = None;
    changed.ttl_ms = Some(1);
    changed.expires_at = Some(T0 + 1);
    changed.renewed_at = Some(T0 + 2);
    let mut ignored = changed.clone();
    ignored.holder = "someone else".into();
    ignored.token = 99;
    ignored.metadata = Default::default();
    s.store
        .write(true, move |tx| {
            Box::pin(async move { tx.update_lease(&ignored).await })
        })
        .await
        .expect("update");
    assert_eq!(
        s.backend().get_lease("lease-1").await.expect("get"),
        Some(changed)
    );
    assert_eq!(s.backend().count_current_leases().await.expect("count"), 1);

    // Once ended, the resource takes a new current lease.
    insert_lease(&s.store, lease("lease-5", "res/x", 4))
        .await
        .expect("a new current lease after the end");
    let cur = s
        .store
        .write(true, |tx| {
            Box::pin(async move { tx.current_lease("res/x").await })
        })
        .await
        .expect("current");
    assert_eq!(cur.map(|l| l.id), Some("lease-5".into()));

    // Updating a lease that does not exist is an error, not a silent no-op.
    let ghost = lease("ghost", "res/g", 1);
    let r = s
        .store
        .write(true, move |tx| {
            Box::pin(async move { tx.update_lease(&ghost).await })
        })
        .await;
    assert!(matches!(r, Err(StoreError::Other(_))), "{r:?}");
    s.close().await;
}

stores!(lease_lists_filter_and_page_newest_first);
async fn lease_lists_filter_and_page_newest_first() {
    let place = Place::new().await;
    let s = place.open().await;
    let mut parent = lease("l-01", "p", 1);
    parent.holder = "h2".into();
    let child = |id: &str, resource: &str| LeaseRecord {
        parent: Some(ParentRef {
            id: "l-01".into(),
            resource: "p".into(),
            token: 1,
        }),
        ..lease(id, resource, 1)
    };
    let records = vec![
        parent,
        lease("l-02", "a/x", 1),
        child("l-03", "a%x"),
        child("l-04", "a_x"),
        ended(lease("l-05", "ab", 1), LeaseState::Released),
        ended(lease("l-06", "a/x", 0), LeaseState::Reclaimed),
        lease("l-07", "a/y", 1),
        lease("l-08", "A/x", 1),
    ];
    s.store
        .write(true, move |tx| {
            Box::pin(async move {
                for l in &records {
                    tx.insert_lease(l).await?;
                }
                Ok(())
            })
        })
        .await
        .expect("insert");

    let list = async |f: LeaseFilter| {
        let got = s
            .backend()
            .list_leases(&LeaseFilter { limit: 100, ..f })
            .await
            .expect("list");
        ids(&got, |l| &l.id)
    };
    let all = LeaseFilter {
        state: StateFilter::All,
        ..Default::default()
    };
    let prefix = |p: &str| LeaseFilter {
        prefix: Some(p.into()),
        ..all.clone()
    };
    assert_eq!(
        list(LeaseFilter::default()).await,
        ["l-08", "l-07", "l-04", "l-03", "l-02", "l-01"],
        "current is the default, newest (highest id) first"
    );
    assert_eq!(
        list(LeaseFilter {
            state: StateFilter::Ended,
            ..Default::default()
        })
        .await,
        ["l-06", "l-05"]
    );
    assert_eq!(list(all.clone()).await.len(), 8);
    assert_eq!(
        list(LeaseFilter {
            resource: Some("a/x".into()),
            ..all.clone()
        })
        .await,
        ["l-06", "l-02"]
    );
    assert_eq!(list(prefix("a/")).await, ["l-07", "l-06", "l-02"]);
    assert_eq!(list(prefix("a%")).await, ["l-03"], "`%` is literal");
    assert_eq!(list(prefix("a_")).await, ["l-04"], "`_` is literal");
    assert_eq!(
        list(prefix("a")).await,
        ["l-07", "l-06", "l-05", "l-04", "l-03", "l-02"],
        "case matters"
    );
    assert_eq!(list(prefix("")).await.len(), 8);
    assert_eq!(list(prefix("a/x/")).await, Vec::<String>::new());
    assert_eq!(
        list(LeaseFilter {
            holder: Some("h2".into()),
            ..all.clone()
        })
        .await,
        ["l-01"]
    );
    assert_eq!(
        list(LeaseFilter {
            parent: Some("l-01".into()),
            ..all.clone()
        })
        .await,
        ["l-04", "l-03"]
    );
    assert_eq!(
        list(LeaseFilter {
            prefix: Some("a".into()),
            state: StateFilter::Ended,
            ..Default::default()
        })
        .await,
        ["l-06", "l-05"],
        "filters combine"
    );

    // Pages of three, each after the last id of the one before.
    let mut pages = Vec::new();
    let mut before = None;
    loop {
        let page = s
            .backend()
            .list_leases(&LeaseFilter {
                limit: 3,
                before_id: before.clone(),
                ..all.clone()
            })
            .await
            .expect("page");
        if page.is_empty() {
            break;
        }
        before = page.last().map(|l| l.id.clone());
        pages.push(ids(&page, |l| &l.id));
    }
    assert_eq!(
        pages,
        [
            vec!["l-08", "l-07", "l-06"],
            vec!["l-05", "l-04", "l-03"],
            vec!["l-02", "l-01"]
        ]
    );
    s.close().await;
}

stores!(the_reconciler_scan_finds_owned_and_overdue_leases);
async fn the_reconciler_scan_finds_owned_and_overdue_leases() {
    let place = Place::new().await;
    let s = place.open().await;
    let with_expiry = |id: &str, at: Millis| LeaseRecord {
        ttl_ms: Some(1_000),
        expires_at: Some(at),
        ..lease(id, id, 1)
    };
    let owned = LeaseRecord {
        owner: Some(identity(1)),
        ..with_expiry("owned-fresh", T0 + 60_000)
    };
    let records = vec![
        owned,
        with_expiry("overdue", T0 - 1),
        with_expiry("due-now", T0),
        with_expiry("fresh", T0 + 1),
        lease("no-ttl", "no-ttl", 1),
        ended(with_expiry("ended-overdue", T0 - 1), LeaseState::Expired),
        ended(
            LeaseRecord {
                owner: Some(identity(2)),
                ..lease("ended-owned", "ended-owned", 1)
            },
            LeaseState::Released,
        ),
    ];
    s.store
        .write(true, move |tx| {
            Box::pin(async move {
                for l in &records {
                    tx.insert_lease(l).await?;
                }
                Ok(())
            })
        })
        .await
        .expect("insert");
    let mut due = ids(
        &s.backend().leases_to_reconcile(T0).await.expect("scan"),
        |l| &l.id,
    );
    due.sort();
    assert_eq!(due, ["due-now", "overdue", "owned-fresh"]);
    assert_eq!(s.backend().count_current_leases().await.expect("count"), 5);
    s.close().await;
}

stores!(events_come_in_order_without_gaps_and_prune_from_the_front);
async fn events_come_in_order_without_gaps_and_prune_from_the_front() {
    let place = Place::new().await;
    let s = place.open().await;
    let b = s.backend();
    assert_eq!(b.last_event_seq().await.expect("last"), 0);
    assert_eq!(b.pruned_through().await.expect("pruned"), 0);
    assert!(b.events(0, 10).await.expect("events").is_empty());

    assert_eq!(append(&s.store, 3, T0).await, [1, 2, 3]);
    // A failed job's event is not kept, and leaves no hole.
    let failed = s
        .store
        .write(true, |tx| {
            Box::pin(async move {
                tx.append_event(T0, r#"{"n":"lost"}"#.into()).await?;
                Err::<(), _>(StoreError::Other("the job gives up".into()))
            })
        })
        .await;
    assert!(failed.is_err());
    assert_eq!(append(&s.store, 3, T0 + 10).await, [4, 5, 6]);
    assert_eq!(append(&s.store, 4, T0 + 20).await, [7, 8, 9, 10]);
    assert_eq!(b.last_event_seq().await.expect("last"), 10);

    let rows = b.events(0, 100).await.expect("events");
    assert_eq!(seqs(&rows), (1..=10).collect::<Vec<_>>());
    assert_eq!(rows[0].payload, r#"{"n":0}"#, "the body as appended");
    assert_eq!(seqs(&b.events(4, 3).await.expect("page")), [5, 6, 7]);
    assert!(b.events(10, 5).await.expect("past the end").is_empty());

    // By count: keep the newest 7 (seq 4..=10).
    let through = s
        .store
        .write(false, |tx| tx.prune_events(Some(7), None))
        .await
        .expect("prune");
    assert_eq!(through, 3);
    assert_eq!(b.pruned_through().await.expect("pruned"), 3);
    assert_eq!(
        seqs(&b.events(0, 100).await.expect("events")),
        (4..=10).collect::<Vec<_>>()
    );
    // By age: everything before T0 + 20 (seq 4..=6).
    let through = s
        .store
        .write(false, |tx| tx.prune_events(None, Some(T0 + 20)))
        .await
        .expect("prune");
    assert_eq!(through, 6);
    // Keeping more than there is, or a cut before the oldest, removes nothing.
    let through = s
        .store
        .write(false, |tx| tx.prune_events(Some(100), Some(T0)))
        .await
        .expect("prune");
    assert_eq!(through, 6, "the watermark never goes back");
    assert_eq!(
        seqs(&b.events(0, 100).await.expect("events")),
        [7, 8, 9, 10]
    );
    assert_eq!(b.last_event_seq().await.expect("last"), 10);

    // Pruning every event: the seq still goes on from the last one handed out.
    let through = s
        .store
        .write(false, |tx| tx.prune_events(Some(0), None))
        .await
        .expect("prune all");
    assert_eq!(through, 10);
    assert!(b.events(0, 100).await.expect("events").is_empty());
    assert_eq!(
        b.last_event_seq().await.expect("last"),
        10,
        "the last seq handed out, though its event was pruned"
    );
    assert_eq!(
        append(&s.store, 1, T0 + 30).await,
        [11],
        "seqs are never reused"
    );
    s.close().await;

    let s = place.open().await;
    let b = s.backend();
    assert_eq!(b.pruned_through().await.expect("pruned"), 10);
    assert_eq!(b.last_event_seq().await.expect("last"), 11);
    assert_eq!(
        append(&s.store, 1, T0 + 40).await,
        [12],
        "nor after a restart"
    );
    assert_eq!(seqs(&b.events(0, 100).await.expect("events")), [11, 12]);
    s.close().await;
}

stores!(meta_is_upserted_and_holds_the_prune_watermark);
async fn meta_is_upserted_and_holds_the_prune_watermark() {
    let place = Place::new().await;
    let s = place.open().await;
    // `pruned_through` is the one meta key a read shows.
    for v in ["5", "9"] {
        s.store
            .write(true, move |tx| tx.set_meta("pruned_through", v))
            .await
            .expect("set meta");
    }
    assert_eq!(
        s.backend().pruned_through().await.expect("read"),
        9,
        "the second value replaced the first"
    );
    s.close().await;
}

async fn claim(s: &Store, key: &'static str, request_id: &'static str, at: Millis) -> String {
    claim_over(s, key, request_id, None, at).await
}

/// Claim `key` for `request_id` in run "run-1", taking it over from
/// `supersedes` if that request may be.
async fn claim_over(
    s: &Store,
    key: &'static str,
    request_id: &'static str,
    supersedes: Option<&'static str>,
    at: Millis,
) -> String {
    s.write(true, move |tx| {
        Box::pin(async move {
            let c = KeyClaim {
                key,
                request: "POST /v1/leases\n{}",
                request_id,
                run_id: "run-1",
                supersedes,
                at,
                stale: at - 1000,
            };
            tx.claim_key(&c).await
        })
    })
    .await
    .expect("claim")
}

stores!(a_keyed_write_records_its_run_until_it_creates_a_record);
async fn a_keyed_write_records_its_run_until_it_creates_a_record() {
    use holdfast::idempotency::Claim;
    let place = Place::new().await;
    let s = place.open().await;
    let claim = Claim::new(
        "w".into(),
        "POST /v1/leases\n{}".into(),
        None,
        s.backend().run_id().to_owned(),
    );
    let read = claim
        .clone()
        .scope(s.store.write(true, |tx| tx.current_lease("res/k")))
        .await
        .expect("read");
    assert!(read.is_none());
    let run_id = s.backend().run_id().to_owned();
    let row = || async {
        let r = s.backend().idempotent_request("w").await.expect("read");
        r.map(|r| (r.request_id, r.run_id))
    };
    assert_eq!(
        row().await,
        Some((claim.request_id.clone(), Some(run_id))),
        "held by this run while it created nothing"
    );
    claim
        .clone()
        .scope(insert_lease(&s.store, lease("lease-k", "res/k", 1)))
        .await
        .expect("insert");
    assert_eq!(row().await, Some((claim.request_id.clone(), None)));
    s.close().await;
}

stores!(a_key_is_taken_over_only_from_the_request_named_while_it_created_nothing);
async fn a_key_is_taken_over_only_from_the_request_named_while_it_created_nothing() {
    let place = Place::new().await;
    let s = place.open().await;
    let at = 10_000;
    assert_eq!(claim(&s.store, "k", "r1", at).await, "r1");
    let held = s.backend().idempotent_request("k").await.expect("read");
    assert_eq!(
        held.and_then(|h| h.run_id).as_deref(),
        Some("run-1"),
        "recorded with its run"
    );
    assert_eq!(
        claim_over(&s.store, "k", "r2", Some("r0"), at + 1).await,
        "r1",
        "not from another request than the one named"
    );
    assert_eq!(
        claim_over(&s.store, "k", "r2", Some("r1"), at + 2).await,
        "r2",
        "taken over"
    );
    let taken = s.backend().idempotent_request("k").await.expect("read");
    assert_eq!(
        taken.map(|t| (t.request_id, t.created_at)),
        Some(("r2".to_owned(), at + 2))
    );
    assert_eq!(
        claim_over(&s.store, "k", "r3", Some("r1"), at + 3).await,
        "r2",
        "once"
    );

    s.store
        .write(true, move |tx| tx.key_created("k", "r2"))
        .await
        .expect("created");
    assert_eq!(
        claim_over(&s.store, "k", "r4", Some("r2"), at + 4).await,
        "r2",
        "not once its request created a record"
    );

    assert_eq!(claim(&s.store, "a", "r5", at).await, "r5");
    let answer = (201, "application/json", "{}");
    s.store
        .write(true, move |tx| tx.answer_key("a", "r5", answer))
        .await
        .expect("answer");
    assert_eq!(
        claim_over(&s.store, "a", "r6", Some("r5"), at + 5).await,
        "r5",
        "nor once it was answered"
    );
    s.close().await;
}

stores!(idempotency_keys_are_held_answered_forgotten_and_pruned);
async fn idempotency_keys_are_held_answered_forgotten_and_pruned() {
    let place = Place::new().await;
    let s = place.open().await;
    assert_eq!(claim(&s.store, "k", "r1", 10_000).await, "r1");
    assert_eq!(
        claim(&s.store, "k", "r1", 10_001).await,
        "r1",
        "held by its request"
    );
    assert_eq!(
        claim(&s.store, "k", "r2", 10_002).await,
        "r1",
        "another request does not take it"
    );
    let answer = (201, "application/json", r#"{"id":"l"}"#);
    s.store
        .write(true, move |tx| tx.answer_key("k", "r2", answer))
        .await
        .expect("a request that does not hold it changes nothing");
    let pending = s
        .backend()
        .idempotent_request("k")
        .await
        .expect("read")
        .expect("kept");
    assert_eq!((pending.request_id.as_str(), pending.status), ("r1", None));
    s.store
        .write(true, move |tx| tx.answer_key("k", "r1", answer))
        .await
        .expect("answer");
    let answered = s
        .backend()
        .idempotent_request("k")
        .await
        .expect("read")
        .expect("kept");
    assert_eq!(
        (
            answered.status,
            answered.content_type.as_deref(),
            answered.body.as_deref()
        ),
        (Some(201), Some("application/json"), Some(r#"{"id":"l"}"#))
    );
    assert_eq!(
        (answered.request.as_str(), answered.created_at),
        ("POST /v1/leases\n{}", 10_000)
    );
    // Past its time (here 1 s), another request takes it afresh.
    assert_eq!(claim(&s.store, "k", "r3", 11_001).await, "r3");
    let fresh = s
        .backend()
        .idempotent_request("k")
        .await
        .expect("read")
        .expect("kept");
    assert_eq!((fresh.status, fresh.created_at), (None, 11_001));

    assert_eq!(claim(&s.store, "gone", "r4", 20_000).await, "r4");
    s.store
        .write(true, move |tx| tx.forget_key("gone", "r4"))
        .await
        .expect("forget");
    assert_eq!(
        s.backend().idempotent_request("gone").await.expect("read"),
        None
    );
    assert_eq!(
        claim(&s.store, "gone", "r5", 20_001).await,
        "r5",
        "free again"
    );

    s.store
        .write(true, move |tx| tx.prune_keys(20_000))
        .await
        .expect("prune");
    assert_eq!(
        s.backend().idempotent_request("k").await.expect("read"),
        None
    );
    assert!(
        s.backend()
            .idempotent_request("gone")
            .await
            .expect("read")
            .is_some()
    );
    s.close().await;
}

stores!(committed_effects_reach_the_listener_and_failed_ones_do_not);
async fn committed_effects_reach_the_listener_and_failed_ones_do_not() {
    let place = Place::new().await;
    let s = place.open().await;
    s.effects.take();
    // Another event first, so that the seq is not the batch's own count.
    append(&s.store, 1, T0).await;
    s.effects.take();
    s.store
        .write(true, |tx| {
            Box::pin(async move {
                tx.after_commit(Effect::LeaseEnded("res/e".into()));
                tx.append_event(T0, "{}".into()).await?;
                tx.after_commit(Effect::LeaseEnded("res/f".into()));
                Ok(())
            })
        })
        .await
        .expect("write");
    let seq = s.backend().last_event_seq().await.expect("seq");
    assert_eq!(seq, 2);
    assert_eq!(
        s.effects.take(),
        [vec![
            Effect::LeaseEnded("res/e".into()),
            Effect::Event(seq),
            Effect::LeaseEnded("res/f".into())
        ]],
        "in the order the job made them, once it committed"
    );
    let failed = s
        .store
        .write(true, |tx| {
            Box::pin(async move {
                tx.after_commit(Effect::LeaseEnded("res/g".into()));
                tx.append_event(T0, "{}".into()).await?;
                Err::<(), _>(StoreError::Other("the job gives up".into()))
            })
        })
        .await;
    assert!(failed.is_err());
    // A job without effects tells nobody.
    s.store
        .write(true, |tx| tx.set_meta("quiet", "1"))
        .await
        .expect("write");
    assert_eq!(s.effects.take(), Vec::<Vec<Effect>>::new());
    s.close().await;
}

stores!(a_process_round_trips_and_one_operation_has_one_live_process);
async fn a_process_round_trips_and_one_operation_has_one_live_process() {
    let place = Place::new().await;
    let s = place.open().await;
    let full = full_process("proc-1");
    insert_process(&s.store, full.clone())
        .await
        .expect("insert");
    let in_tx = s
        .store
        .write(true, |tx| {
            Box::pin(async move {
                Ok((
                    tx.process("proc-1").await?,
                    tx.process_by_operation("op-full").await?,
                    tx.process("nope").await?,
                    tx.process_by_operation("op-none").await?,
                ))
            })
        })
        .await
        .expect("read in a transaction");
    assert_eq!(in_tx, (Some(full.clone()), Some(full.clone()), None, None));
    assert_eq!(
        s.backend().get_process("proc-1").await.expect("get"),
        Some(full.clone())
    );
    assert_eq!(s.backend().get_process("nope").await.expect("get"), None);

    assert_refused(
        "a second live process of one operation",
        insert_process(&s.store, process("proc-2", "host-a", Some("op-full"))).await,
    );
    assert_eq!(s.backend().get_process("proc-2").await.expect("get"), None);
    // Processes without an operation id are not limited.
    for id in ["proc-3", "proc-4"] {
        insert_process(&s.store, process(id, "host-a", None))
            .await
            .expect("no operation id");
    }

    // update_process writes the mutable fields; the rest stay as inserted.
    let mut changed = full.clone();
    changed.state = ProcessState::Exited;
    changed.token = 4;
    changed.identity = Some(identity(79));
    changed.owner = None;
    changed.exit = Exit {
        code: Some(3),
        signal: None,
    };
    changed.ttl_ms = None;
    changed.expires_at = None;
    changed.started_at = Some(T0 + 2);
    changed.ended_at = Some(T0 + 3);
    changed.end_reason = Some("exited".into());
    let mut ignored = changed.clone();
    ignored.kind = "other".into();
    ignored.command = None;
    ignored.logs = None;
    ignored.metadata = Default::default();
    s.store
        .write(true, move |tx| {
            Box::pin(async move { tx.update_process(&ignored).await })
        })
        .await
        .expect("update");
    assert_eq!(
        s.backend().get_process("proc-1").await.expect("get"),
        Some(changed)
    );
    // Ended, it frees its operation id.
    let by_op = s
        .store
        .write(true, |tx| {
            Box::pin(async move { tx.process_by_operation("op-full").await })
        })
        .await
        .expect("by operation");
    assert_eq!(by_op, None);
    insert_process(&s.store, process("proc-5", "host-a", Some("op-full")))
        .await
        .expect("the operation id is free again");

    let ghost = process("ghost", "host-a", None);
    let r = s
        .store
        .write(true, move |tx| {
            Box::pin(async move { tx.update_process(&ghost).await })
        })
        .await;
    assert!(matches!(r, Err(StoreError::Other(_))), "{r:?}");
    s.close().await;
}

stores!(process_lists_filter_and_page_and_scan_one_host);
async fn process_lists_filter_and_page_and_scan_one_host() {
    let place = Place::new().await;
    let s = place.open().await;
    let with = |id: &str, host: &str, kind: &str, state: ProcessState| ProcessRecord {
        kind: kind.into(),
        state,
        ..process(id, host, None)
    };
    let records = vec![
        with("p-01", "host-a", "worker", ProcessState::Starting),
        ProcessRecord {
            operation_id: Some("op-1".into()),
            lease: Some(TokenRef {
                id: "lease-x".into(),
                token: 2,
            }),
            ..with("p-02", "host-a", "build", ProcessState::Running)
        },
        with("p-03", "host-b", "worker", ProcessState::Stopping),
        with("p-04", "host-a", "worker", ProcessState::Orphaned),
        with("p-05", "host-a", "worker", ProcessState::Exited),
        ProcessRecord {
            lease: Some(TokenRef {
                id: "lease-x".into(),
                token: 1,
            }),
            ..with("p-06", "host-a", "build", ProcessState::Stopped)
        },
        with("p-07", "host-b", "worker", ProcessState::Failed),
    ];
    s.store
        .write(true, move |tx| {
            Box::pin(async move {
                for p in &records {
                    tx.insert_process(p).await?;
                }
                Ok(())
            })
        })
        .await
        .expect("insert");
    let b = s.backend();
    let list = async |f: ProcessFilter| {
        let got = b
            .list_processes(&ProcessFilter { limit: 100, ..f })
            .await
            .expect("list");
        ids(&got, |p| &p.id)
    };
    let all = ProcessFilter {
        state: StateFilter::All,
        ..Default::default()
    };
    assert_eq!(
        list(ProcessFilter::default()).await,
        ["p-04", "p-03", "p-02", "p-01"]
    );
    assert_eq!(
        list(ProcessFilter {
            state: StateFilter::Ended,
            ..Default::default()
        })
        .await,
        ["p-07", "p-06", "p-05"]
    );
    assert_eq!(
        list(ProcessFilter {
            kind: Some("build".into()),
            ..all.clone()
        })
        .await,
        ["p-06", "p-02"]
    );
    assert_eq!(
        list(ProcessFilter {
            operation_id: Some("op-1".into()),
            ..all.clone()
        })
        .await,
        ["p-02"]
    );
    assert_eq!(
        list(ProcessFilter {
            lease: Some("lease-x".into()),
            state: StateFilter::Ended,
            ..Default::default()
        })
        .await,
        ["p-06"]
    );
    let page = |before: Option<&str>| {
        let f = ProcessFilter {
            limit: 3,
            before_id: before.map(Into::into),
            ..all.clone()
        };
        async move { ids(&b.list_processes(&f).await.expect("page"), |p| &p.id) }
    };
    assert_eq!(page(None).await, ["p-07", "p-06", "p-05"]);
    assert_eq!(page(Some("p-05")).await, ["p-04", "p-03", "p-02"]);
    assert_eq!(page(Some("p-02")).await, ["p-01"]);
    assert!(page(Some("p-01")).await.is_empty());

    assert_eq!(
        ids(&b.current_processes("host-a").await.expect("scan"), |p| &p
            .id),
        ["p-01", "p-02", "p-04"],
        "current ones of that host, by id"
    );
    assert_eq!(
        ids(&b.current_processes("host-b").await.expect("scan"), |p| &p
            .id),
        ["p-03"]
    );
    assert!(
        b.current_processes("host-z")
            .await
            .expect("scan")
            .is_empty()
    );
    assert_eq!(b.count_current_processes().await.expect("count"), 4);
    s.close().await;
}

stores!(ports_one_current_reservation_per_host_and_port);
async fn ports_one_current_reservation_per_host_and_port() {
    let place = Place::new().await;
    let s = place.open().await;
    let web = port("port-1", "host-a", 8080, "web", process_owner("proc-1", 2));
    let admin = port(
        "port-2",
        "host-a",
        9000,
        "admin",
        process_owner("proc-1", 2),
    );
    let db = port("port-3", "host-a", 5432, "db", lease_owner("lease-1", 5));
    let other_host = port("port-4", "host-b", 8080, "web", lease_owner("lease-2", 1));
    for p in [&web, &admin, &db, &other_host] {
        insert_port(&s.store, p.clone()).await.expect("reserve");
    }
    assert_refused(
        "a second current reservation of host-a:8080",
        insert_port(
            &s.store,
            port("port-5", "host-a", 8080, "x", lease_owner("lease-1", 5)),
        )
        .await,
    );

    let (mut held, current, none, of_proc, of_lease) = s
        .store
        .write(true, |tx| {
            Box::pin(async move {
                Ok((
                    tx.held_ports("host-a").await?,
                    tx.current_port("host-a", 8080).await?,
                    tx.current_port("host-a", 8081).await?,
                    tx.ports_of("proc-1").await?,
                    tx.ports_of("lease-1").await?,
                ))
            })
        })
        .await
        .expect("read in a transaction");
    held.sort_unstable();
    assert_eq!(held, [5432, 8080, 9000]);
    assert_eq!(current, Some(web.clone()));
    assert_eq!(none, None);
    assert_eq!(of_proc, [admin.clone(), web.clone()], "by name");
    assert_eq!(of_lease, std::slice::from_ref(&db));
    let b = s.backend();
    let owners = |ids: &[&str]| ids.iter().map(|i| (*i).to_owned()).collect::<Vec<String>>();
    assert_eq!(
        b.owner_ports(&owners(&["proc-1"]))
            .await
            .expect("owner ports"),
        [admin.clone(), web.clone()]
    );
    assert_eq!(
        b.owner_ports(&owners(&["proc-1", "lease-1", "nobody"]))
            .await
            .expect("a page of owners in one query"),
        [db.clone(), admin.clone(), web.clone()],
        "by owner, then name"
    );
    assert!(
        b.owner_ports(&owners(&["nobody"]))
            .await
            .expect("owner ports")
            .is_empty()
    );
    assert!(b.owner_ports(&[]).await.expect("no owners").is_empty());

    let list = async |host: Option<&str>, before: Option<&str>, limit: u32| {
        let got = b.list_ports(host, before, limit).await.expect("list ports");
        ids(&got, |p| &p.id)
    };
    assert_eq!(
        list(None, None, 10).await,
        ["port-4", "port-3", "port-2", "port-1"],
        "newest first, by id"
    );
    assert_eq!(
        list(Some("host-a"), None, 10).await,
        ["port-3", "port-2", "port-1"]
    );
    assert_eq!(
        list(None, Some("port-4"), 2).await,
        ["port-3", "port-2"],
        "before an id, up to the limit"
    );
    assert_eq!(
        list(Some("host-b"), Some("port-4"), 10).await,
        Vec::<String>::new()
    );

    // Released, a port is free for another reservation; releasing again,
    // or an unknown id, changes nothing.
    s.store
        .write(true, |tx| {
            Box::pin(async move {
                tx.release_port("port-1", T0 + 5).await?;
                tx.release_port("port-1", T0 + 6).await?;
                tx.release_port("no-such-port", T0 + 6).await
            })
        })
        .await
        .expect("release");
    let mut held = s
        .store
        .write(true, |tx| tx.held_ports("host-a"))
        .await
        .expect("held");
    held.sort_unstable();
    assert_eq!(held, [5432, 9000]);
    assert_eq!(
        b.owner_ports(&owners(&["proc-1"]))
            .await
            .expect("owner ports"),
        [admin]
    );
    let again = port("port-6", "host-a", 8080, "web", lease_owner("lease-1", 5));
    insert_port(&s.store, again.clone())
        .await
        .expect("the port is free again");
    assert_eq!(
        list(Some("host-a"), None, 10).await,
        ["port-6", "port-3", "port-2"],
        "a released port is not listed"
    );
    s.close().await;
}

stores!(sqlite_stretches_leases_after_a_reboot_and_postgres_does_not_need_to);
async fn sqlite_stretches_leases_after_a_reboot_and_postgres_does_not_need_to() {
    let place = Place::new().await;
    let s = place.open().await;
    let l = LeaseRecord {
        ttl_ms: Some(10_000),
        expires_at: Some(T0 - 5_000),
        ..lease("l-1", "r", 1)
    };
    insert_lease(&s.store, l.clone()).await.expect("insert");
    s.close().await;
    // Same boot: nothing changes.
    let s = place.open_on_boot("boot-1").await;
    assert_eq!(
        s.backend().get_lease("l-1").await.expect("get"),
        Some(l.clone())
    );
    s.close().await;
    let s = place.open_on_boot("boot-2").await;
    let expected = match stores::current() {
        // Renewals may have been lost with the page cache: the full TTL again.
        stores::Store::Sqlite => Some(T0 + 10_000),
        stores::Store::Postgres => Some(T0 - 5_000),
    };
    let got = s.backend().get_lease("l-1").await.expect("get");
    assert_eq!(got.and_then(|l| l.expires_at), expected);
    s.close().await;
}

/// A job that sees one of its statements fail and carries on (no service
/// does: they all pass store errors up with `?`) is answered as what was
/// kept: if the answer is Ok, its other writes are there.
async fn a_job_answered_ok_keeps_its_writes_though_a_statement_failed() {
    let place = Place::new().await;
    let s = place.open().await;
    insert_lease(&s.store, lease("l-1", "r", 1))
        .await
        .expect("insert");
    let answer = s
        .store
        .write(true, |tx| {
            Box::pin(async move {
                tx.set_meta("pruned_through", "42").await?;
                let refused = tx.insert_lease(&lease("l-2", "r", 2)).await;
                Ok(refused.is_err())
            })
        })
        .await;
    if let Ok(refused) = answer {
        assert!(refused, "the duplicate was refused");
        assert_eq!(
            s.backend().pruned_through().await.expect("read"),
            42,
            "answered Ok, but its write was not kept"
        );
    }
    s.close().await;
}
mod a_job_answered_ok_keeps_its_writes_though_a_statement_failed {
    use crate::stores::{Store, run};

    #[tokio::test]
    async fn sqlite() {
        run(
            Store::Sqlite,
            super::a_job_answered_ok_keeps_its_writes_though_a_statement_failed(),
        )
        .await
    }

    #[tokio::test]
    async fn postgres() {
        run(
            Store::Postgres,
            super::a_job_answered_ok_keeps_its_writes_though_a_statement_failed(),
        )
        .await
    }
}

/// A UUIDv7 id created at `ms`, as the server makes them; `n` tells apart
/// ids of one instant.
fn v7(ms: Millis, n: u8) -> String {
    let secs = u64::try_from(ms / 1000).expect("positive");
    let nanos = u32::try_from((ms % 1000) * 1_000_000).expect("in range");
    let ts = uuid::Timestamp::from_unix(uuid::NoContext, secs, nanos);
    let mut bytes = *uuid::Uuid::new_v7(ts).as_bytes();
    bytes[15] = n;
    uuid::Uuid::from_bytes(bytes).to_string()
}

stores!(retention_deletes_records_ended_before_the_cutoff_and_nothing_current);
async fn retention_deletes_records_ended_before_the_cutoff_and_nothing_current() {
    let place = Place::new().await;
    let s = place.open().await;
    let day = 86_400_000;
    // Created at T0, ended at T0 + 1 s (`ended`), or current.
    let old_ended = v7(T0, 1);
    let old_current = v7(T0, 2);
    let old_ended_bound = v7(T0, 3);
    let young_ended = v7(T0 + day, 4);
    assert_eq!(next_token(&s.store, "r/a").await, 1);
    for l in [
        ended(lease(&old_ended, "r/a", 1), LeaseState::Released),
        lease(&old_current, "r/b", 1),
        ended(lease(&old_ended_bound, "r/c", 1), LeaseState::Expired),
        LeaseRecord {
            acquired_at: T0 + day,
            ended_at: Some(T0 + day + 1),
            ..ended(lease(&young_ended, "r/d", 1), LeaseState::Released)
        },
    ] {
        insert_lease(&s.store, l).await.expect("insert lease");
    }
    let ended_process = |id: &str, host: &str| ProcessRecord {
        state: ProcessState::Exited,
        ended_at: Some(T0 + 1_000),
        logs: Some(Logs {
            stdout: format!("/logs/{id}.out"),
            stderr: format!("/logs/{id}.err"),
        }),
        ..process(id, host, None)
    };
    let (gone_proc, other_host_proc) = (v7(T0, 5), v7(T0, 6));
    let (bound_proc, current_proc) = (v7(T0, 7), v7(T0, 8));
    for p in [
        ended_process(&gone_proc, "host-a"),
        ended_process(&other_host_proc, "host-b"),
        ProcessRecord {
            lease: Some(TokenRef {
                id: old_ended_bound.clone(),
                token: 1,
            }),
            ..process(&bound_proc, "host-a", None)
        },
        process(&current_proc, "host-a", None),
    ] {
        insert_process(&s.store, p).await.expect("insert process");
    }
    let (released_port, held_port) = (v7(T0, 9), v7(T0, 10));
    let released = PortRecord {
        released_at: Some(T0 + 1_000),
        ..port(
            &released_port,
            "host-a",
            4001,
            "http",
            lease_owner(&old_ended, 1),
        )
    };
    insert_port(&s.store, released).await.expect("insert port");
    let held = port(
        &held_port,
        "host-a",
        4002,
        "http",
        process_owner(&current_proc, 1),
    );
    insert_port(&s.store, held).await.expect("insert port");

    let prune = |before: Millis, limit: u32| {
        s.store.write(true, move |tx| {
            Box::pin(async move { tx.prune_records(before, "host-a", limit).await })
        })
    };
    // Nothing ended before T0 + 1 s, the instant the old ones ended.
    assert_eq!(
        prune(T0 + 1_000, 100).await.expect("prune"),
        Vec::<String>::new()
    );
    let logs = prune(T0 + day, 100).await.expect("prune");
    assert_eq!(
        logs,
        [
            format!("/logs/{gone_proc}.out"),
            format!("/logs/{gone_proc}.err")
        ]
    );

    let b = s.backend();
    assert!(b.get_lease(&old_ended).await.expect("get").is_none());
    for kept in [&old_current, &old_ended_bound, &young_ended] {
        assert!(
            b.get_lease(kept).await.expect("get").is_some(),
            "{kept} kept"
        );
    }
    assert!(b.get_process(&gone_proc).await.expect("get").is_none());
    for kept in [&other_host_proc, &bound_proc, &current_proc] {
        assert!(
            b.get_process(kept).await.expect("get").is_some(),
            "{kept} kept"
        );
    }
    let ports = b.list_ports(Some("host-a"), None, 10).await.expect("ports");
    assert_eq!(ids(&ports, |p| &p.id), [held_port], "a current one stays");
    // Tokens go on from where the deleted lease's left them.
    assert_eq!(next_token(&s.store, "r/a").await, 2);
    s.close().await;
}

/// A plain lease with token 1 on `u/<id>`, a TTL, and 1 ms left at `now`.
fn renewable(id: &str, now: Millis) -> LeaseRecord {
    LeaseRecord {
        ttl_ms: Some(30_000),
        expires_at: Some(now + 1),
        ..lease(id, &format!("u/{id}"), 1)
    }
}

stores!(a_plain_lease_is_renewed_in_one_statement_where_the_store_can);
async fn a_plain_lease_is_renewed_in_one_statement_where_the_store_can() {
    let place = Place::new().await;
    let s = place.open().await;
    let now = T0 + 10_000;
    let ttl = |l: LeaseRecord, expires_at: Millis| LeaseRecord {
        ttl_ms: Some(30_000),
        expires_at: Some(expires_at),
        ..l
    };
    let plain = ttl(lease("plain", "u/plain", 1), now + 1);
    let no_ttl = lease("no-ttl", "u/no-ttl", 1);
    let passed = ttl(lease("passed", "u/passed", 1), now);
    let owned = LeaseRecord {
        owner: Some(identity(4242)),
        ..ttl(lease("owned", "u/owned", 1), now + 1)
    };
    let child = LeaseRecord {
        parent: Some(ParentRef {
            id: "plain".into(),
            resource: "u/plain".into(),
            token: 1,
        }),
        ..ttl(lease("child", "u/child", 1), now + 1)
    };
    let gone = ended(
        ttl(lease("gone", "u/gone", 1), now + 1),
        LeaseState::Released,
    );
    // Renewed first in each group below: a renewal that finds no statement
    // out goes at once, alone, and those that arrive meanwhile go together.
    let lead = ttl(lease("lead", "u/lead", 1), now + 1);
    for l in [&plain, &no_ttl, &passed, &owned, &child, &gone, &lead] {
        insert_lease(&s.store, l.clone()).await.expect("insert");
    }
    let renew = |id: &'static str, token: i64, ttl_ms: Option<i64>| {
        s.backend().renew_unowned(id, token, ttl_ms, now)
    };
    // Only PostgreSQL renews in one statement: SQLite's writer reads leases
    // from its cache and queues the update with others, unsynced, for less.
    let one_statement = matches!(stores::current(), stores::Store::Postgres);
    let renewed = renew("plain", 1, Some(5_000)).await.expect("renew");
    let expected = LeaseRecord {
        ttl_ms: Some(5_000),
        expires_at: Some(now + 5_000),
        renewed_at: Some(now),
        ..plain.clone()
    };
    assert_eq!(renewed, one_statement.then_some(expected.clone()));
    let renewed = renew("no-ttl", 1, None).await.expect("renew");
    let kept_no_ttl = LeaseRecord {
        renewed_at: Some(now),
        ..no_ttl.clone()
    };
    assert_eq!(renewed, one_statement.then_some(kept_no_ttl));
    // Wrong token, TTL passed, an owner or a parent to judge, ended: left to
    // the full script, and left as they were. Asked one at a time, then all
    // at once: PostgreSQL sends a lone renewal and a group in statements of
    // their own (`postgres/renewals.rs`), and both must refuse alike.
    let refused = [
        ("plain", 2, if one_statement { expected } else { plain }),
        ("passed", 1, passed),
        ("owned", 1, owned),
        ("child", 1, child),
        ("gone", 1, gone),
    ];
    for (id, token, before) in &refused {
        assert_eq!(
            renew(id, *token, Some(5_000)).await.expect("renew"),
            None,
            "{id}"
        );
        let after = s.backend().get_lease(id).await.expect("get");
        assert_eq!(after.as_ref(), Some(before), "{id} unchanged");
    }
    let before = s.backend().write_counters().round_trips.get();
    let together = futures_util::future::join_all(
        std::iter::once(("lead", 1))
            .chain(refused.iter().map(|(id, token, _)| (*id, *token)))
            .map(|(id, token)| renew(id, token, Some(5_000))),
    )
    .await;
    let sent = s.backend().write_counters().round_trips.get() - before;
    // 3 only should the lead's statement be answered before the others were
    // first polled (its thread held off the CPU between send and read): the
    // first of them then goes alone, the rest together.
    let expected = if one_statement { 2..=3 } else { 0..=0 };
    assert!(
        expected.contains(&sent),
        "the lead's statement, then one for the group: {sent}"
    );
    let mut together = together.into_iter();
    let lead = together.next().expect("the lead's answer").expect("renew");
    assert_eq!(lead.is_some(), one_statement, "the lead renewed");
    for ((id, _, before), answer) in refused.iter().zip(together) {
        assert_eq!(answer.expect("renew"), None, "{id}, in a group");
        let after = s.backend().get_lease(id).await.expect("get");
        assert_eq!(after.as_ref(), Some(before), "{id} unchanged by a group");
    }
    // And renewed in a group: a new TTL, and none (the lease's kept, or no
    // expiry at all).
    let at = now + 1_000;
    let before = s.backend().write_counters().round_trips.get();
    let (lead, plain, no_ttl) = tokio::join!(
        s.backend().renew_unowned("lead", 1, Some(7_000), at),
        s.backend().renew_unowned("plain", 1, Some(7_000), at),
        s.backend().renew_unowned("no-ttl", 1, None, at),
    );
    let sent = s.backend().write_counters().round_trips.get() - before;
    let expected = if one_statement { 2..=3 } else { 0..=0 };
    assert!(
        expected.contains(&sent),
        "the lead's, then the group's: {sent}"
    );
    assert_eq!(
        lead.expect("renew").is_some(),
        one_statement,
        "the lead renewed"
    );
    let plain = plain.expect("renew");
    let no_ttl = no_ttl.expect("renew");
    if one_statement {
        let plain = plain.expect("renewed in a group");
        assert_eq!(
            (plain.ttl_ms, plain.expires_at, plain.renewed_at),
            (Some(7_000), Some(at + 7_000), Some(at))
        );
        let no_ttl = no_ttl.expect("renewed in a group");
        assert_eq!(
            (no_ttl.ttl_ms, no_ttl.expires_at, no_ttl.renewed_at),
            (None, None, Some(at))
        );
    }
    s.close().await;
}

/// The sessions of the PostgreSQL renewals' own connection to the database
/// at `url` (`postgres/renewals.rs`), seen from an admin connection.
struct RenewalLines {
    admin: sqlx::PgConnection,
    database: String,
}

impl RenewalLines {
    async fn new(url: &str) -> Self {
        use sqlx::Connection;
        let base = stores::postgres_base().expect("on");
        let admin = sqlx::PgConnection::connect(&format!("{base}/postgres"))
            .await
            .expect("connect");
        let database = url.rsplit('/').next().expect("name").to_owned();
        Self { admin, database }
    }

    async fn pids(&mut self) -> Vec<i32> {
        sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity \
             WHERE datname = $1 AND application_name = 'holdfast-renewals'",
        )
        .bind(&self.database)
        .fetch_all(&mut self.admin)
        .await
        .expect("the renewals' sessions")
    }

    /// Once a renewals' session waits for a lock: its statement is out.
    /// Polled, as the database announces no such wait.
    async fn until_one_waits_for_a_lock(&mut self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let waiting: Vec<i32> = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 \
                 AND application_name = 'holdfast-renewals' AND wait_event_type = 'Lock'",
            )
            .bind(&self.database)
            .fetch_all(&mut self.admin)
            .await
            .expect("the renewals' sessions");
            if !waiting.is_empty() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no renewal statement waited for the lock"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// On PostgreSQL: a store with a plain lease `plain` (token 1) renewed
/// once, and its renewals' sessions.
async fn renewed_once(place: &Place, now: Millis) -> Option<(Opened, RenewalLines)> {
    let url = place.url.clone()?;
    let s = place.open().await;
    insert_lease(&s.store, renewable("plain", now))
        .await
        .expect("insert");
    let renewed = s.backend().renew_unowned("plain", 1, None, now).await;
    assert!(matches!(renewed, Ok(Some(_))), "{renewed:?}");
    Some((s, RenewalLines::new(&url).await))
}

stores!(a_closed_store_renews_nothing_and_leaves_no_renewal_connection_open);
/// PostgreSQL renews on a connection of its own, kept between statements:
/// closing the store closes it, and no renewal opens another.
async fn a_closed_store_renews_nothing_and_leaves_no_renewal_connection_open() {
    let place = Place::new().await;
    let now = T0 + 10_000;
    let Some((s, mut lines)) = renewed_once(&place, now).await else {
        return;
    };
    let store = s.store.clone();
    s.close().await;
    let after = store.backend().renew_unowned("plain", 1, None, now).await;
    assert!(
        matches!(after, Err(StoreError::Unavailable(_))),
        "a renewal after close: {after:?}"
    );
    // The server side of a closed connection ends a moment after it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let open = lines.pids().await;
        if open.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "renewal connection(s) {open:?} still open after close"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

stores!(a_renewal_whose_caller_goes_away_mid_statement_still_answers_the_others);
/// On PostgreSQL a renewal that finds no statement out sends its own on its
/// caller's task. A caller that goes away while that statement is out (its
/// client hung up) leaves the statement to finish on a task of its own: the
/// renewal is applied, and the renewal queued behind it is sent and answered.
async fn a_renewal_whose_caller_goes_away_mid_statement_still_answers_the_others() {
    use sqlx::Connection;
    let place = Place::new().await;
    let now = T0 + 10_000;
    let Some((s, mut lines)) = renewed_once(&place, now).await else {
        return;
    };
    insert_lease(&s.store, renewable("queued", now))
        .await
        .expect("insert");
    // Locked from another session, the table holds the next statement out.
    let url = place.url.clone().expect("a PostgreSQL place");
    let mut locker = sqlx::PgConnection::connect(&url).await.expect("connect");
    sqlx::raw_sql("BEGIN; LOCK TABLE leases IN ACCESS EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .expect("lock");
    let store = s.store.clone();
    let lead = tokio::spawn(async move {
        let b = store.backend();
        b.renew_unowned("plain", 1, Some(5_000), now).await
    });
    lines.until_one_waits_for_a_lock().await;
    // Queued behind the statement out: polled once, it waits for a reply.
    let b = s.backend();
    let mut queued = Box::pin(b.renew_unowned("queued", 1, Some(5_000), now));
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(queued.as_mut().poll(cx))).await;
    assert!(first.is_pending(), "queued behind the lead");
    lead.abort();
    let gone = lead.await.expect_err("the lead's caller went away");
    assert!(gone.is_cancelled());
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("unlock");
    let queued = tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("the queued renewal was answered");
    let queued = queued.expect("renewal").expect("renewed");
    assert_eq!(queued.expires_at, Some(now + 5_000));
    let plain = b.get_lease("plain").await.expect("get").expect("the lease");
    assert_eq!(
        plain.expires_at,
        Some(now + 5_000),
        "the lead's statement ran to its end"
    );
    s.close().await;
}

stores!(a_renewal_connection_cut_between_renewals_is_replaced_unseen);
/// The renewals' connection, used again within a second without a check,
/// is cut meanwhile: the renewal that meets it is sent again on a new one,
/// not answered `unavailable`.
async fn a_renewal_connection_cut_between_renewals_is_replaced_unseen() {
    let place = Place::new().await;
    let now = T0 + 10_000;
    let Some((s, mut lines)) = renewed_once(&place, now).await else {
        return;
    };
    let cut = lines.pids().await;
    assert_eq!(cut.len(), 1, "one renewal connection");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(cut[0])
        .execute(&mut lines.admin)
        .await
        .expect("terminate");
    let renewed = s
        .backend()
        .renew_unowned("plain", 1, Some(5_000), now)
        .await;
    assert!(matches!(renewed, Ok(Some(_))), "{renewed:?}");
    let now_open = lines.pids().await;
    assert_eq!(now_open.len(), 1, "one renewal connection");
    assert_ne!(now_open, cut, "a new one");
    s.close().await;
}

stores!(a_renewal_outside_transactions_leaves_a_lease_a_transaction_read_to_it);
/// Renewals of plain leases run outside the fleet's write lock: a write
/// transaction that read a lease and then writes it whole must not lose a
/// renewal made in between, nor may the renewal be answered for a lease
/// that transaction ends. It reads the lease with a row lock, and the
/// renewal skips a locked lease (None: the caller renews it in a
/// transaction of its own, after that one) rather than wait for it.
async fn a_renewal_outside_transactions_leaves_a_lease_a_transaction_read_to_it() {
    if !matches!(stores::current(), stores::Store::Postgres) {
        return;
    }
    let place = Place::new().await;
    let s = place.open().await;
    let now = T0 + 10_000;
    let plain = renewable("plain", now);
    // Written by another host, so that this one's writer reads it from the
    // database (what it wrote itself it would answer from memory).
    let other_host = place.open().await;
    insert_lease(&other_host.store, plain.clone())
        .await
        .expect("insert");
    other_host.close().await;
    for id in ["other", "lead"] {
        insert_lease(&s.store, renewable(id, now))
            .await
            .expect("insert");
    }
    let (read_tx, read_rx) = tokio::sync::oneshot::channel::<()>();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    // Taken by the job's first run (a job may run more than once).
    let read_tx = Arc::new(std::sync::Mutex::new(Some(read_tx)));
    let go_rx = Arc::new(std::sync::Mutex::new(Some(go_rx)));
    let store = s.store.clone();
    let ending = tokio::spawn(async move {
        store
            .write(true, move |tx| {
                Box::pin(async move {
                    let mut rec = tx.lease("plain").await?.expect("the lease");
                    let read = read_tx.lock().expect("lock").take();
                    let _ = read.map(|t| t.send(()));
                    let go = go_rx.lock().expect("lock").take();
                    if let Some(go) = go {
                        let _ = go.await;
                    }
                    rec.state = LeaseState::Released;
                    rec.ended_at = Some(now);
                    rec.end_reason = Some("released".into());
                    tx.update_lease(&rec).await
                })
            })
            .await
    });
    read_rx.await.expect("the transaction read the lease");
    let b = s.backend();
    let renewed = b.renew_unowned("plain", 1, Some(5_000), now).await;
    assert_eq!(
        renewed.expect("renewal"),
        None,
        "not renewed between the transaction's read and its write"
    );
    // Nor in a group (a statement of its own), whose other lease is renewed:
    // the two arrive while the lead's renewal, which went at once, is out.
    let before = b.write_counters().round_trips.get();
    let (lead, locked, free) = tokio::join!(
        b.renew_unowned("lead", 1, Some(5_000), now),
        b.renew_unowned("plain", 1, Some(5_000), now),
        b.renew_unowned("other", 1, Some(5_000), now),
    );
    let sent = b.write_counters().round_trips.get() - before;
    // 3 only should the lead's statement be answered before the two were
    // first polled; each then goes alone, and both still answer as below.
    assert!(
        (2..=3).contains(&sent),
        "the lead's statement, then the two renewals in one: {sent}"
    );
    assert!(lead.expect("renewal").is_some(), "the lead renewed");
    assert_eq!(locked.expect("renewal"), None, "skipped in a group too");
    let free = free.expect("renewal").expect("the unlocked lease renewed");
    assert_eq!(free.expires_at, Some(now + 5_000));
    let _ = go_tx.send(());
    ending.await.expect("task").expect("ended");
    let renewed = b.renew_unowned("plain", 1, Some(5_000), now).await;
    assert_eq!(
        renewed.expect("renewal"),
        None,
        "an ended lease is not renewed"
    );
    let after = b.get_lease("plain").await.expect("get").expect("the lease");
    assert_eq!(after.state, LeaseState::Released);
    assert_eq!(after.expires_at, plain.expires_at, "expiry not moved");
    s.close().await;
}

/// End the current lease `id` at `at`, with its event; its expiry as read.
fn release_lease<'t>(
    tx: &'t mut dyn holdfast::store::Tx,
    id: &'static str,
    at: Millis,
) -> holdfast::store::BoxFuture<'t, Result<Option<i64>, StoreError>> {
    Box::pin(async move {
        let rec = tx.lease(id).await?.expect("the lease");
        let mut ended = rec.clone();
        ended.state = LeaseState::Released;
        ended.ended_at = Some(at);
        ended.end_reason = Some("released".into());
        tx.update_lease(&ended).await?;
        tx.append_event(at, format!(r#"{{"released":"{id}"}}"#))
            .await?;
        Ok(rec.expires_at)
    })
}

stores!(a_lease_known_to_the_writer_and_changed_meanwhile_is_read_again);
/// The PostgreSQL writer answers reads from what its earlier transactions
/// read and wrote (and its renewals renewed): a lease it knows is released
/// in one round trip. At commit it checks that those rows did not change:
/// a renewal on another host in between makes the job run again on the
/// row as it now is, and the renewal is kept. One such failure is
/// forgiven; after a second within a second the writer reads from the
/// database for a second (two round trips).
async fn a_lease_known_to_the_writer_and_changed_meanwhile_is_read_again() {
    if !matches!(stores::current(), stores::Store::Postgres) {
        return;
    }
    let place = Place::new().await;
    let s = place.open().await;
    let now = T0 + 10_000;
    let b = s.backend();
    let round_trips = || b.write_counters().round_trips.get();

    // Acquired, renewed and released by this host: no read goes out.
    insert_lease(&s.store, renewable("fresh", now))
        .await
        .expect("insert");
    b.renew_unowned("fresh", 1, Some(5_000), now)
        .await
        .expect("renewal")
        .expect("renewed");
    let before = round_trips();
    let seen = s
        .store
        .write(true, move |tx| release_lease(tx, "fresh", now + 2))
        .await;
    assert_eq!(
        seen.expect("released"),
        Some(now + 5_000),
        "the renewal known"
    );
    assert_eq!(
        round_trips() - before,
        1,
        "the checks, the writes and COMMIT in one round trip"
    );
    assert_eq!(b.last_event_seq().await.expect("seq"), 1, "the event's seq");

    insert_lease(&s.store, renewable("plain", now))
        .await
        .expect("insert");
    // Behind the writer's back: another host renews it.
    let other_host = place.open().await;
    let renew_elsewhere = |id: &'static str| {
        let other = other_host.backend();
        async move {
            let again = other
                .renew_unowned(id, 1, Some(9_000), now)
                .await
                .expect("renewal")
                .expect("renewed");
            assert_eq!(again.expires_at, Some(now + 9_000));
        }
    };
    renew_elsewhere("plain").await;
    let first_failed = std::time::Instant::now();
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = {
        let runs = runs.clone();
        s.store
            .write(true, move |tx| {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                release_lease(tx, "plain", now + 2)
            })
            .await
            .expect("released")
    };
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the first run used the lease as this host left it, the second the other host's"
    );
    assert_eq!(
        seen,
        Some(now + 9_000),
        "released as the other host left it"
    );
    let stored = b.get_lease("plain").await.expect("get").expect("the lease");
    assert_eq!(stored.state, LeaseState::Released);
    assert_eq!(stored.expires_at, Some(now + 9_000), "the renewal was kept");
    assert_eq!(
        b.events(1, 10).await.expect("events").len(),
        1,
        "one event of the two runs"
    );

    // Written after the failed check, so known to the writer: one failure
    // is forgiven, and it is released in one round trip.
    let release_known = |id: &'static str| {
        let (s, b) = (&s, &b);
        async move {
            insert_lease(&s.store, renewable(id, now))
                .await
                .expect("insert");
            let before = b.write_counters().round_trips.get();
            s.store
                .write(true, move |tx| release_lease(tx, id, now + 3))
                .await
                .expect("released");
            b.write_counters().round_trips.get() - before
        }
    };
    assert_eq!(release_known("between").await, 1, "one failure forgiven");

    // A second failure within a second: read from the database.
    insert_lease(&s.store, renewable("plain2", now))
        .await
        .expect("insert");
    renew_elsewhere("plain2").await;
    s.store
        .write(true, move |tx| release_lease(tx, "plain2", now + 2))
        .await
        .expect("released");
    let apart = first_failed.elapsed();
    let spent = release_known("later").await;
    if apart < std::time::Duration::from_millis(900) {
        assert_eq!(spent, 2, "read from the database after two failed checks");
    } else {
        eprintln!("the two failed checks came {apart:?} apart: not a test of going cold");
    }
    other_host.close().await;
    s.close().await;
}

stores!(reservations_changed_by_another_host_are_read_again_though_as_many);
/// The writer's memory of an owner's reservations is checked by their ids,
/// not their count: another host that swapped one for another leaves the
/// count as it was, and the job that ends them all must see the new one.
async fn reservations_changed_by_another_host_are_read_again_though_as_many() {
    if !matches!(stores::current(), stores::Store::Postgres) {
        return;
    }
    let place = Place::new().await;
    let s = place.open().await;
    let now = T0 + 10_000;
    insert_lease(&s.store, renewable("owner", now))
        .await
        .expect("insert");
    let first = port("port-1", "host-a", 8080, "web", lease_owner("owner", 1));
    insert_port(&s.store, first).await.expect("reserve");
    let other_host = place.open().await;
    other_host
        .store
        .write(true, |tx| {
            Box::pin(async move {
                tx.release_port("port-1", T0 + 1).await?;
                let second = port("port-2", "host-b", 8081, "web", lease_owner("owner", 1));
                tx.insert_port(&second).await
            })
        })
        .await
        .expect("swapped");
    other_host.close().await;
    let ended: Vec<String> = s
        .store
        .write(true, move |tx| {
            Box::pin(async move {
                let held = tx.ports_of("owner").await?;
                for p in &held {
                    tx.release_port(&p.id, now).await?;
                }
                Ok(held.into_iter().map(|p| p.id).collect())
            })
        })
        .await
        .expect("released");
    assert_eq!(ended, ["port-2"], "the reservation the other host made");
    let held = s
        .backend()
        .owner_ports(&["owner".to_owned()])
        .await
        .expect("ports");
    assert!(held.is_empty(), "none left: {held:?}");
    s.close().await;
}

stores!(renewals_that_arrive_together_share_statements_and_each_gets_its_own_answer);
/// On PostgreSQL, renewals that arrive while others are out go together in
/// one statement (`postgres/renewals.rs`); each is answered with its own
/// lease as renewed, two of the same lease each with its own TTL.
async fn renewals_that_arrive_together_share_statements_and_each_gets_its_own_answer() {
    let place = Place::new().await;
    let s = place.open().await;
    let now = T0 + 10_000;
    let ids: Vec<String> = (0..40).map(|i| format!("plain-{i:02}")).collect();
    for id in &ids {
        let l = renewable(id, now);
        insert_lease(&s.store, l).await.expect("insert");
    }
    let b = s.backend();
    let before = b.write_counters().round_trips.get();
    // Polled in turn by one task: every renewal is queued before the first
    // statement goes out.
    let mut asked: Vec<(&str, i64)> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), 1_000 + i as i64))
        .collect();
    asked.push((ids[0].as_str(), 7_000));
    asked.push((ids[0].as_str(), 8_000));
    let answers = futures_util::future::join_all(
        asked
            .iter()
            .map(|&(id, ttl)| b.renew_unowned(id, 1, Some(ttl), now)),
    )
    .await;
    let sent = b.write_counters().round_trips.get() - before;
    if !matches!(stores::current(), stores::Store::Postgres) {
        assert!(
            answers.iter().all(|a| matches!(a, Ok(None))),
            "SQLite renews in its transactions"
        );
        assert_eq!(sent, 0);
        s.close().await;
        return;
    }
    for ((id, ttl), answer) in asked.iter().zip(answers) {
        let renewed = answer.expect("renewal").expect("renewed");
        assert_eq!(renewed.id, *id);
        assert_eq!(renewed.ttl_ms, Some(*ttl), "{id} answered with its own TTL");
        assert_eq!(renewed.expires_at, Some(now + ttl));
    }
    assert!(
        sent < asked.len() as u64 / 4,
        "{} renewals went in {sent} statements",
        asked.len()
    );
    let stored = b.get_lease(&ids[1]).await.expect("get").expect("lease");
    assert_eq!(stored.ttl_ms, Some(1_001), "written, not only answered");
    s.close().await;
}
