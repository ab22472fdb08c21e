//! Every refusal is problem JSON with the contract's status and code.

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::Server;

stores!(bodies_that_are_not_json_objects_are_refused);
async fn bodies_that_are_not_json_objects_are_refused() {
    let s = Server::start().await;
    let cases: &[(Option<&str>, &[u8], StatusCode, &str)] = &[
        (
            None,
            br#"{"resource":"a","holder":"h","ttl_ms":5000}"#,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            Some("text/plain"),
            br#"{"resource":"a"}"#,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            Some("application/json"),
            b"{\"resource\":",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            Some("application/json"),
            b"[1,2]",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            Some("application/json"),
            b"\"x\"",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            Some("application/json"),
            b"",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
    ];
    for (ct, body, status, code) in cases {
        let r = s.post_raw("/v1/leases", *ct, body.to_vec()).await;
        assert_eq!(
            r.status,
            *status,
            "{ct:?} {}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(r.code(), *code);
        assert_eq!(r.headers["content-type"], "application/problem+json");
        assert_eq!(r.body["type"], "about:blank");
        assert_eq!(r.body["status"], status.as_u16());
        assert!(r.body["title"].is_string() && r.body["detail"].is_string());
    }
    let big = format!(
        r#"{{"resource":"a","holder":"h","ttl_ms":5000,"metadata":{{"x":"{}"}}}}"#,
        "a".repeat(70_000)
    );
    let r = s
        .post_raw("/v1/leases", Some("application/json"), big.into_bytes())
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.code(), "payload_too_large");
}

stores!(invalid_members_are_422_validation_naming_the_field);
async fn invalid_members_are_422_validation_naming_the_field() {
    let s = Server::start().await;
    let long = "x".repeat(513);
    let big_meta: String = "m".repeat(17 * 1024);
    let cases = [
        (json!({"holder": "h", "ttl_ms": 5000}), "resource"),
        (json!({"resource": "a", "ttl_ms": 5000}), "holder"),
        (json!({"resource": "a", "holder": "h"}), "ttl_ms"),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": 999}),
            "ttl_ms",
        ),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": 86_400_001}),
            "ttl_ms",
        ),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": "5000"}),
            "ttl_ms",
        ),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": 1e30}),
            "ttl_ms",
        ),
        (
            json!({"resource": "", "holder": "h", "ttl_ms": 5000}),
            "resource",
        ),
        (
            json!({"resource": long, "holder": "h", "ttl_ms": 5000}),
            "resource",
        ),
        (
            json!({"resource": "a\u{7f}", "holder": "h", "ttl_ms": 5000}),
            "resource",
        ),
        (
            json!({"resource": "a", "holder": "h\n", "ttl_ms": 5000}),
            "holder",
        ),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": 5000, "wait_ms": 60_001}),
            "wait_ms",
        ),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": 5000, "extra": 1}),
            "extra",
        ),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": 5000, "metadata": [1]}),
            "metadata",
        ),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": 5000, "metadata": {"x": big_meta}}),
            "metadata",
        ),
        (
            json!({"resource": "a", "holder": "h", "owner": {"pid": 0}}),
            "owner.pid",
        ),
        (
            json!({"resource": "a", "holder": "h", "owner": {"pid": 1, "x": 2}}),
            "owner.x",
        ),
        (
            json!({"resource": "a", "holder": "h", "owner": {"pid": "12"}}),
            "owner.pid",
        ),
        (
            json!({"resource": "a", "holder": "h", "owner": {}}),
            "owner.pid",
        ),
        (
            json!({"resource": "a", "holder": "h", "owner": {"pid": 1, "start_time": 3}}),
            "owner.start_time",
        ),
        (
            json!({"resource": "a", "holder": "h", "owner": "callr"}),
            "owner",
        ),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": 5000, "parent": {"id": "nope", "token": 1}}),
            "parent.id",
        ),
        (
            json!({"resource": "a", "holder": "h", "ttl_ms": 5000, "parent": {"id": "0193a6c5-6a4c-7d6e-8f00-000000000000"}}),
            "parent.token",
        ),
    ];
    for (body, field) in cases {
        let r = s.acquire(body.clone()).await;
        assert_eq!(
            r.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{body}: {}",
            r.body
        );
        assert_eq!(r.code(), "validation", "{body}");
        assert_eq!(r.body["field"], field, "{body}: {}", r.body);
        let detail = r.body["detail"].as_str().unwrap_or_default();
        assert!(!detail.contains("enum"), "no Rust in the answer: {detail}");
    }
    let lease = s.acquire_ok("a", "h").await;
    let id = lease["id"].as_str().expect("id");
    for (op, body, field) in [
        ("renew", json!({}), "token"),
        ("renew", json!({"token": 0}), "token"),
        ("renew", json!({"token": 1, "ttl_ms": 10}), "ttl_ms"),
        ("release", json!({"token": "1"}), "token"),
        ("break", json!({"reason": ""}), "reason"),
        (
            "activate",
            json!({"token": 1, "owner": {"pid": -4}}),
            "owner.pid",
        ),
    ] {
        let r = s.lease_op(id, op, body.clone()).await;
        assert_eq!(
            r.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{op} {body}: {}",
            r.body
        );
        assert_eq!(r.body["field"], field, "{op} {body}");
    }
    assert_eq!(
        s.lease(id).await["state"],
        "active",
        "nothing was changed by refused requests"
    );
}

stores!(unknown_ids_and_paths_are_404);
async fn unknown_ids_and_paths_are_404() {
    let s = Server::start().await;
    for path in [
        "/v1/leases/0193a6c5-6a4c-7d6e-8f00-000000000000",
        "/v1/leases/not-a-uuid",
        "/v1/nothing",
    ] {
        let r = s.get(path).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(r.code(), "not_found");
    }
    let r = s
        .lease_op(
            "0193a6c5-6a4c-7d6e-8f00-000000000000",
            "release",
            json!({"token": 1}),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.code(), "not_found");
}

stores!(duplicate_members_and_deep_nesting_are_refused);
async fn duplicate_members_and_deep_nesting_are_refused() {
    let s = Server::start().await;
    let dup = br#"{"resource":"a","holder":"h","ttl_ms":5000,"resource":"b"}"#.to_vec();
    let r = s
        .post_raw("/v1/leases", Some("application/json"), dup)
        .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::UNPROCESSABLE_ENTITY, "validation")
    );
    assert_eq!(r.body["field"], "resource");
    let nested = format!(
        r#"{{"resource":"a","holder":"h","ttl_ms":5000,"metadata":{{"x":{}1{}}}}}"#,
        "[".repeat(300),
        "]".repeat(300)
    );
    let r = s
        .post_raw("/v1/leases", Some("application/json"), nested.into_bytes())
        .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "malformed_json")
    );
    let huge = br#"{"resource":"a","holder":"h","ttl_ms":123456789012345678901234567890}"#.to_vec();
    let r = s
        .post_raw("/v1/leases", Some("application/json"), huge)
        .await;
    assert_eq!(r.status.as_u16() / 100, 4, "{}", r.body);
    assert_eq!(s.get("/v1/leases?state=all").await.body["items"], json!([]));
}

stores!(a_declared_length_over_the_limit_is_413_without_waiting_for_the_body);
async fn a_declared_length_over_the_limit_is_413_without_waiting_for_the_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Server::start().await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    let mut conn = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    // The head promises 64 KiB + 1 and no body follows: the answer must not
    // wait for it (the client keeps the connection open throughout).
    let head = format!(
        "POST /v1/leases HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        64 * 1024 + 1
    );
    conn.write_all(head.as_bytes()).await.expect("write head");
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), conn.read(&mut answer))
        .await
        .expect("an answer without the body")
        .expect("read");
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("payload_too_large"), "{text}");
}

/// A client that trickles its head byte by byte is cut off at the head's
/// deadline (10 s), not kept as long as each byte comes in time.
#[tokio::test]
async fn a_head_trickled_byte_by_byte_is_cut_off_at_its_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Server::start().await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    let conn = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let started = std::time::Instant::now();
    let (mut read, mut write) = conn.into_split();
    let trickle = tokio::spawn(async move {
        let head = format!(
            "GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: {}",
            "a".repeat(200)
        );
        for b in head.bytes() {
            if write.write_all(&[b]).await.is_err() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    });
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(std::time::Duration::from_secs(20), read.read(&mut buf))
        .await
        .expect("cut off within 20 s")
        .unwrap_or(0);
    let after = started.elapsed();
    trickle.abort();
    assert_eq!(n, 0, "no answer, the connection is closed");
    assert!(
        (9..15).contains(&after.as_secs()),
        "cut off after {after:?}, at the 10 s deadline"
    );
}

stores!(oversized_heads_are_431);
async fn oversized_heads_are_431() {
    let s = Server::start().await;
    let res = s
        .client
        .get(s.url("/v1/leases"))
        .header("x-pad", "p".repeat(20_000))
        .send()
        .await
        .expect("send");
    assert_eq!(res.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    let body: serde_json::Value = res.json().await.expect("json");
    assert_eq!(body["code"], "headers_too_large");
    let ok = s
        .client
        .get(s.url("/v1/leases"))
        .header("x-pad", "p".repeat(8_000))
        .send()
        .await
        .expect("send");
    assert_eq!(ok.status(), StatusCode::OK);
}

stores!(past_the_connection_cap_the_answer_is_503_busy_not_a_hang);
async fn past_the_connection_cap_the_answer_is_503_busy_not_a_hang() {
    holdfast::server::raise_fd_limit();
    let s = Server::start_with(&["--max-connections", "1024"]).await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    // 1024 idle connections, the least the flag accepts, take every place.
    let held = connect_many(&addr, 1024).await;
    let answer = one_more_answer(&addr).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer.contains("\"code\":\"busy\"")
            && answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    drop(held);
}

/// Under an open-file limit too low for `--max-connections`, the cap is
/// lowered to fit (and a warning says so): the connection past it is
/// answered `503 busy`, not left hanging while `accept` fails with EMFILE.
#[tokio::test]
async fn an_open_file_limit_under_the_cap_lowers_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // 400 files, 256 kept for pidfds and logs, 13 for the store's pool
    // (10 and 3 more): 131 connections.
    let s = Server::start_under(&["prlimit", "--nofile=400:400", "setsid"], tmp.path(), &[]).await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    let held = connect_many(&addr, 131).await;
    let answer = one_more_answer(&addr).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    drop(held);
    assert!(
        s.logged("the open-file limit leaves room for fewer connections"),
        "no warning"
    );
}

/// What one more connection to `addr` is answered to a `GET /healthz`.
async fn one_more_answer(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut one_more = tokio::net::TcpStream::connect(addr).await.expect("connect");
    one_more
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .expect("write");
    let mut answer = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        one_more.read_to_string(&mut answer),
    )
    .await
    .expect("answered at once, not left hanging")
    .expect("read");
    answer
}

/// `n` TCP connections to `addr`, all open at once, none of them sending.
async fn connect_many(addr: &str, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
    }
    conns
}

#[test]
fn max_connections_below_1024_is_refused_at_start() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let serve = |flag: &[&str], env: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_holdfast"));
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(tmp.path())
            .args(flag)
            .env_remove("HOLDFAST_MAX_CONNECTIONS");
        if let Some(v) = env {
            cmd.env("HOLDFAST_MAX_CONNECTIONS", v);
        }
        cmd.output().expect("run holdfast")
    };
    for out in [
        serve(&["--max-connections", "10"], None),
        serve(&[], Some("10")),
    ] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("invalid value '10' for '--max-connections <MAX_CONNECTIONS>'")
                && stderr.contains("10 is not in 1024..=1000000"),
            "{stderr}"
        );
    }
}

stores!(more_than_1024_connections_are_served_at_once);
async fn more_than_1024_connections_are_served_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    holdfast::server::raise_fd_limit();
    let s = Server::start().await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    let conns = connect_many(&addr, 1100).await;
    // Every one of them, all open at once, gets an answer.
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|mut c| {
            tokio::spawn(async move {
                c.write_all(
                    b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
                )
                .await
                .expect("write");
                let mut answer = String::new();
                c.read_to_string(&mut answer).await.expect("read");
                answer.starts_with("HTTP/1.1 200")
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        ok += usize::from(t.await.expect("task"));
    }
    assert_eq!(ok, 1100);
}

stores!(numbers_and_text_are_read_as_the_document_describes_them);
async fn numbers_and_text_are_read_as_the_document_describes_them() {
    let s = Server::start().await;
    // JSON Schema counts 30000.0 as an integer, and so do generated clients.
    let r = s
        .acquire(json!({"resource": "num/a", "holder": "h", "ttl_ms": 30000.0}))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["ttl_ms"], 30000);
    let id = r.body["id"].as_str().expect("id").to_owned();
    let r = s.lease_op(&id, "renew", json!({"token": 1.5})).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::UNPROCESSABLE_ENTITY, "validation")
    );
    assert_eq!(r.body["field"], "token");
    let r = s.lease_op(&id, "renew", json!({"token": 1.0})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    // C1 controls are control characters too (the document's pattern says so).
    let r = s
        .acquire(json!({"resource": "num/\u{9d}", "holder": "h", "ttl_ms": 30000}))
        .await;
    assert_eq!(
        (r.status, r.body["field"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("resource"))
    );
    // A port range names its lowest bound first; one port is a range too.
    let reserve = async |range: [u16; 2]| {
        s.post(
            "/v1/ports",
            json!({"names": ["http"], "owner": {"lease": {"id": id, "token": 1}}, "range": range}),
        )
        .await
    };
    let r = reserve([31010, 31000]).await;
    assert_eq!(
        (r.status, r.code(), r.body["field"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation",
            Some("range")
        ),
        "{}",
        r.body
    );
    let r = reserve([31000, 31000]).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["ports"]["http"], 31000);
}

stores!(the_largest_cursor_reads_nothing_rather_than_failing);
async fn the_largest_cursor_reads_nothing_rather_than_failing() {
    let s = Server::start().await;
    s.acquire_ok("cursor/a", "h").await;
    let r = s
        .get(&format!("/v1/events?after={}&limit=1&wait_ms=0", i64::MAX))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["items"], json!([]));
}

stores!(log_reads_far_past_the_end_and_repeated_parameters_are_answered_plainly);
async fn log_reads_far_past_the_end_and_repeated_parameters_are_answered_plainly() {
    let s = Server::start().await;
    let p = s
        .spawn(json!({"kind": "job", "command": {"argv": ["sh", "-c", "echo hi"]}}))
        .await;
    let id = p["id"].as_str().expect("id").to_owned();
    // 16 TiB and more: past any log, and past what ext4 lets one seek to.
    for offset in [1u64 << 44, (1u64 << 62) + 7] {
        let r = s
            .client
            .get(s.url(&format!("/v1/processes/{id}/logs?offset={offset}")))
            .send()
            .await
            .expect("GET logs");
        assert_eq!(r.status(), StatusCode::OK, "offset {offset}");
        assert_eq!(r.headers()["x-next-offset"], offset.to_string().as_str());
        assert!(r.bytes().await.expect("body").is_empty());
    }
    let r = s
        .get(&format!(
            "/v1/processes/{id}/logs?stream=stdout&stream=stderr"
        ))
        .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::UNPROCESSABLE_ENTITY, "validation")
    );
    assert_eq!(r.body["field"], "stream");
    let stop = s
        .process_op(&id, "stop", json!({"token": p["token"]}))
        .await;
    assert_eq!(stop.status, StatusCode::OK);
}

stores!(a_list_filtered_by_an_id_that_is_none_is_422_and_any_spelling_of_one_matches);
async fn a_list_filtered_by_an_id_that_is_none_is_422_and_any_spelling_of_one_matches() {
    let s = Server::start().await;
    let parent = s.acquire_ok("filter/parent", "h").await;
    let child = s
        .acquire(
            json!({"resource": "filter/child", "holder": "h", "ttl_ms": 30000,
                        "parent": {"id": parent["id"], "token": 1}}),
        )
        .await;
    assert_eq!(child.status, StatusCode::CREATED, "{}", child.body);
    for (path, field) in [
        ("/v1/leases?parent=notauuid", "parent"),
        ("/v1/processes?lease=notauuid", "lease"),
        ("/v1/leases?cursor=notauuid", "cursor"),
    ] {
        let r = s.get(path).await;
        assert_eq!(
            (r.status, r.body["field"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some(field)),
            "{path}: {}",
            r.body
        );
    }
    let upper = parent["id"].as_str().expect("id").to_uppercase();
    let r = s.get(&format!("/v1/leases?parent={upper}")).await;
    assert_eq!(r.body["items"][0]["id"], child.body["id"], "{}", r.body);
}

stores!(an_element_of_an_array_is_named_by_its_index_dotted_whatever_is_wrong_with_it);
async fn an_element_of_an_array_is_named_by_its_index_dotted_whatever_is_wrong_with_it() {
    let s = Server::start().await;
    let lease = s.acquire_ok("dotted", "h").await;
    let owner = json!({"lease": {"id": lease["id"], "token": 1}});
    for (path, body, field) in [
        (
            "/v1/processes",
            json!({"kind": "k", "command": {"argv": [1]}}),
            "command.argv.0",
        ),
        (
            "/v1/processes",
            json!({"kind": "k", "command": {"argv": [""]}}),
            "command.argv.0",
        ),
        (
            "/v1/processes",
            json!({"kind": "k", "ports": ["a", 5]}),
            "ports.1",
        ),
        (
            "/v1/processes",
            json!({"kind": "k", "ports": ["a", "B"]}),
            "ports.1",
        ),
        (
            "/v1/ports",
            json!({"names": ["a", 5], "owner": owner}),
            "names.1",
        ),
        (
            "/v1/ports",
            json!({"names": ["a"], "owner": owner, "range": [2000, "x"]}),
            "range.1",
        ),
    ] {
        let r = s.post(path, body.clone()).await;
        assert_eq!(
            (r.status, r.body["field"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some(field)),
            "{body}: {}",
            r.body
        );
    }
}
