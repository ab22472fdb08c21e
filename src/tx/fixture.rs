//! What the tests of the transaction scripts share: a real SQLite store in a
//! temporary directory, a staged `FakeHost`, and a clock the test moves.
//! `run!` runs a script in one write transaction at the fixture's `now`.

use std::sync::Arc;

use serde_json::Value;

use crate::host::fake::FakeHost;
use crate::model::{LeaseRecord, LeaseState, ProcessRecord};
use crate::store::sqlite::SqliteStore;
use crate::store::{Backend, Store};
use crate::time::Millis;
use crate::waiters::Hub;

/// A spawned process record in `state`, with no identity, for tests that
/// need a record but not a store.
pub fn process_record(state: crate::model::ProcessState) -> ProcessRecord {
    ProcessRecord {
        id: "p".into(),
        kind: "job".into(),
        state,
        token: 1,
        operation_id: None,
        lease: None,
        host_id: "h".into(),
        identity: None,
        signal_group: false,
        owner: None,
        spawned: true,
        command: None,
        logs: None,
        exit: crate::model::Exit::default(),
        ttl_ms: None,
        expires_at: None,
        created_at: 0,
        started_at: None,
        ended_at: None,
        end_reason: None,
        metadata: Default::default(),
    }
}

/// A current-looking lease record with a 1 s TTL expiring at 1000, for
/// tests that need one in a store or a cache, not through a script.
pub fn lease_record(id: &str, resource: &str, state: LeaseState) -> LeaseRecord {
    LeaseRecord {
        id: id.into(),
        resource: resource.into(),
        token: 1,
        holder: "h".into(),
        state,
        owner: None,
        parent: None,
        ttl_ms: Some(1000),
        expires_at: Some(1000),
        acquired_at: 0,
        renewed_at: None,
        ended_at: None,
        end_reason: None,
        metadata: Default::default(),
    }
}

/// Where every fixture's clock starts (2023-11-14T22:13:20Z).
pub const T0: Millis = 1_700_000_000_000;

pub struct Fixture {
    pub host: Arc<FakeHost>,
    pub store: Store,
    /// The instant the next script runs at.
    pub now: Millis,
    pub dir: tempfile::TempDir,
}

impl Fixture {
    pub async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let host = Arc::new(FakeHost::new());
        let backend = SqliteStore::open(
            &dir.path().join("holdfast.db"),
            &crate::host::Host::local(host.as_ref()).boot_id,
            T0,
            Arc::new(Hub::new(0)),
        )
        .await
        .expect("open the store");
        Self {
            host,
            store: Store::new(Arc::new(backend)),
            now: T0,
            dir,
        }
    }

    pub fn backend(&self) -> &dyn Backend {
        self.store.backend()
    }

    pub async fn lease(&self, id: &str) -> LeaseRecord {
        self.backend()
            .get_lease(id)
            .await
            .expect("read lease")
            .expect("lease exists")
    }

    pub async fn process(&self, id: &str) -> ProcessRecord {
        self.backend()
            .get_process(id)
            .await
            .expect("read process")
            .expect("process exists")
    }

    /// The seq of the newest event: a mark to read later events from.
    pub async fn mark(&self) -> i64 {
        self.backend().last_event_seq().await.expect("last seq")
    }

    /// The events after `mark`, oldest first, as the API would show them.
    pub async fn events_after(&self, mark: i64) -> Vec<Value> {
        let rows = self.backend().events(mark, 1000).await.expect("events");
        rows.iter()
            .map(|r| serde_json::from_str(&r.payload).expect("event JSON"))
            .collect()
    }

    /// The events after `mark` as (type, id of the lease or process).
    pub async fn kinds_after(&self, mark: i64) -> Vec<(String, String)> {
        self.events_after(mark).await.iter().map(kind).collect()
    }

    /// The types of the events after `mark`.
    pub async fn types_after(&self, mark: i64) -> Vec<String> {
        let kinds = self.kinds_after(mark).await;
        kinds.into_iter().map(|(t, _)| t).collect()
    }
}

/// An event as (type, id of its lease or process or port).
pub fn kind(e: &Value) -> (String, String) {
    let subject = ["lease", "process", "port"]
        .iter()
        .find_map(|k| e[k]["id"].as_str())
        .unwrap_or_default();
    (
        e["type"].as_str().unwrap_or_default().to_owned(),
        subject.to_owned(),
    )
}

/// `(type, id)` pairs to compare `kinds_after` with.
pub fn expect(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, id)| ((*k).to_owned(), (*id).to_owned()))
        .collect()
}

/// Run a transaction script against `$fx`'s store and staged host at
/// `$fx.now`; a store failure fails the test.
macro_rules! run {
    ($fx:expr, |$tx:ident, $cx:ident| $body:expr) => {{
        let host = $fx.host.clone();
        let now = $fx.now;
        $fx.store
            .write(true, move |$tx| {
                Box::pin(async move {
                    let $cx = $crate::tx::Ctx {
                        host: host.as_ref(),
                        now,
                    };
                    $body.await
                })
            })
            .await
            .expect("the store")
    }};
}
pub(crate) use run;

/// Assert that the events after `$mark` are `$expected`, `(type, id)` pairs.
macro_rules! assert_events {
    ($fx:expr, $mark:expr, $expected:expr $(, $($msg:tt)+)?) => {
        assert_eq!(
            $fx.kinds_after($mark).await,
            $crate::tx::fixture::expect($expected)
            $(, $($msg)+)?
        )
    };
}
pub(crate) use assert_events;
