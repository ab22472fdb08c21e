//! The lease lifecycle over HTTP: acquire, renew, activate, release, break,
//! list, and the events each change appends.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::{Proc, Server, assert_lease_shape};

stores!(acquire_renew_release_and_release_again);
async fn acquire_renew_release_and_release_again() {
    let s = Server::start().await;
    let r = s.acquire(json!({"resource": "workspace/alpha", "holder": "sup-1", "ttl_ms": 30_000, "metadata": {"run": 7}})).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let lease = r.body;
    assert_lease_shape(&lease);
    let id = lease["id"].as_str().expect("id");
    assert_eq!(r.headers["location"], format!("/v1/leases/{id}").as_str());
    assert_eq!(lease["state"], "active");
    assert_eq!(lease["token"], 1);
    assert_eq!(lease["metadata"], json!({"run": 7}));
    assert_eq!(lease["stale"], false);
    assert!(
        lease.get("reclaimed").is_none(),
        "no takeover, no reclaimed"
    );
    assert!(uuid::Uuid::parse_str(id).is_ok_and(|u| u.get_version_num() == 7));

    let got = s.lease(id).await;
    assert_eq!(got["token"], 1);
    assert_eq!(got["expires_at"], lease["expires_at"]);

    let renewed = s
        .lease_op(id, "renew", json!({"token": 1, "ttl_ms": 60_000}))
        .await;
    assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.body);
    assert_eq!(renewed.body["ttl_ms"], 60_000);
    assert!(renewed.body["expires_at"].as_str() > lease["expires_at"].as_str());
    assert!(renewed.body["renewed_at"].is_string());

    let released = s.lease_op(id, "release", json!({"token": 1})).await;
    assert_eq!(released.status, StatusCode::OK);
    assert_eq!(released.body["state"], "released");
    assert_eq!(released.body["end_reason"], "released");
    assert!(released.body["ended_at"].is_string());

    let again = s.lease_op(id, "release", json!({"token": 1})).await;
    assert_eq!(again.status, StatusCode::OK, "release is idempotent");
    assert_eq!(again.body["state"], "released");

    let wrong = s.lease_op(id, "release", json!({"token": 2})).await;
    assert_eq!(wrong.status, StatusCode::CONFLICT);
    assert_eq!(wrong.code(), "fenced");
    assert_eq!(wrong.body["current"]["state"], "released");

    let renew_ended = s.lease_op(id, "renew", json!({"token": 1})).await;
    assert_eq!(renew_ended.code(), "fenced");
}

stores!(tokens_increase_across_releases_and_stale_tokens_are_fenced);
async fn tokens_increase_across_releases_and_stale_tokens_are_fenced() {
    let s = Server::start().await;
    let first = s.acquire_ok("r", "a").await;
    let held = s
        .acquire(json!({"resource": "r", "holder": "a", "ttl_ms": 5000}))
        .await;
    assert_eq!(held.code(), "lease_held", "acquire is never re-entrant");
    assert_eq!(held.body["holder"]["id"], first["id"]);
    let id1 = first["id"].as_str().expect("id");
    s.lease_op(id1, "release", json!({"token": 1})).await;
    let second = s.acquire_ok("r", "b").await;
    assert_eq!(second["token"], 2);
    let id2 = second["id"].as_str().expect("id");
    let stale = s.lease_op(id2, "renew", json!({"token": 1})).await;
    assert_eq!(stale.status, StatusCode::CONFLICT);
    assert_eq!(stale.code(), "fenced");
    assert_eq!(stale.body["current"]["token"], 2);
    // Another resource has its own sequence.
    assert_eq!(s.acquire_ok("other", "b").await["token"], 1);
}

stores!(ownerless_lease_past_its_ttl_is_expired_by_the_next_mutation);
async fn ownerless_lease_past_its_ttl_is_expired_by_the_next_mutation() {
    // A reconciler that never runs: only the mutations apply the table here.
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let lease = s
        .acquire(json!({"resource": "t", "holder": "a", "ttl_ms": 1000}))
        .await
        .body;
    let id = lease["id"].as_str().expect("id");
    let path = format!("/v1/leases/{id}");
    // Still `active` in the store until someone touches it; wait for the TTL.
    s.eventually(&path, Duration::from_secs(5), |l| {
        l["expires_at"].as_str() < Some(now_text().as_str())
    })
    .await;
    let renew = s.lease_op(id, "renew", json!({"token": 1})).await;
    assert_eq!(
        renew.code(),
        "fenced",
        "nothing is resurrected: {}",
        renew.body
    );
    assert_eq!(renew.body["current"]["state"], "expired");
    assert_eq!(renew.body["current"]["end_reason"], "ttl_expired");
    let next = s.acquire_ok("t", "b").await;
    assert_eq!(next["token"], 2);
}

stores!(takeover_of_an_expired_lease_reports_what_it_ended);
async fn takeover_of_an_expired_lease_reports_what_it_ended() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let old = s
        .acquire(json!({"resource": "t", "holder": "a", "ttl_ms": 1000}))
        .await
        .body;
    let r = loop {
        let r = s
            .acquire(json!({"resource": "t", "holder": "b", "ttl_ms": 1000}))
            .await;
        if r.status == StatusCode::CREATED {
            break r;
        }
        assert_eq!(r.code(), "lease_held");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(r.body["reclaimed"]["id"], old["id"]);
    assert_eq!(r.body["reclaimed"]["reason"], "ttl_expired");
    assert_eq!(
        s.lease(old["id"].as_str().expect("id")).await["state"],
        "expired"
    );
}

stores!(reconciler_expires_leases_nobody_touches);
async fn reconciler_expires_leases_nobody_touches() {
    let s = Server::start_with(&["--reconcile-interval-ms", "50"]).await;
    let lease = s
        .acquire(json!({"resource": "idle", "holder": "a", "ttl_ms": 1000}))
        .await
        .body;
    let path = format!("/v1/leases/{}", lease["id"].as_str().expect("id"));
    let ended = s
        .eventually(&path, Duration::from_secs(5), |l| l["state"] == "expired")
        .await;
    assert_eq!(ended["end_reason"], "ttl_expired");
    let events = s.all_events().await;
    let kinds: Vec<_> = events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(kinds, ["lease.acquired", "lease.expired"]);
    assert_eq!(events[1]["lease"]["state"], "expired");
}

stores!(reserved_lease_is_activated_by_another_process_with_the_same_token);
async fn reserved_lease_is_activated_by_another_process_with_the_same_token() {
    let s = Server::start().await;
    let worker = Proc::sleep();
    let r = s
        .acquire(
            json!({"resource": "slot", "holder": "launcher", "ttl_ms": 30_000, "reserve": true}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.body["state"], "reserved");
    let id = r.body["id"].as_str().expect("id");
    let token = r.body["token"].as_i64().expect("token");

    let wrong = s
        .lease_op(
            id,
            "activate",
            json!({"token": token + 1, "owner": {"pid": worker.pid()}}),
        )
        .await;
    assert_eq!(wrong.code(), "fenced");

    let renewed = s.lease_op(id, "renew", json!({"token": token})).await;
    assert_eq!(
        renewed.status,
        StatusCode::OK,
        "a reserved lease may be renewed"
    );
    assert_eq!(renewed.body["state"], "reserved");

    let act = s
        .lease_op(
            id,
            "activate",
            json!({"token": token, "owner": {"pid": worker.pid()}}),
        )
        .await;
    assert_eq!(act.status, StatusCode::OK, "{}", act.body);
    assert_eq!(act.body["state"], "active");
    assert_eq!(act.body["token"], token);
    assert_eq!(act.body["owner"]["pid"], worker.pid());
    assert_eq!(act.body["owner_status"], "live");

    let again = s.lease_op(id, "activate", json!({"token": token})).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(again.code(), "not_reserved");

    let kinds: Vec<_> = s
        .all_events()
        .await
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(kinds, ["lease.acquired", "lease.activated"]);
}

stores!(ended_parent_fences_renew_and_activate_of_children_but_not_release);
async fn ended_parent_fences_renew_and_activate_of_children_but_not_release() {
    let s = Server::start().await;
    let parent = s.acquire_ok("run/7", "runner").await;
    let pid = parent["id"].as_str().expect("id");
    let p = json!({"id": pid, "token": 1});
    let child = s
        .acquire(json!({"resource": "run/7/step", "holder": "step", "ttl_ms": 30_000, "parent": p}))
        .await;
    assert_eq!(child.status, StatusCode::CREATED, "{}", child.body);
    assert_eq!(
        child.body["parent"],
        json!({"id": pid, "resource": "run/7", "token": 1})
    );
    let reserved = s
        .acquire(json!({"resource": "run/7/other", "holder": "x", "ttl_ms": 30_000, "parent": p, "reserve": true}))
        .await;
    assert_eq!(reserved.status, StatusCode::CREATED);

    let stale_parent = s.acquire(json!({"resource": "run/7/bad", "holder": "x", "ttl_ms": 30_000, "parent": {"id": pid, "token": 2}})).await;
    assert_eq!(stale_parent.code(), "parent_fenced");

    let listed = s.get(&format!("/v1/leases?parent={pid}")).await;
    assert_eq!(listed.body["items"].as_array().map(Vec::len), Some(2));

    assert_eq!(
        s.lease_op(pid, "release", json!({"token": 1})).await.status,
        StatusCode::OK
    );
    // The children are still current: their owners are the authority.
    let cid = child.body["id"].as_str().expect("id");
    assert_eq!(s.lease(cid).await["state"], "active");

    let renew = s.lease_op(cid, "renew", json!({"token": 1})).await;
    assert_eq!(renew.status, StatusCode::CONFLICT);
    assert_eq!(renew.code(), "parent_fenced");
    let rid = reserved.body["id"].as_str().expect("id");
    let act = s.lease_op(rid, "activate", json!({"token": 1})).await;
    assert_eq!(act.code(), "parent_fenced");
    let rel = s.lease_op(cid, "release", json!({"token": 1})).await;
    assert_eq!(
        rel.status,
        StatusCode::OK,
        "releasing a child never needs its parent"
    );

    let orphan = s
        .acquire(json!({"resource": "run/7/late", "holder": "x", "ttl_ms": 30_000, "parent": p}))
        .await;
    assert_eq!(orphan.code(), "parent_fenced");
}

stores!(break_ends_any_current_lease_and_records_why);
async fn break_ends_any_current_lease_and_records_why() {
    let s = Server::start().await;
    let owner = Proc::sleep();
    let lease = s
        .acquire(json!({"resource": "b", "holder": "h", "owner": {"pid": owner.pid()}}))
        .await
        .body;
    let id = lease["id"].as_str().expect("id");
    let r = s
        .lease_op(id, "break", json!({"reason": "operator cleanup"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["state"], "broken");
    assert_eq!(r.body["end_reason"], "broken:operator cleanup");
    let again = s.lease_op(id, "break", json!({"reason": "again"})).await;
    assert_eq!(again.code(), "fenced");
    let events = s.all_events().await;
    let last = events.last().expect("event");
    assert_eq!(last["type"], "lease.broken");
    assert_eq!(last["detail"]["reason"], "operator cleanup");
    assert_eq!(s.acquire_ok("b", "next").await["token"], 2);
}

stores!(list_filters_and_pages_newest_first);
async fn list_filters_and_pages_newest_first() {
    let s = Server::start().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            s.acquire_ok(&format!("ws/{i}"), "lister").await["id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    s.acquire_ok("ws%/literal", "other").await;
    s.acquire_ok("wsx", "other").await;
    let first = s.get("/v1/leases?holder=lister&limit=2").await;
    assert_eq!(first.status, StatusCode::OK);
    let page: Vec<_> = first.body["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|l| l["id"].clone())
        .collect();
    assert_eq!(page, [ids[4].clone(), ids[3].clone()]);
    let mut seen = page.len();
    let mut cursor = first.body["next_cursor"].as_str().map(str::to_owned);
    while let Some(c) = cursor {
        let next = s
            .get(&format!("/v1/leases?holder=lister&limit=2&cursor={c}"))
            .await;
        seen += next.body["items"].as_array().expect("items").len();
        cursor = next.body["next_cursor"].as_str().map(str::to_owned);
    }
    assert_eq!(seen, 5);

    let prefixed = s.get("/v1/leases?prefix=ws%25").await;
    let names: Vec<_> = prefixed.body["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|l| l["resource"].clone())
        .collect();
    assert_eq!(names, [json!("ws%/literal")], "prefix matches literally");
    let exact = s.get("/v1/leases?resource=ws/3").await;
    assert_eq!(exact.body["items"][0]["id"], ids[3].as_str());

    s.lease_op(&ids[0], "release", json!({"token": 1})).await;
    let ended = s.get("/v1/leases?state=ended").await;
    assert_eq!(ended.body["items"].as_array().map(Vec::len), Some(1));
    let all = s.get("/v1/leases?state=all").await;
    assert_eq!(all.body["items"].as_array().map(Vec::len), Some(7));
    assert_eq!(all.body["next_cursor"], json!(null));

    for bad in [
        "limit=1001",
        "limit=0",
        "state=bogus",
        "cursor=zzz",
        "bogus=1",
    ] {
        let r = s.get(&format!("/v1/leases?{bad}")).await;
        assert_eq!(
            r.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{bad}: {}",
            r.body
        );
        assert_eq!(r.code(), "validation");
    }
}

pub fn now_text() -> String {
    // RFC 3339 with millis, comparable as a string with the server's times.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock");
    holdfast::time::rfc3339(i64::try_from(now.as_millis()).expect("ms"))
}

stores!(events_long_poll_returns_as_soon_as_an_event_commits);
async fn events_long_poll_returns_as_soon_as_an_event_commits() {
    let s = Server::start().await;
    let lease = s.acquire_ok("ev", "h").await;
    let after = s.all_events().await.last().expect("event")["seq"]
        .as_i64()
        .expect("seq");
    let empty = s
        .get(&format!("/v1/events?after={after}&wait_ms=200"))
        .await;
    assert_eq!(empty.status, StatusCode::OK);
    assert_eq!(empty.body["items"], json!([]), "the wait ran out");

    let poll = {
        let (client, url) = (
            s.client.clone(),
            s.url(&format!("/v1/events?after={after}&wait_ms=30000")),
        );
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let body: serde_json::Value = client
                .get(url)
                .send()
                .await
                .expect("get")
                .json()
                .await
                .expect("json");
            (body, started.elapsed())
        })
    };
    let id = lease["id"].as_str().expect("id");
    assert_eq!(
        s.lease_op(id, "release", json!({"token": 1})).await.status,
        StatusCode::OK
    );
    let (body, elapsed) = poll.await.expect("poll");
    assert_eq!(body["items"][0]["type"], "lease.released");
    assert_eq!(body["items"][0]["seq"], after + 1);
    assert!(
        elapsed < Duration::from_secs(10),
        "woken by the event: {elapsed:?}"
    );

    let page = s.get("/v1/events?after=0&limit=1").await;
    assert_eq!(page.body["items"].as_array().map(Vec::len), Some(1));
    assert_eq!(s.get("/v1/events?limit=0").await.code(), "validation");
    assert_eq!(s.get("/v1/events?wait_ms=60001").await.code(), "validation");
}
