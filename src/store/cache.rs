//! What a writer may remember between its transactions, so that the
//! reads of the hot paths (a lease by id, the current lease of a resource,
//! its last token, the ports of an owner) need no trip to the database.
//!
//! It is written through: every write of the transaction scripts updates it
//! as it queues the statement. Whatever is undone (a failed job, a failed
//! batch) clears it all, so it never holds what the database did not; it
//! then fills again from the database as it is read. The database's
//! constraints stay the last word (one current lease per resource, one
//! current reservation per port).
//!
//! SQLite's single writer is the only one to change its rows, so what it
//! remembers stays true. On PostgreSQL other hosts write too, and renewals
//! go outside the writer's transactions: its cache is `guarded`. A
//! transaction that answers a read from an entry an earlier transaction
//! left there notes a `Check` of it, and the commit verifies every check
//! under the fleet's lock before it writes (a lease's row version, a
//! resource free, a last token, an owner's reservations by id); should
//! one fail, nothing is kept and the jobs run again on what the database
//! holds (`StoreError::Stale`).

use std::collections::{HashMap, HashSet};

use crate::model::{LeaseRecord, PortRecord};

/// Past this many entries in one map, the map starts over.
const LIMIT: usize = 20_000;

/// A lease row's version: PostgreSQL's `xmin`, the id of the transaction
/// that wrote it, modulo 2^32. None for a row this transaction wrote (its
/// id becomes the version at commit, `committed`).
pub type Version = Option<i64>;

/// Something a transaction took from an entry an earlier one left, to be
/// verified at its commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// The lease's row is still at this version.
    Lease { id: String, version: i64 },
    /// The resource has no current lease.
    Free { resource: String },
    /// The resource's last token is still this.
    Token { resource: String, last: i64 },
    /// The owner's current reservations are these (by id).
    Ports { owner: String, ids: Vec<String> },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Lease(String),
    Current(String),
    Token(String),
    Ports(String),
}

/// The entries a transaction read from the database or wrote itself (no
/// check needed), and the checks of the others it used.
#[derive(Debug, Default)]
struct Guard {
    fresh: HashSet<Key>,
    checks: Vec<Check>,
}

#[derive(Debug, Default)]
pub struct Cache {
    /// Current leases by id, with their row version.
    leases: HashMap<String, (LeaseRecord, Version)>,
    /// Resource to its current lease's id, or None when it has none.
    current: HashMap<String, Option<String>>,
    /// Resource to the last token handed out.
    tokens: HashMap<String, i64>,
    /// Owner (lease or process) to its current reservations, by name.
    ports: HashMap<String, Vec<PortRecord>>,
    /// Some when other writers may change the rows (see the module's head).
    guard: Option<Guard>,
}

fn room<K, V>(map: &mut HashMap<K, V>) {
    if map.len() >= LIMIT {
        map.clear();
    }
}

impl Cache {
    /// A cache whose entries from earlier transactions are checked at commit.
    pub fn guarded() -> Self {
        Self {
            guard: Some(Guard::default()),
            ..Self::default()
        }
    }

    pub fn clear(&mut self) {
        let guarded = self.guard.is_some();
        *self = Self::default();
        if guarded {
            self.guard = Some(Guard::default());
        }
    }

    /// A new transaction: every entry is an earlier one's again.
    pub fn begin(&mut self) {
        if let Some(g) = &mut self.guard {
            g.fresh.clear();
            g.checks.clear();
        }
    }

    /// The checks of the transaction so far, taken.
    pub fn take_checks(&mut self) -> Vec<Check> {
        self.guard
            .as_mut()
            .map(|g| std::mem::take(&mut g.checks))
            .unwrap_or_default()
    }

    /// The transaction committed as `version`: the rows it wrote are at it.
    pub fn committed(&mut self, version: i64) {
        for (_, v) in self.leases.values_mut() {
            v.get_or_insert(version);
        }
    }

    /// Whether `key` needs a check, and notes that it has one now.
    fn first_use(&mut self, key: Key) -> bool {
        self.guard.as_mut().is_some_and(|g| g.fresh.insert(key))
    }

    fn check(&mut self, check: Check) {
        if let Some(g) = &mut self.guard {
            g.checks.push(check);
        }
    }

    fn fresh(&mut self, key: Key) {
        if let Some(g) = &mut self.guard {
            g.fresh.insert(key);
        }
    }

    /// The lease `id` if it is current and known.
    pub fn lease(&mut self, id: &str) -> Option<LeaseRecord> {
        let (rec, version) = self.leases.get(id).cloned()?;
        let key = Key::Lease(id.to_owned());
        if self.unchecked(&key) {
            // An earlier transaction's whose version is not known: as if
            // not known at all.
            let version = version?;
            self.fresh(key);
            self.check(Check::Lease {
                id: id.to_owned(),
                version,
            });
        }
        Some(rec)
    }

    /// Whether `l` differs from the lease as known in its TTL, expiry and
    /// renewal time alone (false when the lease is not known).
    pub fn is_renewal(&self, l: &LeaseRecord) -> bool {
        self.leases.get(&l.id).is_some_and(|(k, _)| {
            (&k.state, &k.owner, k.ended_at, &k.end_reason)
                == (&l.state, &l.owner, l.ended_at, &l.end_reason)
        })
    }

    /// Some(the current lease of `resource`, or None) when known.
    pub fn current_lease(&mut self, resource: &str) -> Option<Option<LeaseRecord>> {
        match self.current.get(resource)?.clone() {
            None => {
                if self.first_use(Key::Current(resource.to_owned())) {
                    self.check(Check::Free {
                        resource: resource.to_owned(),
                    });
                }
                Some(None)
            }
            Some(id) => {
                let rec = self.lease(&id)?;
                self.fresh(Key::Current(resource.to_owned()));
                Some(Some(rec))
            }
        }
    }

    /// `rec` as this transaction read it from the database (`Some` version)
    /// or wrote it (None).
    pub fn saw_lease(&mut self, rec: &LeaseRecord, version: Version) {
        self.fresh(Key::Lease(rec.id.clone()));
        if rec.state.is_current() {
            room(&mut self.leases);
            room(&mut self.current);
            self.leases.insert(rec.id.clone(), (rec.clone(), version));
            self.current
                .insert(rec.resource.clone(), Some(rec.id.clone()));
            self.fresh(Key::Current(rec.resource.clone()));
            return;
        }
        self.leases.remove(&rec.id);
        if let Some(slot) = self.current.get_mut(&rec.resource)
            && slot.as_deref() == Some(rec.id.as_str())
        {
            // Ended here, the resource is free; read ended, another
            // writer may have made a lease current since.
            match (version, &self.guard) {
                (Some(_), Some(_)) => {
                    self.current.remove(&rec.resource);
                }
                _ => {
                    *slot = None;
                    self.fresh(Key::Current(rec.resource.clone()));
                }
            }
        }
    }

    /// A lease renewed outside the writer's transactions, as its statement
    /// returned it, at `version`: taken in place of the entry it knows, if
    /// that one is older. A lease it does not know (any more: its end may
    /// have come after the renewal) it leaves unknown.
    pub fn renewed(&mut self, rec: &LeaseRecord, version: i64) {
        let Some((known, Some(at))) = self.leases.get_mut(&rec.id) else {
            return;
        };
        // Transaction ids modulo 2^32 compare by their difference.
        if (version.wrapping_sub(*at) as i32) > 0 {
            *known = rec.clone();
            *at = version;
        }
    }

    /// Forget what this transaction wrote, its version not being known.
    pub fn forget_unversioned(&mut self) {
        let unversioned: Vec<(String, String)> = self
            .leases
            .iter()
            .filter(|(_, (_, v))| v.is_none())
            .map(|(id, (l, _))| (id.clone(), l.resource.clone()))
            .collect();
        for (id, resource) in unversioned {
            self.leases.remove(&id);
            self.current.remove(&resource);
        }
    }

    /// `resource` has no current lease (as just read).
    pub fn saw_no_current(&mut self, resource: &str) {
        room(&mut self.current);
        self.current.insert(resource.to_owned(), None);
        self.fresh(Key::Current(resource.to_owned()));
    }

    /// The next token of `resource` when its last is known, counted as handed out.
    pub fn next_token(&mut self, resource: &str) -> Option<i64> {
        let last = *self.tokens.get(resource)?;
        if self.first_use(Key::Token(resource.to_owned())) {
            self.check(Check::Token {
                resource: resource.to_owned(),
                last,
            });
        }
        self.tokens.insert(resource.to_owned(), last + 1);
        Some(last + 1)
    }

    pub fn saw_token(&mut self, resource: &str, token: i64) {
        room(&mut self.tokens);
        self.tokens.insert(resource.to_owned(), token);
        self.fresh(Key::Token(resource.to_owned()));
    }

    /// The current reservations of `owner`, by name, when known.
    pub fn ports_of(&mut self, owner: &str) -> Option<Vec<PortRecord>> {
        let held = self.ports.get(owner)?.clone();
        if self.first_use(Key::Ports(owner.to_owned())) {
            self.check(Check::Ports {
                owner: owner.to_owned(),
                ids: held.iter().map(|p| p.id.clone()).collect(),
            });
        }
        Some(held)
    }

    pub fn saw_ports(&mut self, owner: &str, ports: &[PortRecord]) {
        room(&mut self.ports);
        self.ports.insert(owner.to_owned(), ports.to_vec());
        self.fresh(Key::Ports(owner.to_owned()));
    }

    /// `owner` was just created: it holds no ports yet.
    pub fn new_owner(&mut self, owner: &str) {
        self.saw_ports(owner, &[]);
    }

    /// What this transaction leaves on the resources whose current lease
    /// it read or wrote (the checks made it true at its commit), for the
    /// other hosts (`postgres::learned::Hint`): each resource with its last
    /// token, and whether it is free.
    pub fn hints(&self) -> Vec<(String, i64, bool)> {
        let Some(g) = &self.guard else {
            return Vec::new();
        };
        let mut hints: Vec<(String, i64, bool)> = g
            .fresh
            .iter()
            .filter_map(|k| match k {
                Key::Current(r) => Some(r),
                _ => None,
            })
            .filter_map(|r| match self.current.get(r)? {
                None => Some((r.clone(), *self.tokens.get(r)?, true)),
                Some(id) => Some((r.clone(), self.leases.get(id)?.0.token, false)),
            })
            .collect();
        hints.sort();
        hints
    }

    /// Another host's commit left `resource` with `last` as its last
    /// token, and `free` or not: taken as an earlier transaction's entry
    /// (so checked when used), unless what is known is newer (a later
    /// token). A resource it took is forgotten: its lease is read when
    /// asked for.
    pub fn heard(&mut self, resource: &str, last: i64, free: bool) {
        if self.guard.is_none() || self.tokens.get(resource).is_some_and(|t| *t > last) {
            return;
        }
        if let Some(Some(id)) = self.current.remove(resource) {
            self.leases.remove(&id);
        }
        room(&mut self.tokens);
        self.tokens.insert(resource.to_owned(), last);
        if free {
            room(&mut self.current);
            self.current.insert(resource.to_owned(), None);
        }
    }

    /// Whether the entry of `key` is an earlier transaction's, unchecked:
    /// a write must not change it into something no check describes.
    fn unchecked(&self, key: &Key) -> bool {
        self.guard.as_ref().is_some_and(|g| !g.fresh.contains(key))
    }

    pub fn port_inserted(&mut self, p: &PortRecord) {
        let Some(target) = p.owner.target() else {
            return;
        };
        if p.released_at.is_some() {
            return;
        }
        if self.unchecked(&Key::Ports(target.id.clone())) {
            self.ports.remove(&target.id);
            return;
        }
        if let Some(held) = self.ports.get_mut(&target.id) {
            let at = held.partition_point(|h| h.name < p.name);
            held.insert(at, p.clone());
        }
    }

    pub fn port_released(&mut self, id: &str) {
        let holding: Vec<String> = self
            .ports
            .iter()
            .filter(|(_, held)| held.iter().any(|p| p.id == id))
            .map(|(owner, _)| owner.clone())
            .collect();
        for owner in holding {
            if self.unchecked(&Key::Ports(owner.clone())) {
                self.ports.remove(&owner);
            } else if let Some(held) = self.ports.get_mut(&owner) {
                held.retain(|p| p.id != id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LeaseState, PortOwner, TokenRef};

    use crate::tx::fixture::lease_record as lease;

    #[test]
    fn a_renewal_is_a_change_of_ttl_expiry_and_renewal_time_alone() {
        let mut c = Cache::default();
        let known = lease("a", "r", LeaseState::Active);
        let mut renewed = known.clone();
        (renewed.ttl_ms, renewed.expires_at, renewed.renewed_at) = (Some(9), Some(9), Some(9));
        assert!(!c.is_renewal(&renewed), "an unknown lease");
        c.saw_lease(&known, None);
        assert!(c.is_renewal(&renewed));
        let mut ended = renewed.clone();
        ended.state = LeaseState::Released;
        assert!(!c.is_renewal(&ended));
        let mut reason = renewed.clone();
        reason.end_reason = Some("x".into());
        assert!(!c.is_renewal(&reason));
        let mut activated = renewed;
        activated.state = LeaseState::Reserved;
        c.saw_lease(&activated, None);
        activated.state = LeaseState::Active;
        assert!(
            !c.is_renewal(&activated),
            "a state change with a new expiry"
        );
    }

    #[test]
    fn a_lease_that_ends_leaves_its_resource_known_free() {
        let mut c = Cache::default();
        assert_eq!(c.current_lease("r"), None, "unknown at first");
        c.saw_lease(&lease("a", "r", LeaseState::Active), None);
        assert_eq!(
            c.current_lease("r").flatten().map(|l| l.id),
            Some("a".into())
        );
        assert!(c.lease("a").is_some());
        c.saw_lease(&lease("a", "r", LeaseState::Released), None);
        assert_eq!(c.current_lease("r"), Some(None));
        assert_eq!(
            c.lease("a"),
            None,
            "ended leases are read from the database"
        );
    }

    #[test]
    fn an_old_lease_read_does_not_hide_the_current_one() {
        let mut c = Cache::default();
        c.saw_lease(&lease("b", "r", LeaseState::Active), None);
        c.saw_lease(&lease("a", "r", LeaseState::Released), None);
        assert_eq!(
            c.current_lease("r").flatten().map(|l| l.id),
            Some("b".into())
        );
    }

    #[test]
    fn tokens_count_on_only_once_known() {
        let mut c = Cache::default();
        assert_eq!(c.next_token("r"), None);
        c.saw_token("r", 4);
        assert_eq!(c.next_token("r"), Some(5));
        assert_eq!(c.next_token("r"), Some(6));
        c.clear();
        assert_eq!(c.next_token("r"), None);
    }

    #[test]
    fn ports_of_a_known_owner_follow_inserts_and_releases_in_name_order() {
        let port = |id: &str, name: &str| PortRecord {
            id: id.into(),
            host_id: "h".into(),
            port: 1,
            name: name.into(),
            owner: PortOwner {
                process: None,
                lease: Some(TokenRef {
                    id: "l".into(),
                    token: 1,
                }),
            },
            reserved_at: 0,
            released_at: None,
        };
        let mut c = Cache::default();
        c.port_inserted(&port("x", "web"));
        assert_eq!(c.ports_of("l"), None, "an unknown owner stays unknown");
        c.saw_ports("l", &[port("x", "web")]);
        c.port_inserted(&port("y", "api"));
        let names: Vec<String> = c
            .ports_of("l")
            .unwrap_or_default()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(names, ["api", "web"]);
        c.port_released("x");
        assert_eq!(c.ports_of("l").map(|p| p.len()), Some(1));
    }

    #[test]
    fn hints_say_what_a_commit_left_and_are_taken_as_checked_entries() {
        let mut c = Cache::guarded();
        let a = lease("a", "r", LeaseState::Active);
        c.saw_token("r", a.token);
        c.saw_lease(&a, None);
        c.saw_no_current("s");
        c.saw_token("s", 9);
        c.saw_no_current("unknown-token");
        assert_eq!(
            c.hints(),
            vec![("r".into(), a.token, false), ("s".into(), 9, true)]
        );
        c.begin();
        assert!(c.hints().is_empty(), "nothing touched yet");
        assert!(Cache::default().hints().is_empty(), "SQLite's: no fleet");

        // Another host released "a" and left "r" free at its token.
        c.heard("r", a.token, true);
        assert_eq!(c.lease("a"), None, "the ended lease is forgotten");
        assert_eq!(c.current_lease("r"), Some(None));
        assert_eq!(c.next_token("r"), Some(a.token + 1));
        assert_eq!(
            c.take_checks(),
            vec![
                Check::Free {
                    resource: "r".into()
                },
                Check::Token {
                    resource: "r".into(),
                    last: a.token
                }
            ],
            "used only through checks"
        );
        // Known newer than the hint: kept.
        c.heard("r", a.token - 1, true);
        assert_eq!(c.next_token("r"), Some(a.token + 2));
        // Taken elsewhere: its lease is to be read.
        c.heard("s", 10, false);
        assert_eq!(c.current_lease("s"), None);
        let mut sqlite = Cache::default();
        sqlite.heard("r", 1, true);
        assert_eq!(
            sqlite.current_lease("r"),
            None,
            "only a fleet's cache hears"
        );
    }
}
