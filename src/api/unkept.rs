//! What a keyed request leaves to write after its change: its answer
//! (unless its change's transaction kept it, `Claim::answered`), or the
//! release of its key after a failure. Written at once; when the store
//! cannot take it (a database briefly out of reach), written again in the
//! background until it can. Meanwhile this host answers a retry from
//! memory, and the key does not stay `request_in_progress` for a day.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use crate::model::IdempotentRequest;
use crate::store::{Store, StoreError};

/// How long a write is tried again before it is given up (and logged).
const RETRY_FOR: Duration = Duration::from_secs(600);
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const LONGEST_PAUSE: Duration = Duration::from_secs(5);
/// Writes tried again at once, at most: a long outage under load must not
/// hold answers (up to 1 MiB each) without bound. Past it, a key is left
/// `request_in_progress`, as when the retries run out.
const MOST_TRYING: usize = 10_000;

/// The keyed answers not yet kept by the store, and how many writes are
/// still being tried.
pub struct Unkept {
    answers: Mutex<HashMap<String, IdempotentRequest>>,
    trying: watch::Sender<usize>,
}

impl Default for Unkept {
    fn default() -> Self {
        Self {
            answers: Mutex::default(),
            trying: watch::Sender::new(0),
        }
    }
}

impl Unkept {
    fn answers(&self) -> MutexGuard<'_, HashMap<String, IdempotentRequest>> {
        self.answers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The answer given under `key` that the store does not hold yet.
    pub fn answer(&self, key: &str) -> Option<IdempotentRequest> {
        self.answers().get(key).cloned()
    }

    /// Keep `answer` under `key` (with `answer` None: let the key go),
    /// for the request `answer.request_id` / `request_id`; on stable
    /// storage before it returns if `durable` (see `Claim::created`).
    pub async fn settle(
        self: &Arc<Self>,
        store: &Store,
        key: String,
        request_id: String,
        answer: Option<IdempotentRequest>,
        durable: bool,
    ) {
        let first = write(store, &key, &request_id, answer.as_ref(), durable).await;
        let Err(e) = first else { return };
        if !retryable(&e) || *self.trying.borrow() >= MOST_TRYING {
            tracing::warn!(%key, error = %e, "cannot settle an idempotency key");
            return;
        }
        // Held before the client has its answer, so a retry finds it.
        if let Some(a) = &answer {
            self.answers().insert(key.clone(), a.clone());
        }
        self.trying.send_modify(|n| *n += 1);
        let (me, store) = (self.clone(), store.clone());
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + RETRY_FOR;
            let mut pause = FIRST_PAUSE;
            let outcome = loop {
                tokio::time::sleep(pause).await;
                match write(&store, &key, &request_id, answer.as_ref(), durable).await {
                    Err(e) if retryable(&e) && tokio::time::Instant::now() < deadline => {
                        pause = (pause * 2).min(LONGEST_PAUSE);
                    }
                    done => break done,
                }
            };
            if let Err(e) = outcome {
                tracing::warn!(%key, error = %e, "gave up settling an idempotency key");
            }
            if answer.is_some() {
                me.answers().remove(&key);
            }
            me.trying.send_modify(|n| *n -= 1);
        });
    }

    /// Wait up to `limit` for the writes still being tried (at shutdown,
    /// before the store closes).
    pub async fn drain(&self, limit: Duration) {
        let mut rx = self.trying.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|n| *n == 0)).await;
    }
}

fn retryable(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Busy | StoreError::Unavailable(_) | StoreError::OutcomeUnknown(_)
    )
}

async fn write(
    store: &Store,
    key: &str,
    request_id: &str,
    answer: Option<&IdempotentRequest>,
    durable: bool,
) -> Result<(), StoreError> {
    let answer = answer.map(|a| {
        (
            a.status.unwrap_or(500),
            a.content_type.clone().unwrap_or_default(),
            a.body.clone().unwrap_or_default(),
        )
    });
    let alone = answer
        .as_ref()
        .map(|(s, t, b)| (*s, t.as_str(), b.as_str()));
    if store
        .backend()
        .settle_key(key, request_id, alone, durable)
        .await?
    {
        return Ok(());
    }
    let (key, id) = (key.to_owned(), request_id.to_owned());
    store
        .write(durable, move |tx| {
            Box::pin(async move {
                match answer {
                    Some((status, content_type, body)) => {
                        tx.answer_key(&key, &id, (status, &content_type, &body))
                            .await
                    }
                    None => tx.forget_key(&key, &id).await,
                }
            })
        })
        .await
}
