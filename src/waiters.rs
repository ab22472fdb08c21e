//! Wake-ups for requests that wait: acquirers queued behind a held lease
//! (first come, first served) and, later, event readers.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Notify, watch};

use crate::store::{CommitListener, Effect};

/// Acquirers waiting for a resource, in arrival order. Only the head is
/// woken when a lease on the resource ends; it retries, and either takes the
/// lease or stays at the head.
type Queues = HashMap<String, VecDeque<(u64, Arc<Notify>)>>;

#[derive(Default)]
pub struct Waiters {
    queues: Mutex<Queues>,
    next_ticket: AtomicU64,
    /// Lease ends so far, over all resources: a waiter that saw this number
    /// before its failed attempt knows whether it may have missed a wake-up.
    ends: AtomicU64,
}

impl Waiters {
    pub fn ends_seen(&self) -> u64 {
        self.ends.load(Ordering::SeqCst)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Join the queue of `resource`. `seen` is `ends_seen()` from before the
    /// attempt that failed: if a lease ended since, the ticket is woken at once.
    pub fn enqueue(self: &Arc<Self>, resource: &str, seen: u64) -> Ticket {
        let id = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        self.lock()
            .entry(resource.to_owned())
            .or_default()
            .push_back((id, notify.clone()));
        if self.ends_seen() != seen {
            notify.notify_one();
        }
        Ticket {
            waiters: self.clone(),
            resource: resource.to_owned(),
            id,
            notify,
        }
    }

    /// Wake the head waiter of every resource, to re-check after lease
    /// ends that may not have been announced.
    pub fn wake_heads(&self) {
        self.ends.fetch_add(1, Ordering::SeqCst);
        for (_, head) in self.lock().values().filter_map(|q| q.front()) {
            head.notify_one();
        }
    }

    /// A lease on `resource` ended (after its commit): wake the head waiter.
    pub fn lease_ended(&self, resource: &str) {
        self.ends.fetch_add(1, Ordering::SeqCst);
        if let Some((_, head)) = self.lock().get(resource).and_then(|q| q.front()) {
            head.notify_one();
        }
    }

    fn leave(&self, resource: &str, id: u64, pass_on: bool) {
        let mut queues = self.lock();
        let Some(q) = queues.get_mut(resource) else {
            return;
        };
        let was_head = q.front().is_some_and(|(h, _)| *h == id);
        q.retain(|(t, _)| *t != id);
        match q.front() {
            None => {
                queues.remove(resource);
            }
            // The head gave up without taking the lease: the next in line tries.
            Some((_, next)) if was_head && pass_on => next.notify_one(),
            Some(_) => {}
        }
    }

    /// The ticket at the head of `resource`'s queue: the next to be served.
    pub fn head(&self, resource: &str) -> Option<u64> {
        self.lock()
            .get(resource)
            .and_then(|q| q.front())
            .map(|(id, _)| *id)
    }

    /// Whether anyone waits, for any resource (a queue that empties is removed).
    pub fn any(&self) -> bool {
        !self.lock().is_empty()
    }

    /// How many wait, over all resources.
    pub fn total(&self) -> usize {
        self.lock().values().map(VecDeque::len).sum()
    }

    /// How many wait for `resource` now.
    pub fn queued(&self, resource: &str) -> usize {
        self.lock().get(resource).map_or(0, VecDeque::len)
    }
}

/// A place in a resource's queue; leaving (by drop) passes the turn on.
pub struct Ticket {
    waiters: Arc<Waiters>,
    resource: String,
    id: u64,
    notify: Arc<Notify>,
}

impl Ticket {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn is_head(&self) -> bool {
        self.waiters
            .lock()
            .get(&self.resource)
            .and_then(|q| q.front())
            .is_some_and(|(h, _)| *h == self.id)
    }

    pub async fn woken(&self) {
        self.notify.notified().await;
    }

    /// Leave the queue after taking the lease: nobody else is woken.
    pub fn acquired(self) {
        self.waiters.leave(&self.resource, self.id, false);
        std::mem::forget(self);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.waiters.leave(&self.resource, self.id, true);
    }
}

/// Routes the effects of committed transactions to those waiting on them.
pub struct Hub {
    pub waiters: Arc<Waiters>,
    events: watch::Sender<i64>,
    /// Wakes the reconciler: a lease ended, so processes it owned are to be claimed.
    pub reconcile_soon: Notify,
    /// The highest event seq that retention removed.
    pub pruned_through: std::sync::atomic::AtomicI64,
    /// Requests that wait (`wait_ms`, SSE) hold one of these; past the cap
    /// the answer is `503 busy`, never an unbounded pile of waiters.
    pub waiting: Arc<tokio::sync::Semaphore>,
}

/// How many requests may wait at once.
pub const MAX_WAITERS: usize = 2048;

impl Hub {
    pub fn new(last_seq: i64) -> Self {
        Self {
            waiters: Arc::default(),
            events: watch::Sender::new(last_seq),
            reconcile_soon: Notify::new(),
            pruned_through: std::sync::atomic::AtomicI64::new(0),
            waiting: Arc::new(tokio::sync::Semaphore::new(MAX_WAITERS)),
        }
    }

    /// The seq of the newest committed event, updated as events commit.
    pub fn subscribe_events(&self) -> watch::Receiver<i64> {
        self.events.subscribe()
    }

    /// An event up to `seq` is committed.
    pub fn event_committed(&self, seq: i64) {
        self.events.send_if_modified(|last| {
            let newer = seq > *last;
            if newer {
                *last = seq;
            }
            newer
        });
    }
}

impl CommitListener for Hub {
    fn committed(&self, effects: &[Effect]) {
        for e in effects {
            match e {
                Effect::LeaseEnded(resource) => {
                    self.waiters.lease_ended(resource);
                    self.reconcile_soon.notify_one();
                }
                Effect::Event(seq) => self.event_committed(*seq),
                Effect::Missed => {
                    self.waiters.wake_heads();
                    self.reconcile_soon.notify_one();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::time::timeout;

    const SHORT: Duration = Duration::from_millis(50);

    #[tokio::test]
    async fn only_the_head_is_woken_and_leaving_passes_the_turn() {
        let w = Arc::new(Waiters::default());
        let seen = w.ends_seen();
        let first = w.enqueue("r", seen);
        let second = w.enqueue("r", seen);
        assert!(first.is_head() && !second.is_head());
        w.lease_ended("r");
        timeout(SHORT, first.woken()).await.expect("head woken");
        assert!(
            timeout(SHORT, second.woken()).await.is_err(),
            "second must not be woken"
        );
        drop(first);
        timeout(SHORT, second.woken())
            .await
            .expect("turn passed on");
        second.acquired();
        assert_eq!(w.queued("r"), 0);
    }

    #[tokio::test]
    async fn an_end_between_attempt_and_enqueue_is_not_lost() {
        let w = Arc::new(Waiters::default());
        let seen = w.ends_seen();
        w.lease_ended("r");
        let t = w.enqueue("r", seen);
        timeout(SHORT, t.woken()).await.expect("woken at once");
    }

    #[tokio::test]
    async fn taking_the_lease_wakes_nobody() {
        let w = Arc::new(Waiters::default());
        let seen = w.ends_seen();
        let first = w.enqueue("r", seen);
        let second = w.enqueue("r", seen);
        first.acquired();
        assert!(second.is_head());
        assert!(timeout(SHORT, second.woken()).await.is_err());
    }
}
