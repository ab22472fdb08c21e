//! The lease transaction scripts against a real SQLite store, a staged host
//! and a clock the test moves: every row of the contract's takeover table,
//! fencing, and the events each script appends.

use serde_json::json;

use super::ops;
use super::{Acquire, Acquired, LeaseError, Outcome};
use crate::model::{Identity, LeaseState, LeaseView, Liveness};
use crate::tx::fixture::{Fixture, assert_events, run};

const TTL: i64 = 10_000;

fn cmd(resource: &str, holder: &str, ttl_ms: Option<i64>, owner: Option<Identity>) -> Acquire {
    Acquire {
        resource: resource.into(),
        holder: holder.into(),
        ttl_ms,
        owner,
        parent: None,
        reserve: false,
        metadata: Default::default(),
    }
}

async fn acquire(fx: &Fixture, c: Acquire) -> Outcome<Acquired> {
    run!(fx, |tx, cx| ops::acquire(tx, cx, c))
}

/// Acquire `resource` for holder "a"; it must be granted without a takeover.
async fn held(
    fx: &Fixture,
    resource: &str,
    ttl: Option<i64>,
    owner: Option<Identity>,
) -> LeaseView {
    let got = acquire(fx, cmd(resource, "a", ttl, owner))
        .await
        .expect("granted");
    assert!(got.reclaimed.is_none());
    got.lease
}

/// Holder "b" tries to take `resource`.
async fn contest(fx: &Fixture, resource: &str) -> Outcome<Acquired> {
    acquire(fx, cmd(resource, "b", Some(TTL), None)).await
}

async fn renew(fx: &Fixture, id: &str, token: i64) -> Outcome<LeaseView> {
    let id = id.to_owned();
    run!(fx, |tx, cx| ops::renew(tx, cx, &id, token, None))
}

async fn release(fx: &Fixture, id: &str, token: i64) -> Outcome<LeaseView> {
    let id = id.to_owned();
    run!(fx, |tx, cx| ops::release(tx, cx, &id, token))
}

async fn break_lease(fx: &Fixture, id: &str) -> Outcome<LeaseView> {
    let id = id.to_owned();
    run!(fx, |tx, cx| ops::break_lease(
        tx,
        cx,
        &id,
        "stuck".into(),
        "ops".into()
    ))
}

async fn reconcile(fx: &Fixture, id: &str) -> Option<LeaseView> {
    let id = id.to_owned();
    run!(fx, |tx, cx| ops::reconcile(tx, cx, &id))
}

/// `old` was taken over by `got` at `fx.now`, ending `state` for `reason`:
/// the answer names it, the record shows it, and the old lease's end event
/// comes before the new `lease.acquired`.
async fn assert_taken_over(
    fx: &Fixture,
    mark: i64,
    old: &LeaseView,
    got: Outcome<Acquired>,
    state: LeaseState,
    reason: &str,
) -> LeaseView {
    let got = got.expect("taken over");
    let r = got.reclaimed.as_ref().expect("reclaimed is named");
    assert_eq!((r.id.as_str(), r.token), (old.id.as_str(), old.token));
    assert_eq!(r.reason, reason);
    assert!(
        got.lease.token > old.token,
        "{} > {}",
        got.lease.token,
        old.token
    );
    let rec = fx.lease(&old.id).await;
    assert_eq!(rec.state, state);
    assert_eq!(rec.end_reason.as_deref(), Some(reason));
    assert_eq!(rec.ended_at, Some(fx.now));
    let end = format!("lease.{}", state.as_str());
    assert_events!(
        fx,
        mark,
        &[(&end, &old.id), ("lease.acquired", &got.lease.id)]
    );
    let events = fx.events_after(mark).await;
    assert_eq!(events[0]["detail"]["taken_over_by"], "b");
    assert_eq!(events[1]["detail"]["reclaimed"]["id"], json!(old.id));
    got.lease
}

/// The lease `old` is still current and no event was appended since `mark`.
async fn assert_untouched(fx: &Fixture, mark: i64, old: &LeaseView) {
    assert_eq!(fx.lease(&old.id).await.state, LeaseState::Active);
    assert_events!(fx, mark, &[]);
}

#[tokio::test]
async fn live_owner_keeps_its_lease_fresh_stale_or_without_ttl() {
    let mut fx = Fixture::new().await;
    let old = held(&fx, "r", Some(TTL), Some(fx.host.spawn())).await;
    let forever = held(&fx, "f", None, Some(fx.host.spawn())).await;
    let mark = fx.mark().await;
    fx.now += 1;
    match contest(&fx, "r").await {
        Err(LeaseError::Held(v)) => assert!(!v.stale && v.id == old.id),
        other => panic!("fresh: {other:?}"),
    }
    fx.now += 10 * TTL;
    match contest(&fx, "r").await {
        Err(LeaseError::Held(v)) => {
            assert!(v.stale, "TTL passed with a live owner shows as stale");
            assert_eq!(v.owner_status, Some(Liveness::Live));
        }
        other => panic!("stale: {other:?}"),
    }
    assert!(matches!(contest(&fx, "f").await, Err(LeaseError::Held(_))));
    assert_untouched(&fx, mark, &old).await;
    assert_untouched(&fx, mark, &forever).await;
}

#[tokio::test]
async fn dead_owner_is_reclaimed_at_once_even_before_its_ttl() {
    let mut fx = Fixture::new().await;
    let absent = fx.host.spawn();
    let reused = fx.host.spawn();
    let cases = [
        ("absent", absent.clone(), "owner_dead:pid_absent"),
        ("reused", reused.clone(), "owner_dead:pid_reused"),
        ("rebooted", fx.host.before_reboot(), "owner_dead:rebooted"),
    ];
    let mut olds = Vec::new();
    for (resource, owner, _) in &cases {
        olds.push(held(&fx, resource, Some(TTL), Some(owner.clone())).await);
    }
    fx.host.kill(absent.pid);
    fx.host.reuse(reused.pid);
    fx.now += 1;
    for ((resource, _, reason), old) in cases.iter().zip(&olds) {
        let mark = fx.mark().await;
        let got = contest(&fx, resource).await;
        assert_taken_over(&fx, mark, old, got, LeaseState::Reclaimed, reason).await;
    }
}

#[tokio::test]
async fn remote_owner_falls_back_to_the_ttl() {
    let mut fx = Fixture::new().await;
    let old = held(&fx, "r", Some(TTL), Some(fx.host.remote())).await;
    let ns = held(&fx, "ns", Some(TTL), Some(fx.host.other_namespace())).await;
    let no_ttl = held(&fx, "n", None, Some(fx.host.remote())).await;
    let mark = fx.mark().await;

    fx.now += TTL - 1;
    assert!(matches!(contest(&fx, "r").await, Err(LeaseError::Held(_))));
    assert!(matches!(contest(&fx, "ns").await, Err(LeaseError::Held(_))));
    fx.now += 100 * TTL;
    match contest(&fx, "n").await {
        Err(LeaseError::OwnerRemote(v)) => assert_eq!(v.owner_status, Some(Liveness::Remote)),
        other => panic!("remote without TTL: {other:?}"),
    }
    assert_untouched(&fx, mark, &no_ttl).await;

    let mark = fx.mark().await;
    let got = contest(&fx, "r").await;
    assert_taken_over(&fx, mark, &old, got, LeaseState::Expired, "ttl_expired").await;
    let mark = fx.mark().await;
    let got = contest(&fx, "ns").await;
    assert_taken_over(&fx, mark, &ns, got, LeaseState::Expired, "ttl_expired").await;
    assert!(
        fx.host.lookups().is_empty(),
        "a remote pid is never looked up here"
    );
}

#[tokio::test]
async fn unverifiable_owner_blocks_whatever_the_ttl() {
    let mut fx = Fixture::new().await;
    let denied = fx.host.spawn();
    let unreadable = fx.host.spawn();
    let a = held(&fx, "a", Some(TTL), Some(denied.clone())).await;
    let b = held(&fx, "b", None, Some(unreadable.clone())).await;
    fx.host.deny(denied.pid);
    fx.host.unreadable(unreadable.pid);
    let mark = fx.mark().await;
    fx.now += 10 * TTL;
    for (resource, old) in [("a", &a), ("b", &b)] {
        match contest(&fx, resource).await {
            Err(LeaseError::OwnerUnverifiable(v)) => {
                assert_eq!(v.owner_status, Some(Liveness::Unknown));
            }
            other => panic!("{resource}: {other:?}"),
        }
        assert_untouched(&fx, mark, old).await;
    }
}

#[tokio::test]
async fn ownerless_lease_expires_exactly_at_expires_at() {
    let mut fx = Fixture::new().await;
    let old = held(&fx, "r", Some(TTL), None).await;
    let forever = held(&fx, "f", None, None).await;
    let mark = fx.mark().await;
    fx.now += TTL - 1;
    assert!(matches!(contest(&fx, "r").await, Err(LeaseError::Held(_))));
    assert_untouched(&fx, mark, &old).await;
    fx.now += 1;
    let got = contest(&fx, "r").await;
    assert_taken_over(&fx, mark, &old, got, LeaseState::Expired, "ttl_expired").await;
    fx.now += 100 * TTL;
    assert!(matches!(contest(&fx, "f").await, Err(LeaseError::Held(_))));
    assert_eq!(fx.lease(&forever.id).await.state, LeaseState::Active);
}

#[tokio::test]
async fn tokens_strictly_increase_across_every_way_a_lease_ends() {
    let mut fx = Fixture::new().await;
    let owner = fx.host.spawn();
    let mut tokens = vec![held(&fx, "r", Some(TTL), Some(owner.clone())).await.token];
    // Reclaimed from a dead owner.
    fx.host.kill(owner.pid);
    let b = contest(&fx, "r").await.expect("reclaims").lease;
    tokens.push(b.token);
    // Expired (b has no owner).
    fx.now += TTL;
    let c = contest(&fx, "r").await.expect("expired").lease;
    tokens.push(c.token);
    // Released, then acquired anew.
    release(&fx, &c.id, c.token).await.expect("released");
    let d = held(&fx, "r", None, None).await;
    tokens.push(d.token);
    // Broken, then acquired anew.
    break_lease(&fx, &d.id).await.expect("broken");
    tokens.push(held(&fx, "r", None, None).await.token);
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

#[tokio::test]
async fn renew_or_activate_past_expiry_is_fenced_and_nothing_is_resurrected() {
    let mut fx = Fixture::new().await;
    let lease = held(&fx, "r", Some(TTL), None).await;
    let mut reserve = cmd("s", "a", Some(TTL), None);
    reserve.reserve = true;
    let reserved = acquire(&fx, reserve).await.expect("reserved").lease;

    fx.now += TTL - 1;
    let renewed = renew(&fx, &lease.id, lease.token).await.expect("in time");
    assert_eq!(renewed.expires_at, Some(fx.now + TTL));
    assert_eq!(renewed.renewed_at, Some(fx.now));

    fx.now += TTL;
    let mark = fx.mark().await;
    for _ in 0..2 {
        match renew(&fx, &lease.id, lease.token).await {
            Err(LeaseError::Fenced(v)) => assert_eq!(v.state, LeaseState::Expired),
            other => panic!("renew past expiry: {other:?}"),
        }
    }
    let id = reserved.id.clone();
    let token = reserved.token;
    let owner = Some(fx.host.spawn());
    match run!(fx, |tx, cx| ops::activate(tx, cx, &id, token, owner)) {
        Err(LeaseError::Fenced(v)) => assert_eq!(v.state, LeaseState::Expired),
        other => panic!("activate past expiry: {other:?}"),
    }
    let rec = fx.lease(&lease.id).await;
    assert_eq!(rec.state, LeaseState::Expired);
    assert_eq!(rec.end_reason.as_deref(), Some("ttl_expired"));
    assert_eq!(rec.expires_at, renewed.expires_at, "expiry not moved");
    let rec = fx.lease(&reserved.id).await;
    assert_eq!((rec.state, rec.owner), (LeaseState::Expired, None));
    assert_events!(
        fx,
        mark,
        &[
            ("lease.expired", &lease.id),
            ("lease.expired", &reserved.id)
        ]
    );
}

#[tokio::test]
async fn activate_binds_an_owner_to_a_reserved_lease_with_the_same_token() {
    let fx = Fixture::new().await;
    let mut reserve = cmd("s", "a", None, None);
    reserve.reserve = true;
    let reserved = acquire(&fx, reserve).await.expect("reserved").lease;
    assert_eq!(reserved.state, LeaseState::Reserved);
    let owner = fx.host.spawn();
    let mark = fx.mark().await;
    let (id, token, o) = (reserved.id.clone(), reserved.token, Some(owner.clone()));
    let active = run!(fx, |tx, cx| ops::activate(tx, cx, &id, token, o)).expect("activated");
    assert_eq!(active.state, LeaseState::Active);
    assert_eq!(active.token, reserved.token);
    assert_eq!(active.owner, Some(owner));
    assert_eq!(active.owner_status, Some(Liveness::Live));
    assert_events!(fx, mark, &[("lease.activated", &reserved.id)]);
    let id = reserved.id.clone();
    let again = run!(fx, |tx, cx| ops::activate(tx, cx, &id, token, None));
    assert!(
        matches!(again, Err(LeaseError::NotReserved(_))),
        "{again:?}"
    );
}

#[tokio::test]
async fn release_is_idempotent_with_the_same_token_and_fenced_otherwise() {
    let mut fx = Fixture::new().await;
    let lease = held(&fx, "r", Some(TTL), None).await;
    let mark = fx.mark().await;
    let wrong = release(&fx, &lease.id, lease.token + 1).await;
    assert!(matches!(wrong, Err(LeaseError::Fenced(_))), "{wrong:?}");
    assert_eq!(fx.lease(&lease.id).await.state, LeaseState::Active);

    for _ in 0..2 {
        let v = release(&fx, &lease.id, lease.token)
            .await
            .expect("released");
        assert_eq!(v.state, LeaseState::Released);
        assert_eq!(v.end_reason.as_deref(), Some("released"));
    }
    assert_events!(fx, mark, &[("lease.released", &lease.id)]);
    let wrong = release(&fx, &lease.id, lease.token + 1).await;
    assert!(matches!(wrong, Err(LeaseError::Fenced(_))), "{wrong:?}");
    let missing = release(&fx, "no-such-lease", 1).await;
    assert!(matches!(missing, Err(LeaseError::NotFound)), "{missing:?}");

    // A lease that ended otherwise is not released by its holder's token.
    let other = held(&fx, "o", Some(TTL), None).await;
    fx.now += TTL;
    let late = release(&fx, &other.id, other.token).await;
    assert!(matches!(late, Err(LeaseError::Fenced(ref v)) if v.state == LeaseState::Expired));
}

#[tokio::test]
async fn a_child_needs_a_current_parent_but_its_release_does_not() {
    let fx = Fixture::new().await;
    let parent = held(&fx, "p", None, Some(fx.host.spawn())).await;
    let child_of = |token: i64| {
        let mut c = cmd("p/child", "c", None, None);
        c.parent = Some((parent.id.clone(), token));
        c
    };
    let stale = acquire(&fx, child_of(parent.token + 1)).await;
    assert!(
        matches!(stale, Err(LeaseError::ParentFenced(Some(_)))),
        "{stale:?}"
    );
    let mut orphan = cmd("x/child", "c", None, None);
    orphan.parent = Some(("no-such-lease".into(), 1));
    let orphan = acquire(&fx, orphan).await;
    assert!(
        matches!(orphan, Err(LeaseError::ParentFenced(None))),
        "{orphan:?}"
    );

    let child = acquire(&fx, child_of(parent.token))
        .await
        .expect("child")
        .lease;
    let p = child.parent.as_ref().expect("parent recorded");
    assert_eq!((p.id.as_str(), p.token), (parent.id.as_str(), parent.token));

    release(&fx, &parent.id, parent.token)
        .await
        .expect("parent released");
    let renewed = renew(&fx, &child.id, child.token).await;
    assert!(
        matches!(renewed, Err(LeaseError::ParentFenced(Some(_)))),
        "{renewed:?}"
    );
    let released = release(&fx, &child.id, child.token)
        .await
        .expect("child released");
    assert_eq!(released.state, LeaseState::Released);
}

#[tokio::test]
async fn a_parent_whose_owner_died_ends_when_a_child_asks_for_it() {
    let fx = Fixture::new().await;
    let owner = fx.host.spawn();
    let parent = held(&fx, "p", None, Some(owner.clone())).await;
    fx.host.kill(owner.pid);
    let mark = fx.mark().await;
    let mut c = cmd("p/child", "c", None, None);
    c.parent = Some((parent.id.clone(), parent.token));
    match acquire(&fx, c).await {
        Err(LeaseError::ParentFenced(Some(v))) => assert_eq!(v.state, LeaseState::Reclaimed),
        other => panic!("{other:?}"),
    }
    assert_events!(fx, mark, &[("lease.reclaimed", &parent.id)]);
}

#[tokio::test]
async fn break_ends_a_lease_whatever_its_owner() {
    let fx = Fixture::new().await;
    let lease = held(&fx, "r", None, Some(fx.host.spawn())).await;
    let mark = fx.mark().await;
    let v = break_lease(&fx, &lease.id).await.expect("broken");
    assert_eq!(v.state, LeaseState::Broken);
    assert_eq!(v.end_reason.as_deref(), Some("broken:stuck"));
    assert_eq!(v.owner_status, Some(Liveness::Live));
    let events = fx.events_after(mark).await;
    assert_events!(fx, mark, &[("lease.broken", &lease.id)]);
    assert_eq!(events[0]["detail"], json!({"reason": "stuck", "by": "ops"}));
    let again = break_lease(&fx, &lease.id).await;
    assert!(matches!(again, Err(LeaseError::Fenced(_))), "{again:?}");
    let next = contest(&fx, "r").await.expect("free after a break");
    assert!(next.reclaimed.is_none());
}

#[tokio::test]
async fn reconcile_ends_dead_owner_and_ttl_passed_leases_only() {
    let mut fx = Fixture::new().await;
    let (dead, live, denied) = (fx.host.spawn(), fx.host.spawn(), fx.host.spawn());
    let ends = [
        (
            held(&fx, "dead", None, Some(dead.clone())).await,
            "owner_dead:pid_absent",
        ),
        (held(&fx, "ttl", Some(TTL), None).await, "ttl_expired"),
        (
            held(&fx, "remote", Some(TTL), Some(fx.host.remote())).await,
            "ttl_expired",
        ),
    ];
    let stays = [
        held(&fx, "stale", Some(TTL), Some(live)).await,
        held(&fx, "unknown", Some(TTL), Some(denied.clone())).await,
        held(&fx, "remote-no-ttl", None, Some(fx.host.remote())).await,
        held(&fx, "no-ttl", None, None).await,
    ];
    fx.host.kill(dead.pid);
    fx.host.deny(denied.pid);
    fx.now += TTL;
    let mark = fx.mark().await;
    for (lease, reason) in &ends {
        let v = reconcile(&fx, &lease.id).await.expect("ended");
        assert_eq!(v.end_reason.as_deref(), Some(*reason), "{}", lease.resource);
        assert!(reconcile(&fx, &lease.id).await.is_none(), "ends once");
    }
    for lease in &stays {
        assert!(
            reconcile(&fx, &lease.id).await.is_none(),
            "{}",
            lease.resource
        );
        assert_eq!(fx.lease(&lease.id).await.state, LeaseState::Active);
    }
    assert!(reconcile(&fx, "no-such-lease").await.is_none());
    assert_events!(
        fx,
        mark,
        &[
            ("lease.reclaimed", &ends[0].0.id),
            ("lease.expired", &ends[1].0.id),
            ("lease.expired", &ends[2].0.id)
        ]
    );
}
