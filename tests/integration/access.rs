//! Who may do what: tokens, the Unix socket's peer credentials, uid rules,
//! and the Host / Origin checks on a loopback listener.

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::{Proc, Server, curl_as, token_files, unix_request};

stores!(tokens_guard_v1_and_metrics_and_only_admin_may_break);
async fn tokens_guard_v1_and_metrics_and_only_admin_may_break() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (auth, admin) = token_files(tmp.path());
    let (auth, admin) = (auth.display().to_string(), admin.display().to_string());
    let s = Server::start_with(&["--auth-token-file", &auth, "--admin-token-file", &admin]).await;
    let url = s.url("/v1/leases");
    let body = json!({"resource": "secure", "holder": "h", "ttl_ms": 5000});

    for token in [
        None,
        Some("wrong"),
        Some("user-secre"),
        Some("admin-secret-x"),
    ] {
        let mut req = s.client.post(&url).json(&body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let res = req.send().await.expect("send");
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{token:?}");
        assert_eq!(res.headers()["www-authenticate"], "Bearer");
        let problem: serde_json::Value = res.json().await.expect("json");
        assert_eq!(problem["code"], "unauthorized");
    }
    // Checked before the body is parsed: garbage still gets 401.
    let res = s
        .client
        .post(&url)
        .body("{not json")
        .send()
        .await
        .expect("send");
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        s.client
            .get(s.url("/metrics"))
            .send()
            .await
            .expect("send")
            .status(),
        StatusCode::UNAUTHORIZED
    );
    for open in ["/healthz", "/readyz", "/openapi.json"] {
        assert_eq!(
            s.client
                .get(s.url(open))
                .send()
                .await
                .expect("send")
                .status(),
            StatusCode::OK,
            "{open}"
        );
    }

    let res = s
        .client
        .post(&url)
        .bearer_auth("user-secret")
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(res.status(), StatusCode::CREATED);
    let lease: serde_json::Value = res.json().await.expect("json");
    let brk = s.url(&format!(
        "/v1/leases/{}/break",
        lease["id"].as_str().expect("id")
    ));
    // Whatever the body: a caller who may not break learns that first.
    for body in [json!({"reason": "x"}), json!({}), json!({"reason": 7})] {
        let res = s
            .client
            .post(&brk)
            .bearer_auth("user-secret")
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(
            res.status(),
            StatusCode::FORBIDDEN,
            "an ordinary token cannot break, with {body}"
        );
    }
    let res = s
        .client
        .post(&brk)
        .bearer_auth("admin-secret")
        .json(&json!({"reason": "x"}))
        .send()
        .await
        .expect("send");
    assert_eq!(
        res.status(),
        StatusCode::OK,
        "the admin token works wherever the ordinary one does, and breaks"
    );
    let res = s
        .client
        .get(s.url("/metrics"))
        .bearer_auth("user-secret")
        .send()
        .await
        .expect("send");
    assert_eq!(res.status(), StatusCode::OK);
}

stores!(a_non_loopback_listener_without_a_token_refuses_to_start);
async fn a_non_loopback_listener_without_a_token_refuses_to_start() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
        .args(["serve", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(tmp.path())
        .env_remove("HOLDFAST_AUTH_TOKEN")
        .env_remove("HOLDFAST_ADMIN_TOKEN")
        .output()
        .await
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--auth-token-file"),
        "names the missing token: {stderr}"
    );
}

stores!(foreign_host_and_origin_are_refused_on_loopback);
async fn foreign_host_and_origin_are_refused_on_loopback() {
    let s = Server::start().await;
    for (name, value) in [
        ("host", "evil.example"),
        ("host", "evil.example:7427"),
        ("origin", "https://evil.example"),
    ] {
        let res = s
            .client
            .get(s.url("/healthz"))
            .header(name, value)
            .send()
            .await
            .expect("send");
        assert_eq!(res.status(), StatusCode::FORBIDDEN, "{name}: {value}");
        let problem: serde_json::Value = res.json().await.expect("json");
        assert_eq!(problem["code"], "forbidden");
    }
    let ok = s
        .client
        .get(s.url("/healthz"))
        .header("origin", "http://localhost:3000")
        .send()
        .await
        .expect("send");
    assert_eq!(ok.status(), StatusCode::OK);
    // Requests no browser sends, which must not slip past the check.
    let addr = s.base.trim_start_matches("http://").to_owned();
    for head in [
        "GET /healthz HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n",
        "GET http://evil.example/healthz HTTP/1.1\r\nHost: localhost\r\n",
        "GET /healthz HTTP/1.1\r\nHost: localhost\r\nOrigin: http://localhost\r\nOrigin: http://evil.example\r\n",
    ] {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut conn = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        let request = format!("{head}Connection: close\r\n\r\n");
        conn.write_all(request.as_bytes()).await.expect("write");
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.expect("read");
        assert!(answer.starts_with("HTTP/1.1 403"), "{head:?}: {answer}");
    }
}

stores!(over_the_unix_socket_caller_owns_and_uids_are_enforced);
async fn over_the_unix_socket_caller_owns_and_uids_are_enforced() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let sock = tmp.path().join("holdfast.sock");
    let sock_arg = sock.display().to_string();
    let s = Server::start_with(&["--unix-socket", &sock_arg, "--unix-socket-mode", "0666"]).await;
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&sock).expect("socket").permissions(),
    );
    assert_eq!(mode & 0o777, 0o666);

    let r = unix_request(
        &sock,
        "POST",
        "/v1/leases",
        Some(json!({"resource": "mine", "holder": "me", "owner": "caller"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(
        r.body["owner"]["pid"],
        i64::from(std::process::id()),
        "the kernel's word about the caller"
    );
    assert_eq!(r.body["owner_status"], "live");
    let tcp = s
        .acquire(json!({"resource": "x", "holder": "me", "owner": "caller"}))
        .await;
    assert_eq!(
        tcp.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "\"caller\" needs the socket"
    );

    if !rustix_is_root() {
        eprintln!(
            "SKIPPED uid rules over the unix socket: needs root to run a client as another user"
        );
        return;
    }
    // A process of root, registered and confirmed over TCP.
    let root_proc = Proc::sleep();
    let reg = s.post("/v1/processes", json!({"kind": "root-owned"})).await;
    let rid = reg.body["id"].as_str().expect("id").to_owned();
    let conf = s
        .process_op(&rid, "confirm", json!({"token": 1, "pid": root_proc.pid()}))
        .await;
    assert_eq!(conf.status, StatusCode::OK, "{}", conf.body);

    let (code, body) = curl_as(
        "nobody",
        &sock,
        "POST",
        &format!("/v1/processes/{rid}/stop"),
        json!({"token": 1}),
    )
    .await;
    assert_eq!(code, 403, "{body}");
    assert_eq!(body["code"], "forbidden");
    assert!(
        crate::support::alive(root_proc.pid()),
        "nothing was signalled"
    );

    let (code, body) = curl_as(
        "nobody",
        &sock,
        "POST",
        "/v1/processes",
        json!({"kind": "mine", "command": {"argv": ["sleep", "600"]}}),
    )
    .await;
    assert_eq!(code, 201, "{body}");
    assert_eq!(
        body["identity"]["uid"], 65534,
        "a child spawned for nobody runs as nobody"
    );
    let status = std::fs::read_to_string(format!("/proc/{}/status", body["pid"])).expect("status");
    let nnp = status
        .lines()
        .find(|l| l.starts_with("NoNewPrivs:"))
        .expect("NoNewPrivs");
    assert!(nnp.ends_with('1'), "{nnp}");
    let pid_ = body["id"].as_str().expect("id").to_owned();
    let (code, body) = curl_as(
        "nobody",
        &sock,
        "POST",
        &format!("/v1/processes/{pid_}/stop"),
        json!({"token": 1}),
    )
    .await;
    assert_eq!(
        (code, body["state"].as_str()),
        (200, Some("stopped")),
        "{body}"
    );

    let (code, body) = curl_as(
        "nobody",
        &sock,
        "POST",
        &format!("/v1/leases/{}/break", r.body["id"].as_str().expect("id")),
        json!({"reason": "x"}),
    )
    .await;
    assert_eq!(code, 403, "only root or the admin may break: {body}");
}

fn rustix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

stores!(a_keyed_spawn_its_caller_cannot_execute_keeps_its_answer_with_its_end);
/// A spawn that fails after its record was made (the program runs for
/// root, not for the caller it would run as) keeps its `422` with the
/// commit that ends the record: one durable commit, and the retry is given
/// that answer rather than making a second record.
async fn a_keyed_spawn_its_caller_cannot_execute_keeps_its_answer_with_its_end() {
    if !rustix_is_root() {
        eprintln!("SKIPPED: needs root to run a client as another user");
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let sock = tmp.path().join("holdfast.sock");
    let sock_arg = sock.display().to_string();
    let s = Server::start_with(&[
        "--unix-socket",
        &sock_arg,
        "--unix-socket-mode",
        "0666",
        "--reconcile-interval-ms",
        "3600000",
    ])
    .await;
    let program = tmp.path().join("root-only");
    std::fs::copy("/bin/true", &program).expect("copy");
    std::fs::set_permissions(
        &program,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .expect("chmod");
    let body = json!({"kind": "root-only", "command": {"argv": [program]}});
    let before = s.durable_transactions().await;
    let post = || {
        crate::support::curl_as_with(
            "nobody",
            &sock,
            "POST",
            "/v1/processes",
            body.clone(),
            &["idempotency-key: cx-1"],
        )
    };
    let (code, first) = post().await;
    assert_eq!(code, 422, "{first}");
    assert_eq!(first["field"], "command.argv", "{first}");
    assert_eq!(
        s.durable_transactions().await - before,
        1,
        "the record's end with the answer"
    );
    let (code, again) = post().await;
    assert_eq!((code, &again), (422, &first));
    let listed = s.get("/v1/processes?state=all&kind=root-only").await;
    let items = listed.body["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(items.len(), 1, "{}", listed.body);
    assert_eq!(items[0]["state"], "failed", "{}", listed.body);
}
