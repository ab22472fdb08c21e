//! What a single writer may remember between its transactions, so that the
//! reads of the hot paths (a lease by id, the current lease of a resource,
//! its last token, the ports of an owner) need no trip to the database.
//!
//! Only a store whose writer is the only one (SQLite) keeps one. It is
//! written through: every write of the transaction scripts updates it as it
//! queues the statement. Whatever is undone (a failed job, a failed batch)
//! clears it all, so it never holds what the database does not; it then
//! fills again from the database as it is read. The database's constraints
//! stay the last word (one current lease per resource, one current
//! reservation per port): a stale entry could only make a write fail.

use std::collections::HashMap;

use crate::model::{LeaseRecord, PortRecord};

/// Past this many entries in one map, the map starts over.
const LIMIT: usize = 20_000;

#[derive(Debug, Default)]
pub struct Cache {
    /// Current leases by id.
    leases: HashMap<String, LeaseRecord>,
    /// Resource to its current lease's id, or None when it has none.
    current: HashMap<String, Option<String>>,
    /// Resource to the last token handed out.
    tokens: HashMap<String, i64>,
    /// Owner (lease or process) to its current reservations, by name.
    ports: HashMap<String, Vec<PortRecord>>,
}

fn room<K, V>(map: &mut HashMap<K, V>) {
    if map.len() >= LIMIT {
        map.clear();
    }
}

impl Cache {
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// The lease `id` if it is current and known.
    pub fn lease(&self, id: &str) -> Option<LeaseRecord> {
        self.leases.get(id).cloned()
    }

    /// Whether `l` differs from the lease as known in its TTL, expiry and
    /// renewal time alone (false when the lease is not known).
    pub fn is_renewal(&self, l: &LeaseRecord) -> bool {
        self.leases.get(&l.id).is_some_and(|k| {
            (&k.state, &k.owner, k.ended_at, &k.end_reason)
                == (&l.state, &l.owner, l.ended_at, &l.end_reason)
        })
    }

    /// Some(the current lease of `resource`, or None) when known.
    pub fn current_lease(&self, resource: &str) -> Option<Option<LeaseRecord>> {
        match self.current.get(resource)? {
            None => Some(None),
            Some(id) => self.leases.get(id).map(|l| Some(l.clone())),
        }
    }

    /// `rec` as it is now in the transaction (read, inserted or updated).
    pub fn saw_lease(&mut self, rec: &LeaseRecord) {
        if rec.state.is_current() {
            room(&mut self.leases);
            room(&mut self.current);
            self.leases.insert(rec.id.clone(), rec.clone());
            self.current
                .insert(rec.resource.clone(), Some(rec.id.clone()));
        } else {
            self.leases.remove(&rec.id);
            if let Some(slot) = self.current.get_mut(&rec.resource)
                && slot.as_deref() == Some(rec.id.as_str())
            {
                *slot = None;
            }
        }
    }

    /// `resource` has no current lease (as just read).
    pub fn saw_no_current(&mut self, resource: &str) {
        room(&mut self.current);
        self.current.insert(resource.to_owned(), None);
    }

    /// The next token of `resource` when its last is known, counted as handed out.
    pub fn next_token(&mut self, resource: &str) -> Option<i64> {
        let last = self.tokens.get_mut(resource)?;
        *last += 1;
        Some(*last)
    }

    pub fn saw_token(&mut self, resource: &str, token: i64) {
        room(&mut self.tokens);
        self.tokens.insert(resource.to_owned(), token);
    }

    /// The current reservations of `owner`, by name, when known.
    pub fn ports_of(&self, owner: &str) -> Option<Vec<PortRecord>> {
        self.ports.get(owner).cloned()
    }

    pub fn saw_ports(&mut self, owner: &str, ports: &[PortRecord]) {
        room(&mut self.ports);
        self.ports.insert(owner.to_owned(), ports.to_vec());
    }

    /// `owner` was just created: it holds no ports yet.
    pub fn new_owner(&mut self, owner: &str) {
        self.saw_ports(owner, &[]);
    }

    pub fn port_inserted(&mut self, p: &PortRecord) {
        let Some(target) = p.owner.target() else {
            return;
        };
        if p.released_at.is_some() {
            return;
        }
        if let Some(held) = self.ports.get_mut(&target.id) {
            let at = held.partition_point(|h| h.name < p.name);
            held.insert(at, p.clone());
        }
    }

    pub fn port_released(&mut self, id: &str) {
        for held in self.ports.values_mut() {
            held.retain(|p| p.id != id);
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
        c.saw_lease(&known);
        assert!(c.is_renewal(&renewed));
        let mut ended = renewed.clone();
        ended.state = LeaseState::Released;
        assert!(!c.is_renewal(&ended));
        let mut reason = renewed.clone();
        reason.end_reason = Some("x".into());
        assert!(!c.is_renewal(&reason));
        let mut activated = renewed;
        activated.state = LeaseState::Reserved;
        c.saw_lease(&activated);
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
        c.saw_lease(&lease("a", "r", LeaseState::Active));
        assert_eq!(
            c.current_lease("r").flatten().map(|l| l.id),
            Some("a".into())
        );
        assert!(c.lease("a").is_some());
        c.saw_lease(&lease("a", "r", LeaseState::Released));
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
        c.saw_lease(&lease("b", "r", LeaseState::Active));
        c.saw_lease(&lease("a", "r", LeaseState::Released));
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
}
