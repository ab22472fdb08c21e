//! Acquirers waiting on the other hosts of a fleet, so that first come,
//! first served holds across hosts: a release does not hand the lease to
//! a local waiter while an older one waits elsewhere, and a local waiter
//! lets that one take it first (for a bounded time: `DEFER`).
//!
//! Each host announces its waiters (`Announce`) as they join and leave a
//! queue; the database's clock stamps every announcement (`at`, in
//! microseconds), and all hosts order waiters by (`at`, host instance,
//! ticket), so they agree on who came first. A host learns its own
//! waiters' stamps from its own announcements coming back.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio::time::Instant;

/// How long a waiter lets older waiters of other hosts take a free
/// resource before it tries itself: a host that died with waiters, or
/// whose announcements of their leaving were lost, holds nobody up longer.
pub const DEFER: Duration = Duration::from_secs(1);

/// Sends this host's waiters to the other hosts.
pub trait Announce: Send + Sync + 'static {
    /// This server instance, as its announcements name it.
    fn instance(&self) -> &str;
    /// `ticket` waits for `resource`, for up to `left` more.
    fn waiting(&self, resource: &str, ticket: u64, left: Duration);
    /// `ticket` no longer waits for `resource`.
    fn left(&self, resource: &str, ticket: u64);
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
/// moment its wait runs out.
#[derive(Default)]
pub(super) struct Remote {
    queues: HashMap<String, BTreeMap<Place, Instant>>,
    /// (instance, ticket) to its resource and stamp.
    places: HashMap<(String, u64), (String, i64)>,
}

impl Remote {
    /// `ticket` of `from` waits for `resource` until `until`.
    pub fn joined(&mut self, from: &str, at: i64, resource: &str, ticket: u64, until: Instant) {
        let key = (from.to_owned(), ticket);
        if self.places.contains_key(&key) {
            return;
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

    /// The places on `resource` before `place` (before everyone when None),
    /// whose wait has not run out; those that ran out are forgotten.
    pub fn ahead(&mut self, resource: &str, place: Option<&Place>) -> Vec<Place> {
        let now = Instant::now();
        let Some(q) = self.queues.get(resource) else {
            return Vec::new();
        };
        let (mut live, mut gone) = (Vec::new(), Vec::new());
        for (p, until) in q {
            if place.is_some_and(|mine| p >= mine) {
                break;
            }
            if *until > now {
                live.push(p.clone());
            } else {
                gone.push(p.clone());
            }
        }
        self.forget(resource, &gone);
        live
    }

    pub fn forget(&mut self, resource: &str, places: &[Place]) {
        for p in places {
            self.places.remove(&(p.1.clone(), p.2));
            self.remove(resource, p);
        }
    }

    pub fn total(&self) -> usize {
        self.places.len()
    }

    /// Forget every wait that ran out, on any resource: those of a host
    /// that died are otherwise only forgotten when their resource is asked for.
    pub fn sweep(&mut self) {
        let now = Instant::now();
        let gone: Vec<(String, Place)> = self
            .queues
            .iter()
            .flat_map(|(r, q)| {
                q.iter()
                    .filter(|(_, until)| **until <= now)
                    .map(|(p, _)| (r.clone(), p.clone()))
            })
            .collect();
        for (resource, place) in gone {
            self.forget(&resource, &[place]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_a_minute() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[test]
    fn places_are_ordered_by_stamp_then_instance_then_ticket() {
        let mut r = Remote::default();
        r.joined("b", 20, "x", 1, in_a_minute());
        r.joined("c", 10, "x", 9, in_a_minute());
        r.joined("a", 20, "x", 2, in_a_minute());
        let mine: Place = (20, "b".into(), 0);
        let ahead = r.ahead("x", Some(&mine));
        assert_eq!(ahead, vec![(10, "c".into(), 9), (20, "a".into(), 2)]);
        assert_eq!(r.ahead("x", None).len(), 3);
        assert!(r.ahead("y", None).is_empty());
    }

    #[test]
    fn leaving_and_forgetting_remove_a_place_and_a_second_join_is_ignored() {
        let mut r = Remote::default();
        r.joined("b", 1, "x", 1, in_a_minute());
        r.joined("b", 5, "x", 1, in_a_minute());
        assert_eq!(r.ahead("x", None), vec![(1, "b".into(), 1)]);
        r.left("b", 1);
        assert_eq!(r.total(), 0);
        r.joined("b", 2, "x", 2, in_a_minute());
        r.forget("x", &[(2, "b".into(), 2)]);
        assert!(r.ahead("x", None).is_empty());
        assert_eq!(r.total(), 0);
    }

    #[test]
    fn a_wait_that_ran_out_is_not_ahead_and_is_forgotten() {
        let mut r = Remote::default();
        r.joined("b", 1, "x", 1, Instant::now());
        r.joined("b", 2, "x", 2, in_a_minute());
        assert_eq!(r.ahead("x", None), vec![(2, "b".into(), 2)]);
        assert_eq!(r.total(), 1);
        r.joined("b", 3, "y", 3, Instant::now());
        r.joined("b", 4, "z", 4, in_a_minute());
        r.sweep();
        assert_eq!(r.total(), 2);
        assert!(r.ahead("y", None).is_empty());
    }
}
