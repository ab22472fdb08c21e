//! Acquirers waiting on the other hosts of a fleet, so that first come,
//! first served holds across hosts: a release does not hand the lease to
//! a local waiter while an older one waits elsewhere, and a local waiter
//! lets that one take it first (for a bounded time: `DEFER`).
//!
//! Each host announces its waiters (`Announce`) as they join and leave a
//! queue; the database's clock stamps every announcement (`at`, in
//! microseconds), and all hosts order waiters by (`at`, host instance,
//! ticket), so they agree on who came first. A host learns its own
//! waiters' stamps from its own announcements coming back. While it has
//! waiters announced, a host says it is alive every `ALIVE_EVERY`: the
//! waiters of a host silent for `DEFER` hold nobody up, and are forgotten
//! once it stays silent for `FORGET_SILENT`.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio::time::Instant;

/// How long a waiter lets older waiters of other hosts take a free
/// resource before it tries itself, and how long a host may stay silent
/// before its waiters stop counting: a host that died with waiters, or
/// whose announcements of their leaving were lost, holds nobody up longer.
pub const DEFER: Duration = Duration::from_secs(1);

/// How often a host with waiters announced says it is alive.
pub const ALIVE_EVERY: Duration = Duration::from_millis(250);

/// How long a silent host's waiters are kept before they are forgotten
/// (they count again, unforgotten, if it speaks within that time).
pub const FORGET_SILENT: Duration = Duration::from_secs(5);

/// Sends this host's waiters to the other hosts.
pub trait Announce: Send + Sync + 'static {
    /// This server instance, as its announcements name it.
    fn instance(&self) -> &str;
    /// `ticket` waits for `resource`, for up to `left` more.
    fn waiting(&self, resource: &str, ticket: u64, left: Duration);
    /// `ticket` no longer waits for `resource`.
    fn left(&self, resource: &str, ticket: u64);
    /// This host still runs (its waiters still wait).
    fn alive(&self);
}

/// One announcement, as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitNews {
    /// The announcing instance.
    pub from: String,
    /// Whether it is this one (its stamps are the local waiters' places).
    pub mine: bool,
    /// The database's clock when it was sent, in microseconds.
    pub at: i64,
    /// (resource, ticket, milliseconds it may still wait) of waiters that joined.
    pub waits: Vec<(String, u64, u64)>,
    /// (resource, ticket) of waiters that left.
    pub left: Vec<(String, u64)>,
}

/// A waiter's place: (`at`, instance, ticket).
pub type Place = (i64, String, u64);

/// The other hosts' waiters, by resource, in their order, each with the
/// moment its wait runs out. Every method is given `now`.
#[derive(Default)]
pub(super) struct Remote {
    queues: HashMap<String, BTreeMap<Place, Instant>>,
    /// (instance, ticket) to its resource and stamp.
    places: HashMap<(String, u64), (String, i64)>,
    /// When each other host was last heard from.
    heard: HashMap<String, Instant>,
}

impl Remote {
    /// `from` sent something: its waiters still wait.
    pub fn heard(&mut self, from: &str, now: Instant) {
        match self.heard.get_mut(from) {
            Some(at) => *at = now,
            None => {
                self.heard.insert(from.to_owned(), now);
            }
        }
    }

    fn silent_for(&self, from: &str, now: Instant) -> Duration {
        self.heard
            .get(from)
            .map_or(Duration::MAX, |at| now.saturating_duration_since(*at))
    }

    /// `ticket` of `from` waits for `resource` until `until`. Announced
    /// again (its host lost its stamp), it takes the later place.
    pub fn joined(
        &mut self,
        from: &str,
        at: i64,
        resource: &str,
        ticket: u64,
        until: Instant,
        now: Instant,
    ) {
        self.heard(from, now);
        let key = (from.to_owned(), ticket);
        match self.places.get(&key) {
            Some((_, was)) if *was == at => return,
            Some(_) => self.left(from, ticket),
            None => {}
        }
        self.queues
            .entry(resource.to_owned())
            .or_default()
            .insert((at, from.to_owned(), ticket), until);
        self.places.insert(key, (resource.to_owned(), at));
    }

    pub fn left(&mut self, from: &str, ticket: u64) {
        if let Some((resource, at)) = self.places.remove(&(from.to_owned(), ticket)) {
            self.remove(&resource, &(at, from.to_owned(), ticket));
        }
    }

    fn remove(&mut self, resource: &str, place: &Place) {
        if let Some(q) = self.queues.get_mut(resource) {
            q.remove(place);
            if q.is_empty() {
                self.queues.remove(resource);
            }
        }
    }

    /// The places on `resource` before `place` (before everyone when None)
    /// whose wait has not run out and whose host was heard from within
    /// `DEFER`; those that ran out are forgotten.
    pub fn ahead(&mut self, resource: &str, place: Option<&Place>, now: Instant) -> Vec<Place> {
        let Some(q) = self.queues.get(resource) else {
            return Vec::new();
        };
        let (mut live, mut gone) = (Vec::new(), Vec::new());
        for (p, until) in q {
            if place.is_some_and(|mine| p >= mine) {
                break;
            }
            if *until <= now {
                gone.push(p.clone());
            } else if self.silent_for(&p.1, now) < DEFER {
                live.push(p.clone());
            }
        }
        self.forget(resource, &gone);
        live
    }

    fn forget(&mut self, resource: &str, places: &[Place]) {
        for p in places {
            self.places.remove(&(p.1.clone(), p.2));
            self.remove(resource, p);
        }
    }

    pub fn total(&self) -> usize {
        self.places.len()
    }

    /// Forget every wait that ran out or whose host stayed silent for
    /// `FORGET_SILENT`, on any resource: those of a host that died are
    /// otherwise only forgotten when their resource is asked for.
    pub fn sweep(&mut self, now: Instant) {
        let gone: Vec<(String, Place)> = self
            .queues
            .iter()
            .flat_map(|(r, q)| {
                q.iter()
                    .filter(|(p, until)| {
                        **until <= now || self.silent_for(&p.1, now) >= FORGET_SILENT
                    })
                    .map(|(p, _)| (r.clone(), p.clone()))
            })
            .collect();
        for (resource, place) in gone {
            self.forget(&resource, &[place]);
        }
        self.heard
            .retain(|_, at| now.saturating_duration_since(*at) < FORGET_SILENT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_a_minute(now: Instant) -> Instant {
        now + Duration::from_secs(60)
    }

    #[test]
    fn places_are_ordered_by_stamp_then_instance_then_ticket() {
        let (mut r, now) = (Remote::default(), Instant::now());
        r.joined("b", 20, "x", 1, in_a_minute(now), now);
        r.joined("c", 10, "x", 9, in_a_minute(now), now);
        r.joined("a", 20, "x", 2, in_a_minute(now), now);
        let mine: Place = (20, "b".into(), 0);
        let ahead = r.ahead("x", Some(&mine), now);
        assert_eq!(ahead, vec![(10, "c".into(), 9), (20, "a".into(), 2)]);
        assert_eq!(r.ahead("x", None, now).len(), 3);
        assert!(r.ahead("y", None, now).is_empty());
    }

    #[test]
    fn leaving_removes_a_place_and_a_second_join_moves_it_only_when_restamped() {
        let (mut r, now) = (Remote::default(), Instant::now());
        r.joined("b", 1, "x", 1, in_a_minute(now), now);
        r.joined("b", 1, "x", 1, in_a_minute(now), now);
        r.joined("c", 3, "x", 7, in_a_minute(now), now);
        assert_eq!(r.ahead("x", None, now)[0], (1, "b".into(), 1));
        r.joined("b", 5, "x", 1, in_a_minute(now), now);
        assert_eq!(
            r.ahead("x", None, now),
            vec![(3, "c".into(), 7), (5, "b".into(), 1)]
        );
        assert_eq!(r.total(), 2);
        r.left("b", 1);
        r.left("c", 7);
        assert_eq!(r.total(), 0);
        assert!(r.ahead("x", None, now).is_empty());
    }

    #[test]
    fn a_wait_that_ran_out_is_not_ahead_and_is_forgotten() {
        let (mut r, now) = (Remote::default(), Instant::now());
        r.joined("b", 1, "x", 1, now, now);
        r.joined("b", 2, "x", 2, in_a_minute(now), now);
        assert_eq!(r.ahead("x", None, now), vec![(2, "b".into(), 2)]);
        assert_eq!(r.total(), 1);
        r.joined("b", 3, "y", 3, now, now);
        r.joined("b", 4, "z", 4, in_a_minute(now), now);
        r.sweep(now);
        assert_eq!(r.total(), 2);
        assert!(r.ahead("y", None, now).is_empty());
    }

    #[test]
    fn a_silent_host_holds_nobody_up_and_is_forgotten_if_it_stays_silent() {
        let (mut r, t0) = (Remote::default(), Instant::now());
        r.joined("dead", 1, "x", 1, in_a_minute(t0), t0);
        r.joined("live", 2, "x", 2, in_a_minute(t0), t0);
        let later = t0 + DEFER;
        r.heard("live", later);
        assert_eq!(r.ahead("x", None, later), vec![(2, "live".into(), 2)]);
        r.sweep(later);
        assert_eq!(
            r.total(),
            2,
            "kept while silent for less than FORGET_SILENT"
        );
        // It speaks again: its waiter counts again, in its place.
        r.heard("dead", later);
        assert_eq!(r.ahead("x", None, later).len(), 2);
        let much_later = later + FORGET_SILENT;
        r.heard("live", much_later);
        r.sweep(much_later);
        assert_eq!(r.total(), 1);
        assert_eq!(r.ahead("x", None, much_later), vec![(2, "live".into(), 2)]);
    }
}
