//! Port reservations: no two current reservations share a port.

use std::collections::HashSet;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::stores::stores;
use crate::support::Server;

stores!(concurrent_reservations_never_share_a_port);
async fn concurrent_reservations_never_share_a_port() {
    let s = Server::start().await;
    let lease = s.acquire_ok("ports/race", "h").await;
    let owner = json!({"lease": {"id": lease["id"], "token": lease["token"]}});
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let (client, url, owner) = (s.client.clone(), s.url("/v1/ports"), owner.clone());
            tokio::spawn(async move {
                let r = client
                    .post(url)
                    .json(&json!({"names": [format!("p{i}"), "other"], "owner": owner, "range": [30000, 30200]}))
                    .send()
                    .await
                    .expect("reserve");
                assert_eq!(r.status(), StatusCode::CREATED);
                r.json::<Value>().await.expect("json")
            })
        })
        .collect();
    let mut seen = HashSet::new();
    for t in tasks {
        let body = t.await.expect("task");
        for r in body["reservations"].as_array().expect("reservations") {
            let port = r["port"].as_u64().expect("port");
            assert!((30000..=30200).contains(&port));
            assert!(seen.insert(port), "port {port} reserved twice");
        }
    }
    assert_eq!(seen.len(), 64);
    let listed = s.get("/v1/ports?limit=1000").await.body;
    assert_eq!(listed["items"].as_array().map(Vec::len), Some(64));

    // They end with their owner, in the same transaction.
    s.lease_op(
        lease["id"].as_str().expect("id"),
        "release",
        json!({"token": 1}),
    )
    .await;
    assert_eq!(s.get("/v1/ports").await.body["items"], json!([]));
}

stores!(a_release_naming_its_owner_is_fenced_by_it_not_by_the_token_alone);
async fn a_release_naming_its_owner_is_fenced_by_it_not_by_the_token_alone() {
    let s = Server::start().await;
    // Two owners whose tokens are equal, as every resource's first lease's are.
    let mine = s.acquire_ok("ports/mine", "me").await;
    let other = s.acquire_ok("ports/other", "them").await;
    assert_eq!(mine["token"], other["token"]);
    let r = s
        .post(
            "/v1/ports",
            json!({"names": ["http"], "owner": {"lease": {"id": mine["id"], "token": 1}},
                   "range": [31100, 31100]}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);

    let theirs = s
        .post(
            "/v1/ports/31100/release",
            json!({"token": 1, "owner_id": other["id"]}),
        )
        .await;
    assert_eq!(
        (theirs.status, theirs.code()),
        (StatusCode::CONFLICT, "fenced"),
        "{}",
        theirs.body
    );
    assert_eq!(theirs.body["current"]["owner"]["lease"]["id"], mine["id"]);
    let bad = s
        .post(
            "/v1/ports/31100/release",
            json!({"token": 1, "owner_id": "mine"}),
        )
        .await;
    assert_eq!(
        (bad.status, bad.code(), bad.body["field"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation",
            Some("owner_id")
        )
    );
    let listed = s.get("/v1/ports").await;
    assert_eq!(listed.body["items"][0]["port"], 31100, "still reserved");

    let released = s
        .post(
            "/v1/ports/31100/release",
            json!({"token": 1, "owner_id": mine["id"]}),
        )
        .await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.body);
    assert!(released.body["released_at"].is_string());
}

stores!(release_needs_the_owners_token_and_a_full_range_is_exhausted);
async fn release_needs_the_owners_token_and_a_full_range_is_exhausted() {
    let s = Server::start().await;
    let lease = s.acquire_ok("ports/one", "h").await;
    let owner = json!({"lease": {"id": lease["id"], "token": 1}});
    let r = s
        .post(
            "/v1/ports",
            json!({"names": ["http"], "owner": owner, "range": [31000, 31000]}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["ports"], json!({"http": 31000}));
    let again = s
        .post(
            "/v1/ports",
            json!({"names": ["web"], "owner": owner, "range": [31000, 31000]}),
        )
        .await;
    assert_eq!(
        (again.status, again.code()),
        (StatusCode::CONFLICT, "ports_exhausted")
    );

    // A port someone else has bound is not handed out either.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let busy = listener.local_addr().expect("addr").port();
    let taken = s
        .post(
            "/v1/ports",
            json!({"names": ["x"], "owner": owner, "range": [busy, busy]}),
        )
        .await;
    assert_eq!(taken.code(), "ports_exhausted");

    let wrong = s.post("/v1/ports/31000/release", json!({"token": 2})).await;
    assert_eq!(
        (wrong.status, wrong.code()),
        (StatusCode::CONFLICT, "fenced")
    );
    let ok = s.post("/v1/ports/31000/release", json!({"token": 1})).await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.body);
    assert!(ok.body["released_at"].is_string());
    let gone = s.post("/v1/ports/31000/release", json!({"token": 1})).await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);

    let stale = s
        .post(
            "/v1/ports",
            json!({"names": ["a"], "owner": {"lease": {"id": lease["id"], "token": 7}}}),
        )
        .await;
    assert_eq!(stale.code(), "fenced");
    for (body, field) in [
        (json!({"names": [], "owner": owner}), "names"),
        (json!({"names": ["Bad"], "owner": owner}), "names.0"),
        (json!({"names": ["a"], "owner": {}}), "owner"),
        (
            json!({"names": ["a"], "owner": owner, "range": [80, 90]}),
            "range",
        ),
        (
            json!({"names": ["a"], "owner": owner, "range": [2000, 80]}),
            "range",
        ),
    ] {
        let r = s.post("/v1/ports", body.clone()).await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(r.body["field"], field, "{body}: {}", r.body);
    }
    let kinds: Vec<_> = s
        .all_events()
        .await
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(kinds, ["lease.acquired", "port.reserved", "port.released"]);
}

stores!(ports_are_listed_newest_first_a_page_at_a_time);
async fn ports_are_listed_newest_first_a_page_at_a_time() {
    let s = Server::start().await;
    let lease = s.acquire_ok("ports/list", "h").await;
    let owner = json!({"lease": {"id": lease["id"], "token": 1}});
    let mut made = Vec::new();
    // Ports given out in their order of reservation: newest first is then
    // highest first, not the lowest port first.
    for low in [31210, 31220, 31230] {
        let r = s
            .post(
                "/v1/ports",
                json!({"names": ["http"], "owner": owner, "range": [low, low + 5]}),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        made.push(r.body["reservations"][0]["id"].clone());
    }
    made.reverse();
    let first = s.get("/v1/ports?limit=2").await.body;
    let ids = |page: &Value| -> Vec<Value> {
        let items = page["items"].as_array().expect("items");
        items.iter().map(|p| p["id"].clone()).collect()
    };
    assert_eq!(ids(&first), made[..2], "newest first: {first}");
    let cursor = first["next_cursor"].as_str().expect("a next page");
    let rest = s
        .get(&format!("/v1/ports?limit=2&cursor={cursor}"))
        .await
        .body;
    assert_eq!(ids(&rest), made[2..]);
    assert_eq!(rest["next_cursor"], Value::Null);
    let bad = s.get("/v1/ports?cursor=31230").await;
    assert_eq!(
        (bad.status, bad.body["field"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("cursor"))
    );
}
