//! Many concurrent clients on a few resources: the event history must show
//! at most one current lease per resource at any time, and tokens strictly
//! increasing per resource.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::stores::stores;
use crate::support::Server;

const CLIENTS: usize = 32;
pub(crate) const RESOURCES: usize = 4;
const RUN_FOR: Duration = Duration::from_secs(3);

/// Replay the events and check the invariants; returns acquisitions per resource.
pub(crate) fn check_history(events: &[Value]) -> HashMap<String, usize> {
    let mut current: HashMap<String, (String, i64)> = HashMap::new();
    let mut last_token: HashMap<String, i64> = HashMap::new();
    let mut acquired: HashMap<String, usize> = HashMap::new();
    let mut last_seq = 0;
    for e in events {
        let seq = e["seq"].as_i64().expect("seq");
        assert!(seq > last_seq, "seq strictly increasing");
        last_seq = seq;
        let lease = &e["lease"];
        let resource = lease["resource"].as_str().expect("resource").to_owned();
        let id = lease["id"].as_str().expect("id").to_owned();
        let token = lease["token"].as_i64().expect("token");
        match e["type"].as_str().expect("type") {
            "lease.acquired" => {
                assert!(
                    !current.contains_key(&resource),
                    "two current leases on {resource} at seq {seq}: {:?} and {id}",
                    current[&resource]
                );
                let last = last_token.get(&resource).copied().unwrap_or(0);
                assert!(token > last, "token {token} after {last} on {resource}");
                last_token.insert(resource.clone(), token);
                current.insert(resource.clone(), (id, token));
                *acquired.entry(resource).or_default() += 1;
            }
            "lease.released" | "lease.expired" | "lease.reclaimed" | "lease.broken" => {
                let cur = current.remove(&resource);
                assert_eq!(
                    cur,
                    Some((id, token)),
                    "the ended lease was the current one (seq {seq})"
                );
            }
            "lease.activated" => {}
            other => panic!("unexpected event {other}"),
        }
    }
    acquired
}

pub(crate) async fn hammer(
    client: reqwest::Client,
    base: String,
    me: usize,
    until: Instant,
) -> (usize, usize) {
    let (mut won, mut lost) = (0, 0);
    let mut i = me;
    while Instant::now() < until {
        i += 1;
        let resource = format!("race/{}", i % RESOURCES);
        // Some acquirers wait, some do not: both paths must keep the invariant.
        let wait_ms = if me.is_multiple_of(2) { 0 } else { 200 };
        let r = client
            .post(format!("{base}/v1/leases"))
            .json(&json!({"resource": resource, "holder": format!("c{me}"), "ttl_ms": 30_000, "wait_ms": wait_ms}))
            .send()
            .await
            .expect("acquire");
        match r.status() {
            StatusCode::CREATED => {
                won += 1;
                let lease: Value = r.json().await.expect("json");
                let id = lease["id"].as_str().expect("id");
                let rel = client
                    .post(format!("{base}/v1/leases/{id}/release"))
                    .json(&json!({"token": lease["token"]}))
                    .send()
                    .await
                    .expect("release");
                assert_eq!(rel.status(), StatusCode::OK);
            }
            StatusCode::CONFLICT => {
                let body: Value = r.json().await.expect("json");
                assert_eq!(body["code"], "lease_held", "{body}");
                lost += 1;
            }
            other => panic!(
                "unexpected status {other}: {}",
                r.text().await.unwrap_or_default()
            ),
        }
    }
    (won, lost)
}

stores!(
    concurrent_acquire_release_keeps_one_current_lease_and_increasing_tokens,
    "multi_thread"
);
async fn concurrent_acquire_release_keeps_one_current_lease_and_increasing_tokens() {
    let s = Server::start().await;
    let until = Instant::now() + RUN_FOR;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|me| tokio::spawn(hammer(s.client.clone(), s.base.clone(), me, until)))
        .collect();
    let mut won = 0;
    for t in tasks {
        won += t.await.expect("client").0;
    }
    let events = s.all_events().await;
    let acquired = check_history(&events);
    assert_eq!(
        acquired.values().sum::<usize>(),
        won,
        "every 201 has its event, and no more"
    );
    assert_eq!(acquired.len(), RESOURCES);
    let current = s.get("/v1/leases").await;
    assert_eq!(current.body["items"], json!([]), "everything was released");
    eprintln!("race: {won} acquisitions over {RESOURCES} resources by {CLIENTS} clients");
}
