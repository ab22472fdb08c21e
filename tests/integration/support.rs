//! A real holdfast server per test: the built binary, an ephemeral port, its
//! own data directory, and one helper per endpoint.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub struct Server {
    pub(crate) child: Child,
    pub base: String,
    pub client: reqwest::Client,
    _tmp: Option<tempfile::TempDir>,
    /// Its data directory: whatever holds a log file there is its child.
    dir: std::path::PathBuf,
    /// Killed with SIGKILL: its children stay, for the next server on `dir`.
    crashed: bool,
    /// The last lines of its log, shown when a test fails.
    log: Log,
}

/// The tail of a server's log.
type Log = std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<String>>>;
const LOG_TAIL: usize = 60;

/// An error with its causes, as `error sending request` alone does not say
/// whether the server refused, reset or was gone.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

pub struct Reply {
    pub status: StatusCode,
    pub body: Value,
    pub headers: reqwest::header::HeaderMap,
}

impl Reply {
    pub fn code(&self) -> &str {
        self.body["code"].as_str().unwrap_or("")
    }
}

impl Server {
    /// A server with a fresh data directory and a fast reconciler.
    pub async fn start() -> Self {
        Self::start_with(&["--reconcile-interval-ms", "100"]).await
    }

    pub async fn start_with(args: &[&str]) -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().to_path_buf();
        let mut s = Self::start_in(&dir, args).await;
        s._tmp = Some(tmp);
        s
    }

    /// A server on `dir`, which outlives it (for restarts).
    pub async fn start_in(dir: &Path, args: &[&str]) -> Self {
        // In a session of its own, as a daemon would be: the processes the
        // tests start are then not in the server's session, which it refuses to signal.
        Self::start_under(&["setsid"], dir, args).await
    }

    /// A server started by the command `launcher` (a program and its
    /// arguments, followed by the server's own command line).
    pub async fn start_under(launcher: &[&str], dir: &Path, args: &[&str]) -> Self {
        let database = crate::stores::database_args(dir).await;
        let mut child = Command::new(launcher[0])
            .args(&launcher[1..])
            .arg(env!("CARGO_BIN_EXE_holdfast"))
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir)
            .args(database)
            .args(args)
            .env("HOLDFAST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn holdfast");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = tokio::sync::oneshot::channel();
        let log = Log::default();
        // Read the log until the listening line, then keep draining it so the
        // server never blocks on a full pipe.
        tokio::spawn({
            let log = log.clone();
            async move {
                let mut lines = BufReader::new(stderr).lines();
                let mut tx = Some(tx);
                while let Ok(Some(line)) = lines.next_line().await {
                    if let Some(addr) = line.split("holdfast listening addr=").nth(1)
                        && let Some(tx) = tx.take()
                    {
                        let _ = tx.send(addr.trim().to_owned());
                    }
                    if std::env::var_os("HOLDFAST_TEST_LOG").is_some() {
                        eprintln!("server: {line}");
                    }
                    let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
                    if log.len() == LOG_TAIL {
                        log.pop_front();
                    }
                    log.push_back(line);
                }
            }
        });
        let addr = tokio::time::timeout(Duration::from_secs(30), rx)
            .await
            .expect("server did not start listening within 30 s")
            .expect("server exited before listening");
        Self {
            child,
            base: format!("http://{addr}"),
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(128)
                .build()
                .expect("client"),
            _tmp: None,
            dir: dir.to_path_buf(),
            crashed: false,
            log,
        }
    }

    /// SIGKILL the server and reap it: no chance to flush or clean up.
    pub async fn kill9(mut self) -> Option<tempfile::TempDir> {
        self.child.start_kill().expect("kill");
        self.child.wait().await.expect("reap");
        self.crashed = true;
        self._tmp.take()
    }

    /// SIGTERM the server, as a service manager stops it, and wait for it
    /// to exit: its status.
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().expect("running");
        std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill");
        self.child.wait().await.expect("reap")
    }

    /// Whether a line of the server's log so far (its last lines) says `text`.
    pub fn logged(&self, text: &str) -> bool {
        self.lines_saying(text) > 0
    }

    /// How many of the server's last lines of log say `text`.
    pub fn lines_saying(&self, text: &str) -> usize {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.iter().filter(|line| line.contains(text)).count()
    }

    /// Its data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn reply(res: reqwest::Response) -> Reply {
        let status = res.status();
        let headers = res.headers().clone();
        let text = res.text().await.expect("body");
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Reply {
            status,
            body,
            headers,
        }
    }

    pub async fn get(&self, path: &str) -> Reply {
        Self::reply(self.client.get(self.url(path)).send().await.expect("GET")).await
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        Self::reply(
            self.client
                .post(self.url(path))
                .json(&body)
                .send()
                .await
                .expect("POST"),
        )
        .await
    }

    /// POST `body` with an `Idempotency-Key`.
    pub async fn post_keyed(&self, path: &str, key: &str, body: Value) -> Reply {
        let req = self
            .client
            .post(self.url(path))
            .header("idempotency-key", key)
            .json(&body);
        Self::reply(req.send().await.expect("POST")).await
    }

    pub async fn post_raw(&self, path: &str, content_type: Option<&str>, body: Vec<u8>) -> Reply {
        let mut req = self.client.post(self.url(path)).body(body);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        Self::reply(req.send().await.expect("POST")).await
    }

    pub async fn acquire(&self, body: Value) -> Reply {
        self.post("/v1/leases", body).await
    }

    /// Acquire `resource` with a TTL and expect success.
    pub async fn acquire_ok(&self, resource: &str, holder: &str) -> Value {
        let r = self
            .acquire(json!({"resource": resource, "holder": holder, "ttl_ms": 60_000}))
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        r.body
    }

    pub async fn lease(&self, id: &str) -> Value {
        let r = self.get(&format!("/v1/leases/{id}")).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        r.body
    }

    pub async fn lease_op(&self, id: &str, op: &str, body: Value) -> Reply {
        self.post(&format!("/v1/leases/{id}/{op}"), body).await
    }

    /// Every event from the start, paging through.
    pub async fn all_events(&self) -> Vec<Value> {
        let mut out: Vec<Value> = Vec::new();
        loop {
            let after = out.last().map_or(0, |e| e["seq"].as_i64().expect("seq"));
            let r = self
                .get(&format!("/v1/events?after={after}&limit=1000"))
                .await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.body);
            let items = r.body["items"].as_array().expect("items").clone();
            if items.is_empty() {
                return out;
            }
            out.extend(items);
        }
    }

    /// Poll GET `path` until `pred` holds: for state that changes with the
    /// passage of time (TTL expiry), which no event announces to a client.
    pub async fn eventually(
        &self,
        path: &str,
        within: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let r = self.get(path).await;
            if pred(&r.body) {
                return r.body;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "condition not met within {within:?}: {}",
                r.body
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Until the server counts `n` waiting acquirers.
    pub async fn queued(&self, n: usize) {
        self.metric_reads(&format!("holdfast_lease_waiters {n}"))
            .await;
    }

    /// Wait until `/metrics` has the line `line`.
    pub async fn metric_reads(&self, line: &str) {
        self.eventually("/metrics", Duration::from_secs(10), |m| {
            m.as_str().is_some_and(|t| t.lines().any(|l| l == line))
        })
        .await;
    }

    /// POST the acquire `body` from a task of its own, with `key` as its
    /// Idempotency-Key if given: its status and body.
    pub fn acquire_in_background(
        &self,
        key: Option<&str>,
        body: &Value,
    ) -> tokio::task::JoinHandle<(StatusCode, Value)> {
        let mut req = self.client.post(self.url("/v1/leases")).json(body);
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        tokio::spawn(async move {
            let r = req.send().await.expect("send");
            (r.status(), r.json().await.expect("json"))
        })
    }

    /// Wait until the reconciler has made `n` more passes: to show that
    /// something it would do was not done.
    pub async fn reconciler_passes(&self, n: u64) {
        let passes = |m: &Value| metric(m, "holdfast_reconciler_passes_total").unwrap_or(0);
        let start = passes(&self.get("/metrics").await.body);
        self.eventually("/metrics", Duration::from_secs(10), |m| {
            passes(m) >= start + n
        })
        .await;
    }
}

/// The value of the sample `series` (its name, with labels if it has any,
/// as the exposition writes it) in a `/metrics` body.
pub fn metric(m: &Value, series: &str) -> Option<u64> {
    let line = m
        .as_str()?
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))?;
    line.trim().parse().ok()
}

impl Drop for Server {
    fn drop(&mut self) {
        // A failing test shows how its server fared: whether it still ran,
        // and the end of its log.
        if std::thread::panicking() && !self.crashed {
            let state = match self.child.try_wait() {
                Ok(None) => "running".to_owned(),
                Ok(Some(status)) => format!("exited: {status}"),
                Err(e) => format!("unknown: {e}"),
            };
            let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
            let tail: Vec<&str> = log.iter().map(String::as_str).collect();
            eprintln!(
                "server {} ({state}), its last {} log lines:\n{}",
                self.base,
                tail.len(),
                tail.join("\n")
            );
        }
        // A test that ends, or fails, leaves none of the processes its
        // server spawned behind (a crashed server's are the next one's).
        if !self.crashed {
            let logs = self.dir.join("logs");
            let logs = logs.canonicalize().unwrap_or(logs);
            for pid in holders_under(&logs) {
                crate::kill::kill_if(pid, |pid| holds_under(pid, &logs));
            }
        }
        if let Some(tmp) = &self._tmp {
            crate::stores::drop_database_of(tmp.path());
        }
    }
}

/// Pids of processes holding a log file in `dir` open.
pub fn holders_under(dir: &Path) -> Vec<i32> {
    let Ok(dir) = dir.canonicalize() else {
        return Vec::new();
    };
    crate::kill::pids()
        .into_iter()
        .filter(|pid| holds_under(*pid, &dir))
        .collect()
}

/// Whether process `pid` holds a log file (`.out`, `.err`, deleted or not)
/// in `dir` (a canonical path) open: the server's own lock there is none.
pub fn holds_under(pid: i32, dir: &Path) -> bool {
    let is_log = |target: PathBuf| {
        let target = target.to_string_lossy().into_owned();
        let target = target.strip_suffix(" (deleted)").unwrap_or(&target);
        Path::new(target).starts_with(dir) && (target.ends_with(".out") || target.ends_with(".err"))
    };
    std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
        fds.flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(is_log))
    })
}

/// A real child process to own leases: `sleep`, in its own process group.
pub struct Proc {
    pub child: Child,
}

impl Proc {
    pub fn sleep() -> Self {
        let child = Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn sleep");
        Self { child }
    }

    pub fn pid(&self) -> i64 {
        i64::from(self.child.id().expect("running"))
    }

    /// SIGKILL and reap it, so its pid is really gone.
    pub async fn kill_and_reap(&mut self) {
        self.child.start_kill().expect("kill");
        self.child.wait().await.expect("reap");
    }
}

/// The set of top-level members every lease shows, null or not.
pub const LEASE_MEMBERS: &[&str] = &[
    "id",
    "resource",
    "token",
    "holder",
    "state",
    "owner",
    "owner_status",
    "owner_status_reason",
    "parent",
    "ttl_ms",
    "expires_at",
    "stale",
    "acquired_at",
    "renewed_at",
    "ended_at",
    "end_reason",
    "metadata",
];

pub fn assert_lease_shape(lease: &Value) {
    let obj = lease.as_object().expect("lease object");
    for m in LEASE_MEMBERS {
        assert!(obj.contains_key(*m), "lease lacks {m}: {lease}");
    }
}

impl Server {
    /// Durable write transactions the server has run so far.
    pub async fn durable_transactions(&self) -> u64 {
        let m = self.get("/metrics").await.body;
        metric(&m, r#"holdfast_store_transactions_total{sync="full"}"#).unwrap_or_else(|| {
            panic!(
                "no durable transaction counter in:\n{}",
                m.as_str().unwrap_or_default()
            )
        })
    }

    /// Create a process record (spawn or register) and expect `201`.
    pub async fn spawn(&self, body: Value) -> Value {
        let r = self.post("/v1/processes", body).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        r.body
    }

    pub async fn process(&self, id: &str) -> Value {
        let r = self.get(&format!("/v1/processes/{id}")).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        r.body
    }

    pub async fn process_op(&self, id: &str, op: &str, body: Value) -> Reply {
        self.post(&format!("/v1/processes/{id}/{op}"), body).await
    }

    /// Raw log bytes and the next offset.
    pub async fn logs(&self, id: &str, query: &str) -> (StatusCode, String, Option<u64>) {
        let res = self
            .client
            .get(self.url(&format!("/v1/processes/{id}/logs?{query}")))
            .send()
            .await
            .expect("logs");
        let status = res.status();
        let next = res
            .headers()
            .get("x-next-offset")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        (status, res.text().await.expect("text"), next)
    }
}

fn stat(pid: i64) -> Option<crate::kill::Stat> {
    crate::kill::stat(i32::try_from(pid).ok()?)
}

/// `pid`'s start time (`/proc/<pid>/stat` field 22), as identities show it.
pub fn start_time(pid: i64) -> String {
    stat(pid).expect("stat").start.to_string()
}

/// Whether `pid` is a running (not zombie) process right now. Only for a
/// process that must be alive: once it may have ended, its pid may be
/// another's, which [`Seen`] tells apart.
pub fn alive(pid: i64) -> bool {
    stat(pid).is_some_and(|s| !s.zombie)
}

/// A process known by its pid and its start time. Pids come round within
/// seconds here (tests beside this one steer them through `ns_last_pid`):
/// after it ends, its bare pid may name a stranger that runs on.
#[derive(Debug, Clone)]
pub struct Seen {
    pid: i64,
    start: Option<u64>,
}

impl Seen {
    /// `pid` as it is now; a pid with no process runs nothing later either.
    pub fn now(pid: i64) -> Self {
        Self {
            pid,
            start: stat(pid).map(|s| s.start),
        }
    }

    /// A process record's process, as the server recorded it.
    pub fn recorded(p: &Value) -> Self {
        let start = p["identity"]["start_time"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no start time: {p}"));
        Self {
            pid: p["pid"].as_i64().unwrap_or_else(|| panic!("no pid: {p}")),
            start: Some(start),
        }
    }

    /// Whether this process, not a later one with its pid, runs (is not a zombie).
    pub fn runs(&self) -> bool {
        self.stat().is_some_and(|s| !s.zombie)
    }

    /// Whether this process is there still, as a zombie perhaps: not reaped.
    pub fn present(&self) -> bool {
        self.stat().is_some()
    }

    /// SIGKILL this process if it still runs (through a pidfd opened first).
    pub fn kill(&self) {
        if let Ok(pid) = i32::try_from(self.pid) {
            crate::kill::kill_if(pid, |_| self.runs());
        }
    }

    fn stat(&self) -> Option<crate::kill::Stat> {
        stat(self.pid).filter(|s| Some(s.start) == self.start)
    }
}

/// The pids in process group `pgid`.
pub fn group_members(pgid: i64) -> Vec<i64> {
    crate::kill::pids()
        .into_iter()
        .map(i64::from)
        .filter(|&pid| {
            i32::try_from(pid)
                .ok()
                .and_then(crate::kill::stat)
                .is_some_and(|s| i64::from(s.pgrp) == pgid)
                && alive(pid)
        })
        .collect()
}

/// A shell leading a process group of its own, and the sleep it waits for
/// in that group: the shell's pid and the sleep. The shell dies on SIGTERM;
/// the sleep only when its group is signalled or it is killed.
pub async fn shell_with_a_member() -> (tokio::process::Child, i32, Seen) {
    let leader = tokio::process::Command::new("sh")
        .args(["-c", "sleep 600 & wait"])
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn sh");
    let pid = i32::try_from(leader.id().expect("running")).expect("pid");
    let mut member = None;
    until(Duration::from_secs(10), || {
        member = group_members(i64::from(pid))
            .into_iter()
            .find(|m| *m != i64::from(pid));
        member.is_some()
    })
    .await;
    let member = member.expect("the shell's sleep joined its group");
    (leader, pid, Seen::now(member))
}

/// Wait until `pred` holds, checking every few ms (for kernel state, which
/// sends no event a test could await).
/// Token files in `dir`: the ordinary token `user-secret` and the admin
/// token `admin-secret`.
pub fn token_files(dir: &Path) -> (PathBuf, PathBuf) {
    let (auth, admin) = (dir.join("auth.token"), dir.join("admin.token"));
    std::fs::write(&auth, "user-secret\n").expect("write");
    std::fs::write(&admin, "admin-secret\n").expect("write");
    (auth, admin)
}

pub async fn until(within: Duration, mut pred: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if pred() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    pred()
}

/// The server's pid (the harness starts it through `setsid`, which execs in place).
pub fn server_pid(s: &Server) -> i64 {
    i64::from(s.child.id().expect("server running"))
}

/// One HTTP/1.1 request over a Unix socket, from this test process (so the
/// server sees this process as the peer).
pub async fn unix_request(socket: &Path, method: &str, path: &str, body: Option<Value>) -> Reply {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .expect("connect unix socket");
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    stream.write_all(body.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a response");
    let code: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status");
    let mut headers = reqwest::header::HeaderMap::new();
    for line in head.lines().skip(1) {
        if let Some((k, v)) = line.split_once(':')
            && let (Ok(k), Ok(v)) = (
                reqwest::header::HeaderName::from_bytes(k.trim().as_bytes()),
                v.trim().parse(),
            )
        {
            headers.insert(k, v);
        }
    }
    // Bodies of this server are JSON; chunked framing only wraps them.
    let json = body
        .find('{')
        .and_then(|start| body.rfind('}').map(|end| &body[start..=end]))
        .unwrap_or("");
    Reply {
        status: StatusCode::from_u16(code).expect("status"),
        body: serde_json::from_str(json).unwrap_or(Value::String(body.to_owned())),
        headers,
    }
}

/// `curl` over the Unix socket run as `user` (via runuser), for the uid rules.
pub async fn curl_as(
    user: &str,
    socket: &Path,
    method: &str,
    path: &str,
    body: Value,
) -> (u16, Value) {
    curl_as_with(user, socket, method, path, body, &[]).await
}

/// `curl_as` with more request headers (`name: value`).
pub async fn curl_as_with(
    user: &str,
    socket: &Path,
    method: &str,
    path: &str,
    body: Value,
    headers: &[&str],
) -> (u16, Value) {
    let mut curl = Command::new("runuser");
    curl.args([
        "-u",
        user,
        "--",
        "curl",
        "-s",
        "-o",
        "-",
        "-w",
        "\n%{http_code}",
        "--unix-socket",
    ])
    .arg(socket)
    .args([
        "-X",
        method,
        "-H",
        "content-type: application/json",
        "-d",
        &body.to_string(),
    ]);
    for h in headers {
        curl.args(["-H", h]);
    }
    let out = curl
        .arg(format!("http://localhost{path}"))
        .output()
        .await
        .expect("runuser curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (
        code.trim().parse().unwrap_or(0),
        serde_json::from_str(body).unwrap_or(Value::String(body.to_owned())),
    )
}

/// Run `holdfast serve` with `args`, expecting it to exit: its stderr.
pub async fn fails_to_start(dir: &std::path::Path, args: &[&str]) -> String {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir)
            .args(args)
            .output(),
    )
    .await
    .expect("exits in time")
    .expect("runs");
    assert!(!out.status.success(), "it started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}
