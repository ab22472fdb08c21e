//! Wake-ups for requests that wait: acquirers queued behind a held lease
//! (first come, first served, across the hosts of a fleet too: `remote`)
//! and event readers.

pub mod remote;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::store::{CommitListener, Effect};
use remote::{Announce, Place, Remote, WaitNews};

/// A local waiter: its ticket, its wake-up, and its place among the
/// fleet's waiters once its announcement came back stamped.
struct Entry {
    id: u64,
    notify: Arc<Notify>,
    at: Option<i64>,
    /// Until when it waits, once it is to be announced.
    until: Option<Instant>,
    /// When it was last told to the other hosts, who are then to be told
    /// when it leaves.
    announced: Option<Instant>,
}

/// Acquirers waiting for a resource, in arrival order. Only the head is
/// woken when a lease on the resource ends; it retries, and either takes the
/// lease or stays at the head.
type Queues = HashMap<String, VecDeque<Entry>>;

#[derive(Default)]
pub struct Waiters {
    queues: Mutex<Queues>,
    next_ticket: AtomicU64,
    /// Lease ends so far, over all resources: a waiter that saw this number
    /// before its failed attempt knows whether it may have missed a wake-up.
    ends: AtomicU64,
    /// The other hosts' waiters (a fleet's store only).
    remote: Mutex<Remote>,
    /// Tells the other hosts of this one's waiters (a fleet's store only).
    announce: OnceLock<Arc<dyn Announce>>,
    /// When another host was last heard from: a host alone on its database
    /// announces nothing (each announcement costs a statement, and wakes
    /// the listening connection of every host).
    peer_heard: Mutex<Option<Instant>>,
    /// Set when the server begins to shut down: whoever waits (acquirers,
    /// long polls, event streams) answers at once instead of being cut off
    /// unanswered when the connections are closed.
    closing: watch::Sender<bool>,
}

/// The longest wait a request may ask for (`wait_ms`).
pub const MAX_WAIT_MS: u64 = 60_000;

/// How long a host that heard from no other keeps announcing its waiters.
const PEER_QUIET: std::time::Duration = std::time::Duration::from_secs(600);

impl Waiters {
    /// The server shuts down: every wait ends now.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    pub fn is_closing(&self) -> bool {
        *self.closing.borrow()
    }

    /// Resolves once the server shuts down.
    pub async fn closing(&self) {
        let mut rx = self.closing.subscribe();
        let _ = rx.wait_for(|closing| *closing).await;
    }

    pub fn ends_seen(&self) -> u64 {
        self.ends.load(Ordering::SeqCst)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn remote(&self) -> std::sync::MutexGuard<'_, Remote> {
        self.remote.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// From now on, announce this host's waiters through `a`, while
    /// other hosts are heard from, and say every `remote::ALIVE_EVERY`
    /// that they still wait.
    pub fn announce_with(self: &Arc<Self>, a: Arc<dyn Announce>) {
        if self.announce.set(a).is_err() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let me = Arc::downgrade(self);
        rt.spawn(async move {
            let mut every = tokio::time::interval(remote::ALIVE_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(w) = me.upgrade() else {
                    return;
                };
                w.tick(Instant::now());
            }
        });
    }

    /// While waiters of this host are announced: say it is alive, and
    /// announce again those whose stamp has not come back within
    /// `remote::DEFER` (the announcement was lost, or the listener missed
    /// it while reconnecting), since without one a waiter yields to every
    /// waiter elsewhere.
    fn tick(&self, now: Instant) {
        let Some(a) = self.announce.get().filter(|_| self.peers()) else {
            return;
        };
        let mut any = false;
        for (resource, q) in self.lock().iter_mut() {
            for e in q.iter_mut() {
                let Some(told) = e.announced else {
                    continue;
                };
                any = true;
                if let (None, Some(until)) = (e.at, e.until)
                    && now.saturating_duration_since(told) >= remote::DEFER
                {
                    e.announced = Some(now);
                    a.waiting(resource, e.id, until.saturating_duration_since(now));
                }
            }
        }
        if any {
            a.alive();
        }
    }

    /// Whether another host was heard from lately: a fleet of more than
    /// this one.
    pub fn peers(&self) -> bool {
        let heard = self
            .peer_heard
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        heard.is_some_and(|at| at.elapsed() < PEER_QUIET)
    }

    /// Another host of the fleet (`from`) sent something. The first time
    /// in a while, the waiters that wait already are announced now.
    pub fn peer_heard(&self, from: &str) {
        let was = self.peers();
        let now = Instant::now();
        *self
            .peer_heard
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(now);
        self.remote().heard(from, now);
        let Some(a) = self.announce.get().filter(|_| !was) else {
            return;
        };
        for (resource, q) in self.lock().iter_mut() {
            for e in q.iter_mut().filter(|e| e.announced.is_none()) {
                if let Some(until) = e.until {
                    e.announced = Some(now);
                    a.waiting(resource, e.id, until.saturating_duration_since(now));
                }
            }
        }
    }

    /// Join the queue of `resource`. `seen` is `ends_seen()` from before the
    /// attempt that failed: if a lease ended since, the ticket is woken at once.
    pub fn enqueue(self: &Arc<Self>, resource: &str, seen: u64) -> Ticket {
        let id = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        self.lock()
            .entry(resource.to_owned())
            .or_default()
            .push_back(Entry {
                id,
                notify: notify.clone(),
                at: None,
                until: None,
                announced: None,
            });
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
        for head in self.lock().values().filter_map(|q| q.front()) {
            head.notify.notify_one();
        }
    }

    /// A lease on `resource` ended (after its commit): wake the head waiter.
    pub fn lease_ended(&self, resource: &str) {
        self.ends.fetch_add(1, Ordering::SeqCst);
        self.wake_head(resource);
    }

    fn wake_head(&self, resource: &str) {
        if let Some(head) = self.lock().get(resource).and_then(|q| q.front()) {
            head.notify.notify_one();
        }
    }

    fn leave(&self, resource: &str, id: u64, pass_on: bool) {
        let mut queues = self.lock();
        let Some(q) = queues.get_mut(resource) else {
            return;
        };
        let was_head = q.front().is_some_and(|h| h.id == id);
        let announced = q.iter().any(|e| e.id == id && e.announced.is_some());
        q.retain(|e| e.id != id);
        if announced && let Some(a) = self.announce.get() {
            a.left(resource, id);
        }
        match q.front() {
            None => {
                queues.remove(resource);
            }
            // The head gave up without taking the lease: the next in line tries.
            Some(next) if was_head && pass_on => next.notify.notify_one(),
            Some(_) => {}
        }
    }

    /// The place among the fleet's waiters of the head of `resource`'s
    /// queue here: the earliest stamp of this host's waiters for the
    /// resource, which is where the other hosts see this host come first
    /// (a waiter announced again is stamped later than the one behind it).
    /// None while none has a stamp: then every waiter of another host
    /// counts as before it.
    fn place(&self, resource: &str) -> Option<Place> {
        let (at, ticket) = self
            .lock()
            .get(resource)?
            .iter()
            .filter_map(|e| Some((e.at?, e.id)))
            .min()?;
        let me = self.announce.get()?.instance().to_owned();
        Some((at, me, ticket))
    }

    /// The other hosts' waiters for `resource` that still wait and came
    /// before the head of this host's queue for it (`queued`), or before
    /// anyone here (not `queued`: for one that has not joined the queue).
    pub fn remote_ahead(&self, resource: &str, queued: bool) -> Vec<Place> {
        let place = if queued { self.place(resource) } else { None };
        self.remote()
            .ahead(resource, place.as_ref(), Instant::now())
    }

    /// How many wait here, and on the other hosts as they announced.
    pub fn waiting(&self) -> crate::metrics::Waiting {
        crate::metrics::Waiting {
            here: self.total(),
            elsewhere: {
                let mut remote = self.remote();
                remote.sweep(Instant::now());
                remote.total()
            },
        }
    }

    /// An announcement of waiters, this host's own or another's.
    pub fn news(&self, n: &WaitNews) {
        if n.mine {
            let mut queues = self.lock();
            for (resource, ticket, _) in &n.waits {
                if let Some(e) = queues
                    .get_mut(resource)
                    .and_then(|q| q.iter_mut().find(|e| e.id == *ticket))
                {
                    // The newest: announced again, it took that place everywhere.
                    e.at = Some(n.at);
                }
            }
            return;
        }
        let now = Instant::now();
        let mut remote = self.remote();
        remote.sweep(now);
        for (resource, ticket, left_ms) in &n.waits {
            // No wait is longer (`wait_ms`): a bad message holds none up for longer.
            let left = std::time::Duration::from_millis((*left_ms).min(MAX_WAIT_MS));
            // A little past the wait itself: its last try may still be on the way.
            let until = now + left + remote::DEFER;
            remote.joined(&n.from, n.at, resource, *ticket, until, now);
        }
        for (_, ticket) in &n.left {
            remote.left(&n.from, *ticket);
        }
        drop(remote);
        // Whoever deferred to one that left looks again.
        for (resource, _) in &n.left {
            self.wake_head(resource);
        }
    }

    /// The ticket at the head of `resource`'s queue: the next to be served.
    pub fn head(&self, resource: &str) -> Option<u64> {
        self.lock()
            .get(resource)
            .and_then(|q| q.front())
            .map(|e| e.id)
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
            .is_some_and(|h| h.id == self.id)
    }

    /// Tell the other hosts of this wait, which lasts until `until` at most
    /// (once another host is heard from, if none is yet).
    pub fn announce(&self, until: Instant) {
        let Some(a) = self.waiters.announce.get() else {
            return;
        };
        let mut queues = self.waiters.lock();
        let Some(e) = queues
            .get_mut(&self.resource)
            .and_then(|q| q.iter_mut().find(|e| e.id == self.id))
        else {
            return;
        };
        e.until = Some(until);
        if e.announced.is_none() && self.waiters.peers() {
            e.announced = Some(Instant::now());
            let left = until.saturating_duration_since(Instant::now());
            a.waiting(&self.resource, self.id, left);
        }
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
    fn announce_with(&self, a: Arc<dyn Announce>) {
        Waiters::announce_with(&self.waiters, a);
    }

    fn peer_heard(&self, from: &str) {
        self.waiters.peer_heard(from);
    }

    fn has_peers(&self) -> bool {
        self.waiters.peers()
    }

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
                Effect::Waiters(news) => self.waiters.news(news),
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

    /// What a fleet's store would have sent.
    #[derive(Default)]
    struct Heard(Mutex<Vec<String>>);

    impl Announce for Heard {
        fn instance(&self) -> &str {
            "me"
        }
        fn waiting(&self, resource: &str, ticket: u64, _left: Duration) {
            let mut h = self.0.lock().expect("lock");
            h.push(format!("wait {resource} {ticket}"));
        }
        fn left(&self, resource: &str, ticket: u64) {
            let mut h = self.0.lock().expect("lock");
            h.push(format!("left {resource} {ticket}"));
        }
        fn alive(&self) {
            self.0.lock().expect("lock").push("alive".into());
        }
    }

    impl Heard {
        fn said(&self) -> Vec<String> {
            self.0.lock().expect("lock").clone()
        }
    }

    fn news(from: &str, at: i64, waits: &[(&str, u64)], left: &[(&str, u64)]) -> WaitNews {
        WaitNews {
            from: from.into(),
            mine: from == "me",
            at,
            waits: waits
                .iter()
                .map(|(r, t)| ((*r).into(), *t, 60_000))
                .collect(),
            left: left.iter().map(|(r, t)| ((*r).into(), *t)).collect(),
        }
    }

    #[tokio::test]
    async fn waiters_of_other_hosts_are_ahead_by_their_stamps_and_leave_when_told() {
        let w = Arc::new(Waiters::default());
        let heard = Arc::new(Heard::default());
        w.announce_with(heard.clone());
        let t = w.enqueue("r", w.ends_seen());
        t.announce(Instant::now() + Duration::from_secs(60));
        assert!(heard.said().is_empty(), "alone: nothing to tell");
        // Another host is heard from: the waiter is announced then, once.
        w.peer_heard("b");
        t.announce(Instant::now() + Duration::from_secs(60));
        w.peer_heard("b");
        w.news(&news("b", 5, &[("r", 1)], &[]));
        // Before its own stamp comes back, every other host's waiter is ahead.
        assert_eq!(w.remote_ahead("r", true).len(), 1);
        w.news(&news("me", 3, &[("r", t.id())], &[]));
        assert!(w.remote_ahead("r", true).is_empty());
        w.news(&news("b", 2, &[("r", 2), ("other", 3)], &[]));
        assert_eq!(w.remote_ahead("r", true), vec![(2, "b".into(), 2)]);
        assert_eq!(w.remote_ahead("r", false).len(), 2);

        // One ahead leaves: the head is woken to look again.
        w.news(&news("b", 9, &[], &[("r", 2)]));
        timeout(SHORT, t.woken()).await.expect("woken");
        assert!(w.remote_ahead("r", true).is_empty());
        assert_eq!(w.waiting().elsewhere, 2);

        let quiet = w.enqueue("r", w.ends_seen());
        let (id, quiet_id) = (t.id(), quiet.id());
        drop(t);
        drop(quiet);
        // The keepalives the background tick may have sent meanwhile aside.
        let mut said = heard.said();
        said.retain(|s| s != "alive");
        assert_eq!(
            said,
            [format!("wait r {id}"), format!("left r {id}")],
            "announced once; a ticket never announced leaves unannounced ({quiet_id})"
        );
    }

    #[test]
    fn a_host_has_peers_once_another_is_heard_from_and_until_it_is_quiet_for_long() {
        let w = Waiters::default();
        assert!(!w.peers());
        w.peer_heard("b");
        assert!(w.peers());
        *w.peer_heard.lock().expect("lock") = Instant::now().checked_sub(PEER_QUIET);
        assert!(!w.peers(), "quiet for long: alone again");
    }

    #[tokio::test]
    async fn a_host_comes_first_with_its_earliest_stamped_waiter() {
        let w = Arc::new(Waiters::default());
        w.announce_with(Arc::new(Heard::default()));
        w.peer_heard("b");
        let first = w.enqueue("r", w.ends_seen());
        let second = w.enqueue("r", w.ends_seen());
        // The head was announced again (stamped 7), the one behind it
        // first (stamped 3): the other hosts see this host at 3.
        w.news(&news("me", 3, &[("r", second.id())], &[]));
        w.news(&news("me", 7, &[("r", first.id())], &[]));
        w.news(&news("b", 5, &[("r", 1)], &[]));
        assert!(w.remote_ahead("r", true).is_empty());
        w.news(&news("b", 2, &[("r", 2)], &[]));
        assert_eq!(w.remote_ahead("r", true), vec![(2, "b".into(), 2)]);
        // Stamped again later, the newest stamp is the place.
        w.news(&news("me", 9, &[("r", second.id())], &[]));
        assert_eq!(w.remote_ahead("r", true).len(), 2);
    }

    #[tokio::test]
    async fn an_unstamped_waiter_is_announced_again_and_the_host_says_it_is_alive() {
        let w = Arc::new(Waiters::default());
        let heard = Arc::new(Heard::default());
        w.announce_with(heard.clone());
        let now = Instant::now();
        w.tick(now);
        assert!(heard.said().is_empty(), "no peer: nothing to say");
        w.peer_heard("b");
        w.tick(now);
        assert!(heard.said().is_empty(), "nobody announced: nothing to say");

        let stamped = w.enqueue("r", w.ends_seen());
        let lost = w.enqueue("r", w.ends_seen());
        let until = Instant::now() + Duration::from_secs(60);
        stamped.announce(until);
        lost.announce(until);
        w.news(&news("me", 4, &[("r", stamped.id())], &[]));
        let (s, l) = (stamped.id(), lost.id());
        let told = vec![format!("wait r {s}"), format!("wait r {l}")];
        assert_eq!(heard.said(), told);

        w.tick(Instant::now());
        let mut expect = told.clone();
        expect.push("alive".into());
        assert_eq!(heard.said(), expect, "too soon to announce again");

        w.tick(Instant::now() + remote::DEFER);
        expect.extend([format!("wait r {l}"), "alive".into()]);
        assert_eq!(heard.said(), expect, "only the unstamped one again");
    }

    #[tokio::test]
    async fn another_hosts_wait_counts_for_no_longer_than_the_longest_wait() {
        let w = Arc::new(Waiters::default());
        let mut n = news("b", 1, &[("r", 1)], &[]);
        n.waits[0].2 = u64::MAX;
        w.news(&n);
        assert_eq!(w.remote_ahead("r", false).len(), 1);
        // Its host still speaks, yet past the longest wait it holds none up.
        let later = Instant::now() + Duration::from_millis(MAX_WAIT_MS) + remote::DEFER;
        let mut remote = w.remote();
        remote.heard("b", later);
        assert!(remote.ahead("r", None, later).is_empty(), "capped");
    }
}
