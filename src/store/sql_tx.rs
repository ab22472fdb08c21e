//! The `Tx` of both stores: each operation is one shared statement on the
//! connection that holds the write transaction.

use super::cache::Cache;
use super::db::Exec;
use super::{BoxFuture, Effect, KeyClaim, Result, Tx, rows};
use crate::model::{LeaseRecord, PortRecord, ProcessRecord};
use crate::time::Millis;

pub struct SqlTx<'c, E: Exec + ?Sized> {
    pub conn: &'c mut E,
    /// The single writer's memory of what it wrote, if it keeps one.
    cache: Option<&'c mut Cache>,
    /// What this job's commit means for waiters.
    pub effects: Vec<Effect>,
    /// The job asked for a durable commit.
    pub durable: bool,
    /// It inserted a lease, a process or a port reservation.
    created: bool,
}

impl<'c, E: Exec + ?Sized> SqlTx<'c, E> {
    pub fn new(conn: &'c mut E, cache: Option<&'c mut Cache>) -> Self {
        Self {
            conn,
            cache,
            effects: Vec::new(),
            durable: false,
            created: false,
        }
    }
}

impl<E: Exec + ?Sized> SqlTx<'_, E> {
    /// Hand what the cache's answers took from earlier transactions to the
    /// connection, to be verified before this one writes.
    fn guard(&mut self) {
        if let Some(cache) = self.cache.as_deref_mut() {
            let checks = cache.take_checks();
            if !checks.is_empty() {
                self.conn.guard(checks);
            }
        }
    }
}

impl<E: Exec + ?Sized> Tx for SqlTx<'_, E> {
    fn lease<'a>(&'a mut self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        Box::pin(async move {
            if let Some(hit) = self.cache.as_deref_mut().and_then(|c| c.lease(id)) {
                self.guard();
                return Ok(Some(hit));
            }
            let read = rows::lease_to_write(self.conn, id).await?;
            if let (Some(cache), Some(rec)) = (self.cache.as_deref_mut(), &read.lease) {
                cache.saw_lease(rec, read.version);
                if read.has_ports == Some(false) {
                    cache.saw_ports(id, &[]);
                }
            }
            Ok(read.lease)
        })
    }

    fn current_lease<'a>(
        &'a mut self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        Box::pin(async move {
            if let Some(hit) = self
                .cache
                .as_deref_mut()
                .and_then(|c| c.current_lease(resource))
            {
                self.guard();
                return Ok(hit);
            }
            let read = rows::current_lease_to_write(self.conn, resource).await?;
            if let Some(cache) = self.cache.as_deref_mut() {
                match &read.lease {
                    Some(rec) => cache.saw_lease(rec, read.version),
                    None => cache.saw_no_current(resource),
                }
                if let Some(token) = read.last_token {
                    cache.saw_token(resource, token);
                }
            }
            Ok(read.lease)
        })
    }

    fn next_token<'a>(&'a mut self, resource: &'a str) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            if let Some(token) = self
                .cache
                .as_deref_mut()
                .and_then(|c| c.next_token(resource))
            {
                self.guard();
                rows::set_token(self.conn, resource, token).await?;
                return Ok(token);
            }
            let token = rows::next_token(self.conn, resource).await?;
            if let Some(cache) = self.cache.as_deref_mut() {
                cache.saw_token(resource, token);
            }
            Ok(token)
        })
    }

    fn insert_lease<'a>(&'a mut self, lease: &'a LeaseRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            rows::insert_lease(self.conn, lease).await?;
            self.created = true;
            if let Some(cache) = self.cache.as_deref_mut() {
                cache.saw_lease(lease, None);
                cache.new_owner(&lease.id);
            }
            Ok(())
        })
    }

    fn update_lease<'a>(&'a mut self, lease: &'a LeaseRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let renewal = self.cache.as_deref().is_some_and(|c| c.is_renewal(lease));
            rows::update_lease(self.conn, lease, renewal).await?;
            if let Some(cache) = self.cache.as_deref_mut() {
                cache.saw_lease(lease, None);
            }
            Ok(())
        })
    }

    fn append_event<'a>(&'a mut self, at: Millis, body: String) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let seq = self.conn.append_event(at, &body).await?;
            self.effects.push(Effect::Event(seq));
            Ok(())
        })
    }

    fn set_meta<'a>(&'a mut self, key: &'a str, value: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(rows::set_meta(self.conn, key, value))
    }

    fn prune_events(
        &mut self,
        keep_last: Option<u64>,
        older_than: Option<Millis>,
    ) -> BoxFuture<'_, Result<i64>> {
        Box::pin(rows::prune_events(self.conn, keep_last, older_than))
    }

    fn claim_key<'a>(&'a mut self, claim: &'a KeyClaim<'a>) -> BoxFuture<'a, Result<String>> {
        Box::pin(async move {
            if self.conn.queue_claim(claim) {
                return Ok(claim.request_id.to_owned());
            }
            rows::claim_key(self.conn, claim).await
        })
    }

    fn key_created<'a>(
        &'a mut self,
        key: &'a str,
        request_id: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if self.conn.created_queued(key, request_id) {
                return Ok(());
            }
            rows::key_created(self.conn, key, request_id).await
        })
    }

    fn created(&self) -> bool {
        self.created
    }

    fn set_created(&mut self, created: bool) {
        self.created = created;
    }

    fn answer_key<'a>(
        &'a mut self,
        key: &'a str,
        request_id: &'a str,
        answer: (u16, &'a str, &'a str),
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if self.conn.answer_queued(key, request_id, answer) {
                return Ok(());
            }
            rows::answer_key(self.conn, key, request_id, answer).await
        })
    }

    fn forget_key<'a>(
        &'a mut self,
        key: &'a str,
        request_id: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(rows::forget_key(self.conn, key, request_id))
    }

    fn prune_keys(&mut self, before: Millis) -> BoxFuture<'_, Result<()>> {
        Box::pin(rows::prune_keys(self.conn, before))
    }

    fn prune_records<'a>(
        &'a mut self,
        before: Millis,
        host_id: &'a str,
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<String>>> {
        Box::pin(rows::prune_records(self.conn, before, host_id, limit))
    }

    fn process<'a>(&'a mut self, id: &'a str) -> BoxFuture<'a, Result<Option<ProcessRecord>>> {
        Box::pin(rows::process(self.conn, id))
    }

    fn process_by_operation<'a>(
        &'a mut self,
        op: &'a str,
    ) -> BoxFuture<'a, Result<Option<ProcessRecord>>> {
        Box::pin(rows::process_by_operation(self.conn, op))
    }

    fn insert_process<'a>(&'a mut self, p: &'a ProcessRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            rows::insert_process(self.conn, p).await?;
            self.created = true;
            if let Some(cache) = self.cache.as_deref_mut() {
                cache.new_owner(&p.id);
            }
            Ok(())
        })
    }

    fn update_process<'a>(&'a mut self, p: &'a ProcessRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(rows::update_process(self.conn, p))
    }

    fn held_ports<'a>(&'a mut self, host_id: &'a str) -> BoxFuture<'a, Result<Vec<u16>>> {
        Box::pin(rows::held_ports(self.conn, host_id))
    }

    fn current_port<'a>(
        &'a mut self,
        host_id: &'a str,
        port: u16,
    ) -> BoxFuture<'a, Result<Option<PortRecord>>> {
        Box::pin(rows::current_port(self.conn, host_id, port))
    }

    fn insert_port<'a>(&'a mut self, p: &'a PortRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            rows::insert_port(self.conn, p).await?;
            self.created = true;
            if let Some(cache) = self.cache.as_deref_mut() {
                cache.port_inserted(p);
            }
            Ok(())
        })
    }

    fn ports_of<'a>(&'a mut self, owner_id: &'a str) -> BoxFuture<'a, Result<Vec<PortRecord>>> {
        Box::pin(async move {
            if let Some(hit) = self.cache.as_deref_mut().and_then(|c| c.ports_of(owner_id)) {
                self.guard();
                return Ok(hit);
            }
            let found = rows::ports_of(self.conn, owner_id).await?;
            if let Some(cache) = self.cache.as_deref_mut() {
                cache.saw_ports(owner_id, &found);
            }
            Ok(found)
        })
    }

    fn release_port<'a>(&'a mut self, id: &'a str, at: Millis) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            rows::release_port(self.conn, id, at).await?;
            if let Some(cache) = self.cache.as_deref_mut() {
                cache.port_released(id);
            }
            Ok(())
        })
    }

    fn after_commit(&mut self, effect: Effect) {
        self.effects.push(effect);
    }

    fn require_durable(&mut self) {
        self.durable = true;
    }
}
