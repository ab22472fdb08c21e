//! Event append: every state change writes one, in its own transaction,
//! carrying the whole record as it is after the change.

use serde_json::{Value, json};

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::model::{EventRow, EventType, LeaseView, PortRecord, ProcessView};
use crate::store::{Result, Store, StoreError, Tx};
use crate::time::{Millis, rfc3339};
use crate::waiters::Hub;

/// The record an event is about.
pub enum Subject<'a> {
    Lease(&'a LeaseView),
    Process(&'a ProcessView),
    Port(&'a PortRecord),
}

pub async fn append(
    tx: &mut dyn Tx,
    now: Millis,
    kind: EventType,
    subject: Subject<'_>,
    detail: Value,
) -> Result<()> {
    let (lease, process, port) = match subject {
        Subject::Lease(l) => (json!(l), Value::Null, Value::Null),
        Subject::Process(p) => (Value::Null, json!(p), Value::Null),
        Subject::Port(p) => (Value::Null, Value::Null, json!(p)),
    };
    let body = json!({
        "at": rfc3339(now), "type": kind.as_str(), "lease": lease,
        "process": process, "port": port, "detail": detail,
    });
    tx.append_event(now, body.to_string()).await
}

/// Reading the log: pages after a cursor, and never a silent hole where
/// retention removed what a reader had not read yet.
#[derive(Clone)]
pub struct EventLog {
    store: Store,
    hub: Arc<Hub>,
}

#[derive(Debug)]
pub enum ReadError {
    /// Retention removed events after the reader's cursor.
    Pruned {
        oldest_seq: i64,
    },
    Store(StoreError),
}

impl From<StoreError> for ReadError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

impl EventLog {
    pub fn new(store: Store, hub: Arc<Hub>) -> Self {
        Self { store, hub }
    }

    /// The oldest seq retention kept, as this server last learnt it.
    pub fn oldest_kept(&self) -> i64 {
        self.hub.pruned_through.load(Ordering::SeqCst) + 1
    }

    /// `Pruned` when events after `after` were removed by retention.
    pub fn check_not_pruned(&self, after: i64) -> std::result::Result<(), ReadError> {
        let pruned = self.hub.pruned_through.load(Ordering::SeqCst);
        if after < pruned {
            return Err(ReadError::Pruned {
                oldest_seq: pruned + 1,
            });
        }
        Ok(())
    }

    /// As `check_not_pruned`, reporting the oldest seq kept as the store
    /// says now: this host's memory of it may be behind (another host of a
    /// fleet pruned since), and a reader told a stale one resumes from it
    /// into another `410`.
    pub async fn check_not_pruned_now(&self, after: i64) -> std::result::Result<(), ReadError> {
        if self.check_not_pruned(after).is_ok() {
            return Ok(());
        }
        let pruned = self.store.backend().pruned_through().await?;
        self.hub.pruned_through.fetch_max(pruned, Ordering::SeqCst);
        self.check_not_pruned(after)
    }

    /// Events after `after`, oldest first. A gap after `after` means
    /// retention removed some, perhaps on another host of a fleet since
    /// this one last looked: then the watermark is read again and the
    /// reader gets `Pruned`, never a silent hole in its history.
    pub async fn read(
        &self,
        after: i64,
        limit: u32,
    ) -> std::result::Result<Vec<EventRow>, ReadError> {
        let rows = self.store.backend().events(after, limit).await?;
        if rows
            .first()
            .is_some_and(|r| Some(r.seq) != after.checked_add(1))
        {
            let pruned = self.store.backend().pruned_through().await?;
            self.hub.pruned_through.fetch_max(pruned, Ordering::SeqCst);
            self.check_not_pruned(after)?;
        }
        Ok(rows)
    }

    /// The newest committed seq, as it changes.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<i64> {
        self.hub.subscribe_events()
    }
}
