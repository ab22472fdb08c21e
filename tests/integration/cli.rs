//! The command-line client as a user runs it: the real binary against a
//! real server, line by line of `../shared/CLI.md`. On SQLite only: the
//! client speaks HTTP and cannot tell the stores apart.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use rustix::process::{Pid, Signal, kill_process};
use serde_json::{Value, json};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, Command};

use crate::kill::Group;
use crate::support::{Seen, Server, alive, until};

const BIN: &str = env!("CARGO_BIN_EXE_holdfast");
/// How long any one command may take before the test gives up on it.
const LIMIT: Duration = Duration::from_secs(60);

/// `holdfast ARGS`, with no HOLDFAST_* from the test's own environment.
fn holdfast(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    for var in [
        "HOLDFAST_URL",
        "HOLDFAST_SOCKET",
        "HOLDFAST_TOKEN",
        "HOLDFAST_TOKEN_FILE",
        "HOLDFAST_LISTEN",
        "HOLDFAST_UNIX_SOCKET",
    ] {
        cmd.env_remove(var);
    }
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// `holdfast` with the words of `line` against `s`.
fn hf(s: &Server, line: &str) -> Command {
    at(s, &line.split_whitespace().collect::<Vec<_>>())
}

/// `holdfast ARGS` against `s` (through HOLDFAST_URL).
fn at(s: &Server, args: &[&str]) -> Command {
    let mut cmd = holdfast(args);
    cmd.env("HOLDFAST_URL", &s.base);
    cmd
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {}", self.stdout))
    }
}

impl From<Output> for Out {
    fn from(o: Output) -> Self {
        Self {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

async fn finish(child: Child) -> Out {
    tokio::time::timeout(LIMIT, child.wait_with_output())
        .await
        .expect("the command ended in time")
        .expect("wait")
        .into()
}

async fn out(mut cmd: Command) -> Out {
    finish(cmd.spawn().expect("spawn holdfast")).await
}

/// The next line a child writes, within `LIMIT`; None at the end of its output.
async fn next_line<R: AsyncBufRead + Unpin>(lines: &mut Lines<R>) -> Option<String> {
    tokio::time::timeout(LIMIT, lines.next_line())
        .await
        .expect("in time")
        .expect("read")
}

/// Run and expect exit 0.
async fn ok(cmd: Command) -> Out {
    let o = out(cmd).await;
    assert_eq!(o.code, 0, "stdout: {}\nstderr: {}", o.stdout, o.stderr);
    o
}

/// The one line a failure prints: `holdfast: <code>: <detail>`, no panic.
fn assert_error_line(o: &Out, code: &str) {
    let line = o.stderr.trim_end();
    assert!(!line.contains('\n'), "one line: {line}");
    assert!(
        line.starts_with(&format!("holdfast: {code}: ")),
        "expected a {code} line, got: {line}"
    );
    assert!(
        !line.contains("panicked") && !line.contains("RUST_BACKTRACE"),
        "{line}"
    );
}

/// Wait for a file the command under test writes, and read it.
async fn wait_for_file(path: &Path) -> String {
    assert!(
        until(Duration::from_secs(20), || path.exists()).await,
        "{} never appeared",
        path.display()
    );
    // Written with one `>` redirection: wait for its line to be complete.
    let mut text = String::new();
    until(Duration::from_secs(5), || {
        text = std::fs::read_to_string(path).unwrap_or_default();
        text.ends_with('\n')
    })
    .await;
    text
}

fn signal(child: &Child, sig: Signal) {
    let pid = child
        .id()
        .and_then(|p| Pid::from_raw(p as i32))
        .expect("running");
    kill_process(pid, sig).expect("signal");
}

fn id(v: &Value) -> String {
    v["id"].as_str().expect("id").to_owned()
}

/// The lease of `resource` (current or ended, newest first).
async fn lease_of(s: &Server, resource: &str) -> Value {
    let r = s
        .get(&format!("/v1/leases?resource={resource}&state=all"))
        .await;
    r.body["items"][0].clone()
}

// ---- leases -------------------------------------------------------------

#[tokio::test]
async fn cli_lease_verbs_print_tables_and_the_api_json() {
    let s = Server::start().await;

    let people = ok(hf(&s, "lease acquire work/a --holder me --ttl 30s")).await;
    let header = people.stdout.lines().next().expect("a header");
    for col in [
        "ID", "RESOURCE", "TOKEN", "STATE", "HOLDER", "OWNER", "EXPIRES",
    ] {
        assert!(header.contains(col), "{header}");
    }
    let row = people.stdout.lines().nth(1).expect("a row");
    assert!(
        row.contains("work/a") && row.contains("active") && row.contains(" me "),
        "{row}"
    );
    assert!(
        !people.stdout.contains('{'),
        "no JSON for people: {}",
        people.stdout
    );
    let a = lease_of(&s, "work/a").await;
    assert!(row.starts_with(&id(&a)), "{row}");

    // --json before or after the verb: what the API answered.
    let renewed = ok(hf(
        &s,
        &format!("--json lease renew {} --token 1 --ttl 1m", id(&a)),
    ))
    .await
    .json();
    assert_eq!(renewed["ttl_ms"], 60_000);
    assert_eq!(
        renewed,
        s.lease(&id(&a)).await,
        "the record as the server has it"
    );
    let got = ok(hf(&s, &format!("lease get {} --json", id(&a))))
        .await
        .json();
    assert_eq!(got, s.lease(&id(&a)).await);
    let people = ok(hf(&s, &format!("lease get {}", id(&a)))).await;
    assert!(people.stdout.contains("work/a"), "{}", people.stdout);
    let people = ok(hf(&s, &format!("lease renew {} --token 1", id(&a)))).await;
    assert!(people.stdout.contains("active"), "{}", people.stdout);

    // A reserved lease, then activated for a process.
    let r = ok(hf(
        &s,
        "lease acquire work/b --holder sup --ttl 30s --reserve --json",
    ))
    .await
    .json();
    assert_eq!(r["state"], "reserved");
    let people = ok(hf(
        &s,
        &format!(
            "lease activate {} --token 1 --owner-pid {}",
            id(&r),
            std::process::id()
        ),
    ))
    .await;
    assert!(people.stdout.contains("active"), "{}", people.stdout);
    assert!(
        people
            .stdout
            .contains(&format!("pid {} live", std::process::id())),
        "{}",
        people.stdout
    );
    let r2 = ok(hf(&s, "lease acquire work/c --holder h --ttl 30s --json"))
        .await
        .json();
    let activated = ok(at(
        &s,
        &[
            "--json",
            "lease",
            "acquire",
            "work/d",
            "--holder",
            "h",
            "--ttl",
            "5s",
            "--reserve",
            "--metadata",
            "{\"ticket\":7}",
        ],
    ))
    .await
    .json();
    assert_eq!(activated["metadata"]["ticket"], 7);
    let json = ok(hf(
        &s,
        &format!(
            "lease activate {} --token 1 --owner-pid {} --json",
            id(&activated),
            std::process::id()
        ),
    ))
    .await
    .json();
    assert_eq!(json["state"], "active");
    assert_eq!(json["owner"]["pid"], std::process::id());

    // A child lease under a current parent.
    let child = ok(hf(
        &s,
        &format!(
            "lease acquire work/a/child --holder h --ttl 30s --parent {}:1 --json",
            id(&a)
        ),
    ))
    .await
    .json();
    assert_eq!(child["parent"]["id"], id(&a));

    // List: people, JSON, filters.
    let list = ok(hf(&s, "lease list --prefix work/a")).await;
    assert_eq!(
        list.stdout.lines().count(),
        3,
        "a header and two rows: {}",
        list.stdout
    );
    let listed = ok(hf(&s, "lease list --json --holder me")).await.json();
    assert_eq!(listed["items"].as_array().expect("items").len(), 1);
    assert_eq!(listed["next_cursor"], Value::Null);
    assert_eq!(listed["items"][0]["id"], id(&a));
    let exact = ok(hf(&s, "--json lease list --resource work/c"))
        .await
        .json();
    assert_eq!(exact["items"][0]["id"], id(&r2));

    // Release and break, with and without --json; ended ones listed.
    let released = ok(hf(
        &s,
        &format!("lease release {} --token 1 --json", id(&r2)),
    ))
    .await
    .json();
    assert_eq!(released["state"], "released");
    let people = ok(hf(&s, &format!("lease release {} --token 1", id(&child)))).await;
    assert!(people.stdout.contains("released"), "{}", people.stdout);
    let broken = ok(hf(
        &s,
        &format!("lease break {} --reason maintenance --json", id(&a)),
    ))
    .await
    .json();
    assert_eq!(broken["end_reason"], "broken:maintenance");
    let people = ok(hf(&s, &format!("lease break {} --reason moving", id(&r)))).await;
    assert!(people.stdout.contains("broken:moving"), "{}", people.stdout);
    let ended = ok(hf(&s, "lease list --state ended --json")).await.json();
    assert_eq!(ended["items"].as_array().expect("items").len(), 4);
}

#[tokio::test]
async fn cli_list_all_joins_every_page() {
    let s = Server::start().await;
    for i in 0..105 {
        s.acquire_ok(&format!("many/{i:03}"), "h").await;
    }
    let first = ok(hf(&s, "lease list --json")).await.json();
    assert_eq!(first["items"].as_array().expect("items").len(), 100);
    assert!(
        first["next_cursor"].is_string(),
        "one page, as the API answered it"
    );
    let all = ok(hf(&s, "lease list --all --json")).await.json();
    let items = all["items"].as_array().expect("items");
    assert_eq!(items.len(), 105);
    assert_eq!(all["next_cursor"], Value::Null);
    let mut ids: Vec<&str> = items
        .iter()
        .map(|l| l["id"].as_str().expect("id"))
        .collect();
    ids.dedup();
    assert_eq!(ids.len(), 105, "no lease twice");
    let people = ok(hf(&s, "lease list --all")).await;
    assert_eq!(people.stdout.lines().count(), 106);
    assert_eq!(people.stderr, "", "every page shown: nothing more to say");
    // One page for people says that it is one.
    let page = ok(hf(&s, "lease list")).await;
    assert_eq!(page.stdout.lines().count(), 101);
    assert!(
        page.stderr
            .contains("the first 100 only; --all lists every page"),
        "{}",
        page.stderr
    );
    assert_eq!(ok(hf(&s, "lease list --json")).await.stderr, "");
    // Nobody reads stderr: the note is lost, not the command (a panic).
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let mut cmd = hf(&s, "lease list");
    cmd.stderr(writer);
    let o = out(cmd).await;
    assert_eq!(o.code, 0, "{}", o.stdout);
    assert_eq!(o.stdout.lines().count(), 101);
}

#[tokio::test]
async fn cli_held_lease_exits_75_or_the_conflict_code_naming_the_holder() {
    let s = Server::start().await;
    let held = s.acquire_ok("busy/r", "the-holder").await;
    let o = out(hf(&s, "lease acquire busy/r --holder me --ttl 10s")).await;
    assert_eq!(o.code, 75);
    assert_error_line(&o, "lease_held");
    assert!(
        o.stderr.contains("busy/r") && o.stderr.contains("the-holder"),
        "{}",
        o.stderr
    );
    assert!(o.stderr.contains(&id(&held)), "{}", o.stderr);
    assert!(o.stdout.is_empty());
    let o = out(hf(
        &s,
        "lease acquire busy/r --holder me --ttl 10s --conflict-exit-code 9",
    ))
    .await;
    assert_eq!(o.code, 9);
}

#[tokio::test]
async fn cli_wait_runs_out_with_75() {
    let s = Server::start().await;
    s.acquire_ok("slow/r", "h").await;
    let started = Instant::now();
    let o = out(hf(
        &s,
        "lease acquire slow/r --holder me --ttl 10s --wait 700ms",
    ))
    .await;
    assert_eq!(o.code, 75, "{}", o.stderr);
    assert!(started.elapsed() >= Duration::from_millis(700), "it waited");
    assert!(o.stderr.contains("waited 700ms"), "{}", o.stderr);
}

#[tokio::test]
async fn cli_wait_succeeds_when_the_holder_releases() {
    let s = Server::start().await;
    let held = s.acquire_ok("queue/r", "h").await;
    let waiter = hf(
        &s,
        "lease acquire queue/r --holder next --ttl 10s --wait 30s --json",
    )
    .spawn()
    .expect("spawn");
    s.eventually("/metrics", Duration::from_secs(10), |m| {
        m.as_str()
            .is_some_and(|t| t.contains("holdfast_lease_waiters 1"))
    })
    .await;
    let r = s.lease_op(&id(&held), "release", json!({"token": 1})).await;
    assert_eq!(r.status, StatusCode::OK);
    let o = finish(waiter).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    let got = o.json();
    assert_eq!(
        (got["holder"].as_str(), got["token"].as_i64()),
        (Some("next"), Some(2))
    );
}

// ---- exit codes and connecting ------------------------------------------

#[tokio::test]
async fn cli_usage_errors_exit_2() {
    for args in [
        &["lease", "acquire", "r", "--holder", "h", "--ttl", "5 s"][..],
        &["lease", "acquire", "r", "--holder", "h", "--ttl", "1.5s"],
        &["lease", "acquire", "r", "--holder", "h"],
        &["lease", "acquire", "r", "--ttl", "5s"],
        &[
            "lease",
            "acquire",
            "r",
            "--holder",
            "h",
            "--ttl",
            "5s",
            "--metadata",
            "[1]",
        ],
        &[
            "lease", "acquire", "r", "--holder", "h", "--ttl", "5s", "--parent", "nocolon",
        ],
        &["lease", "renew", "x"],
        &["lease", "list", "--state", "sometimes"],
        &["lease", "list", "--bogus"],
        &["--url", "https://127.0.0.1:7427", "lease", "list"],
        &["stop", "x", "--token", "1", "--grace", "soon"],
        &["spawn", "--kind", "k", "--env", "NOEQUALS", "--", "true"],
        &["spawn", "--kind", "k"],
        &["run", "--lease", "r"],
        &["run", "--lease", "r", "--grace", "5d", "--", "true"],
        &["run", "--", "true"],
        &["events", "--type", "lease.relased"],
        &["frobnicate"],
    ] {
        let o = out(holdfast(args)).await;
        assert_eq!(o.code, 2, "{args:?}: {}", o.stderr);
        assert!(
            !o.stderr.is_empty() && !o.stderr.contains("panicked"),
            "{args:?}: {}",
            o.stderr
        );
    }
    let o = out(holdfast(&["lease", "get", "../../metrics"])).await;
    assert_eq!(o.code, 2, "an id that is not one: {}", o.stderr);
    assert_error_line(&o, "usage");
    // The connection flags are global, but a server given one would ignore
    // it: `--token-file` would leave it with no token at all.
    for (args, hint) in [
        (&["serve", "--token-file", "/t"][..], "--auth-token-file"),
        (&["--token-file", "/t", "serve"], "--auth-token-file"),
        (&["serve", "--socket", "/s"], "--unix-socket"),
        (&["serve", "--url", "http://127.0.0.1:1"], "--listen"),
        (&["--json", "serve"], "client flag"),
        // Nor does it take a token on its command line, where ps shows it.
        (
            &["serve", "--auth-token", "s3cret"],
            "--auth-token-file or HOLDFAST_AUTH_TOKEN",
        ),
        (
            &["serve", "--admin-token", "s3cret"],
            "--admin-token-file or HOLDFAST_ADMIN_TOKEN",
        ),
    ] {
        let mut all = args.to_vec();
        all.extend(["--listen", "127.0.0.1:0", "--data-dir", "/nonexistent/hf"]);
        let o = out(holdfast(&all)).await;
        assert_eq!(o.code, 2, "{all:?}: {}", o.stderr);
        assert!(o.stderr.contains(hint), "{all:?}: {}", o.stderr);
    }
    // So its help does not list them; a client command's does.
    let serve = out(holdfast(&["serve", "--help"])).await;
    assert_eq!(serve.code, 0, "{}", serve.stderr);
    assert!(
        serve.stdout.contains("--auth-token-file"),
        "{}",
        serve.stdout
    );
    for client in ["--url", "--socket <", "--token-file", "--json"] {
        assert!(
            !serve.stdout.contains(client),
            "{client} in\n{}",
            serve.stdout
        );
    }
    let list = out(holdfast(&["lease", "list", "--help"])).await;
    for client in ["--url", "--socket <", "--token-file", "--json"] {
        assert!(list.stdout.contains(client), "{client} in\n{}", list.stdout);
    }
    let o = out(holdfast(&[
        "serve",
        "--listen",
        "none",
        "--data-dir",
        "/nonexistent/hf",
    ]))
    .await;
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("--listen none needs --unix-socket"),
        "{}",
        o.stderr
    );
}

#[tokio::test]
async fn cli_unreachable_server_exits_69() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", free.local_addr().expect("addr"));
    drop(free);
    let o = out(holdfast(&["--url", &url, "lease", "list"])).await;
    assert_eq!(o.code, 69);
    assert_error_line(&o, "unreachable");
    let o = out(holdfast(&[
        "lease",
        "list",
        "--socket",
        "/nonexistent/holdfast.sock",
    ]))
    .await;
    assert_eq!(o.code, 69);
    assert_error_line(&o, "unreachable");
}

/// A server that answers every request `503 busy` with `Retry-After: 0`.
async fn always_busy() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let body = r#"{"type":"about:blank","title":"Busy","status":503,"code":"busy","detail":"the store stayed locked"}"#;
                let answer = format!(
                    "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nretry-after: 0\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    (url, count)
}

#[tokio::test]
async fn cli_busy_after_retries_exits_69() {
    let (url, count) = always_busy().await;
    let o = out(holdfast(&["lease", "list", "--url", &url])).await;
    assert_eq!(o.code, 69, "{}", o.stderr);
    assert_error_line(&o, "busy");
    assert_eq!(
        count.load(std::sync::atomic::Ordering::SeqCst),
        4,
        "one try and three retries"
    );
}

#[tokio::test]
async fn cli_refusals_and_local_errors_exit_1() {
    let s = Server::start().await;
    let held = s.acquire_ok("r", "h").await;
    let o = out(hf(&s, &format!("lease release {} --token 99", id(&held)))).await;
    assert_eq!(o.code, 1);
    assert_error_line(&o, "fenced");
    assert_eq!(o.stdout, "", "a table's stdout has no problem in it");
    let o = out(hf(
        &s,
        &format!("--json lease release {} --token 99", id(&held)),
    ))
    .await;
    assert_eq!(o.code, 1);
    assert_error_line(&o, "fenced");
    let answered: Value = serde_json::from_str(&o.stdout).expect("the problem on stdout");
    assert_eq!(
        (&answered["code"], &answered["current"]["token"]),
        (&json!("fenced"), &json!(1)),
        "{answered}"
    );
    let o = out(hf(&s, "lease get 01937b4e-5d2a-7c4e-9a1b-2f3c4d5e6f70")).await;
    assert_eq!(o.code, 1);
    assert_error_line(&o, "not_found");
    let o = out(hf(&s, "lease acquire r2 --holder h --ttl 10ms")).await;
    assert_eq!(o.code, 1);
    assert_error_line(&o, "validation");
    assert!(
        o.stderr.trim_end().ends_with("(--ttl)"),
        "names the flag: {}",
        o.stderr
    );
    // A negative number is a value the server refuses, naming the flag,
    // not an unknown flag of clap's.
    for (line, flag) in [
        (format!("lease renew {} --token -3", id(&held)), "(--token)"),
        ("events --after -1".to_string(), "(--after)"),
    ] {
        let o = out(hf(&s, &line)).await;
        assert_eq!(o.code, 1, "{line}: {}", o.stderr);
        assert_error_line(&o, "validation");
        assert!(o.stderr.trim_end().ends_with(flag), "{line}: {}", o.stderr);
    }
    // A member refused is named by the flag it came from, for the command
    // that was typed, a list's members too.
    for args in [
        &["run", "--lease", "", "--", "true"][..],
        &["run", "--lease", "r3", "--port", "BAD", "--", "true"],
        &[
            "run", "--lease", "r3", "--port", "x", "--port", "x", "--", "true",
        ],
        &["spawn", "--kind", "k", "--port", "BAD", "--", "true"],
    ] {
        let o = out(at(&s, args)).await;
        assert_eq!(o.code, 1, "{args:?}: {}", o.stderr);
        assert_error_line(&o, "validation");
        let flag = if args[0] == "run" && args[2].is_empty() {
            "(--lease)"
        } else {
            "(--port)"
        };
        assert!(
            o.stderr.trim_end().ends_with(flag),
            "{args:?}: {}",
            o.stderr
        );
    }
    // A negative duration is refused as one, not as an unknown flag.
    let o = out(hf(&s, "lease acquire r4 --holder h --ttl -5s")).await;
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("cannot be negative"), "{}", o.stderr);
    let o = out(hf(&s, "lease list --token-file /nonexistent/token")).await;
    assert_eq!(o.code, 1);
    assert_error_line(&o, "local");
}

#[tokio::test]
async fn cli_tokens_from_file_or_environment_the_file_wins() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (auth, wrong) = (tmp.path().join("auth"), tmp.path().join("wrong"));
    std::fs::write(&auth, "s3cret\n").expect("write");
    std::fs::write(&wrong, "nope\n").expect("write");
    let s = Server::start_with(&["--auth-token-file", &auth.display().to_string()]).await;
    let (auth, wrong) = (auth.display().to_string(), wrong.display().to_string());

    let o = out(hf(&s, "lease list")).await;
    assert_eq!(o.code, 1);
    assert_error_line(&o, "unauthorized");
    ok(hf(&s, &format!("lease list --token-file {}", auth))).await;
    let mut c = hf(&s, "lease list");
    c.env("HOLDFAST_TOKEN", "s3cret");
    ok(c).await;
    let mut c = hf(&s, "lease list");
    c.env("HOLDFAST_TOKEN_FILE", &auth);
    ok(c).await;
    let mut c = hf(&s, &format!("lease list --token-file {}", auth));
    c.env("HOLDFAST_TOKEN", "nope");
    ok(c).await;
    let mut c = hf(&s, "lease list");
    c.env("HOLDFAST_TOKEN_FILE", &wrong)
        .env("HOLDFAST_TOKEN", "s3cret");
    assert_eq!(out(c).await.code, 1, "the file wins, even when it is wrong");
    // An empty variable is an unset one, as HOLDFAST_URL's is.
    let mut c = hf(&s, "lease list");
    c.env("HOLDFAST_TOKEN_FILE", "")
        .env("HOLDFAST_TOKEN", "s3cret");
    ok(c).await;
}

#[tokio::test]
async fn cli_connects_by_flag_or_environment_over_tcp_or_the_unix_socket() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let sock = tmp.path().join("hf.sock");
    let s = Server::start_with(&["--unix-socket", &sock.display().to_string()]).await;
    s.acquire_ok("conn/r", "h").await;
    let sock = sock.display().to_string();
    let count = |o: &Out| o.json()["items"].as_array().map(Vec::len);

    // Global flags before or after the verb.
    let o = ok(holdfast(&["--url", &s.base, "--json", "lease", "list"])).await;
    assert_eq!(count(&o), Some(1));
    let o = ok(holdfast(&["lease", "list", "--url", &s.base, "--json"])).await;
    assert_eq!(count(&o), Some(1));
    let o = ok(holdfast(&["--socket", &sock, "lease", "list", "--json"])).await;
    assert_eq!(count(&o), Some(1));
    let mut c = holdfast(&["lease", "list", "--json"]);
    c.env("HOLDFAST_SOCKET", &sock);
    assert_eq!(count(&ok(c).await), Some(1));
    // A flag beats the environment.
    let mut c = holdfast(&["lease", "list", "--json", "--url", &s.base]);
    c.env("HOLDFAST_SOCKET", "/nonexistent.sock");
    assert_eq!(count(&ok(c).await), Some(1));
}

#[tokio::test]
async fn cli_healthcheck_follows_holdfast_listen() {
    let s = Server::start().await;
    let port = s.base.rsplit(':').next().expect("port").to_owned();
    let mut c = holdfast(&["healthcheck"]);
    c.env("HOLDFAST_LISTEN", format!("0.0.0.0:{port}"));
    ok(c).await;
    let mut c = holdfast(&["healthcheck"]);
    c.env("HOLDFAST_LISTEN", format!("127.0.0.1:{port}"));
    ok(c).await;
    ok(holdfast(&["healthcheck", "--url", &s.base])).await;
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let closed = free.local_addr().expect("addr").to_string();
    drop(free);
    let mut c = holdfast(&["healthcheck"]);
    c.env("HOLDFAST_LISTEN", &closed);
    let o = out(c).await;
    assert_eq!(
        o.code, 1,
        "a health check says 1 for unhealthy: {}",
        o.stderr
    );
    assert_error_line(&o, "unreachable");
}

// ---- processes, logs, events, ports ---------------------------------------

#[tokio::test]
async fn cli_spawn_ps_logs_stop_and_ports() {
    let s = Server::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().display().to_string();
    let lease = s.acquire_ok("svc/web", "h").await;
    let lease_arg = format!("{}:1", id(&lease));

    let spawned = ok(at(&s, &[
        "spawn", "--kind", "web", "--lease", &lease_arg, "--port", "http", "--cwd", &dir,
        "--env", "GREETING=hi there", "--operation-id", "op-1", "--json", "--",
        "sh", "-c", "echo \"$GREETING $PORT_HTTP\"; echo oops >&2; while [ ! -e go ]; do sleep 0.05; done; echo bye",
    ]))
    .await
    .json();
    let pid = spawned["pid"].as_i64().expect("pid") as i32;
    let _group = Group::new(pid);
    let port = spawned["ports"]["http"].as_u64().expect("a port");
    assert_eq!(spawned["state"], "running");
    assert_eq!(spawned["operation_id"], "op-1");
    let people = ok(hf(&s, "spawn --kind idle --ttl 1m -- sleep 30")).await;
    assert!(
        people.stdout.contains("idle") && people.stdout.contains("running"),
        "{}",
        people.stdout
    );
    let idle_pid: i32 = people
        .stdout
        .lines()
        .nth(1)
        .and_then(|r| r.split_whitespace().nth(4))
        .and_then(|p| p.parse().ok())
        .expect("pid column");
    let _idle = Group::new(idle_pid);
    let idle_seen = Seen::now(i64::from(idle_pid));

    let ps = ok(hf(&s, "ps")).await;
    assert_eq!(ps.stdout.lines().count(), 3, "{}", ps.stdout);
    assert!(ps.stdout.contains(&format!("http={port}")), "{}", ps.stdout);
    let ps = ok(hf(&s, "ps --kind web --json")).await.json();
    assert_eq!(ps["items"][0]["id"], spawned["id"]);
    assert_eq!(ps["items"].as_array().map(Vec::len), Some(1));

    let ports = ok(hf(&s, "ports list")).await;
    assert!(
        ports.stdout.contains(&port.to_string()) && ports.stdout.contains("http"),
        "{}",
        ports.stdout
    );
    let ports = ok(hf(&s, "ports list --json")).await.json();
    assert_eq!(ports["items"][0]["port"], port);

    // Logs, both streams; --follow ends when the process does.
    let pid_id = id(&spawned);
    let expect = format!("hi there {port}\n");
    let mut logs = String::new();
    until(Duration::from_secs(10), || {
        logs = std::fs::read_to_string(spawned["logs"]["stdout"].as_str().unwrap_or_default())
            .unwrap_or_default();
        logs == expect
    })
    .await;
    assert_eq!(ok(hf(&s, &format!("logs {}", pid_id))).await.stdout, expect);
    assert_eq!(
        ok(hf(&s, &format!("logs {} --stderr", pid_id)))
            .await
            .stdout,
        "oops\n"
    );
    let mut follower = hf(&s, &format!("logs {} --follow", pid_id))
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(follower.stdout.take().expect("stdout")).lines();
    let first = next_line(&mut lines).await;
    assert_eq!(first.as_deref(), Some(expect.trim_end()));
    std::fs::write(tmp.path().join("go"), "").expect("go");
    let second = next_line(&mut lines).await;
    assert_eq!(
        second.as_deref(),
        Some("bye"),
        "new output as it is written"
    );
    let rest = tokio::time::timeout(LIMIT, lines.next_line())
        .await
        .expect("the follower ends with the process");
    assert_eq!(rest.expect("read"), None);
    assert_eq!(finish(follower).await.code, 0);

    // Stop, with and without --json.
    let idle = ok(hf(&s, "ps --kind idle --json")).await.json();
    let idle = &idle["items"][0];
    assert_eq!(idle["ttl_ms"], 60_000);
    let stopped = ok(hf(
        &s,
        &format!(
            "stop {} --token {} --grace 2s --reason done --json",
            id(idle),
            idle["token"]
        ),
    ))
    .await
    .json();
    assert_eq!(stopped["state"], "stopped");
    assert!(!idle_seen.runs());
    let people = ok(hf(
        &s,
        &format!("stop {} --token {} --no-force", pid_id, spawned["token"]),
    ))
    .await;
    assert!(people.stdout.contains("web"), "{}", people.stdout);
    let all = ok(hf(&s, "ps --state ended --all --json")).await.json();
    assert_eq!(all["items"].as_array().map(Vec::len), Some(2));
}

#[tokio::test]
async fn cli_events_read_filtered_and_followed() {
    let s = Server::start().await;
    let a = s.acquire_ok("ev/a", "h").await;
    s.lease_op(&id(&a), "release", json!({"token": 1})).await;

    let all = ok(hf(&s, "events --json")).await.json();
    let items = all["items"].as_array().expect("items");
    assert_eq!(items.len(), 2);
    assert_eq!(
        all,
        s.get("/v1/events").await.body,
        "one page: what the API answered"
    );
    let people = ok(hf(&s, "events")).await;
    assert!(
        people
            .stdout
            .lines()
            .nth(1)
            .is_some_and(|l| l.contains("lease.acquired") && l.contains("ev/a")),
        "{}",
        people.stdout
    );
    let only = ok(hf(&s, "events --type lease.released --json"))
        .await
        .json();
    assert_eq!(only["items"].as_array().map(Vec::len), Some(1));
    assert_eq!(only["items"][0]["type"], "lease.released");
    let after = ok(hf(&s, "events --after 1 --json")).await.json();
    assert_eq!(after["items"][0]["seq"], 2);

    // --follow without --after starts now: only what happens next.
    let mut follower = hf(&s, "events --follow --json --type lease.acquired")
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(follower.stdout.take().expect("stdout")).lines();
    // The follower has its stream open once the server counts it waiting;
    // until then, new leases could come before it looks.
    let mut n = 0;
    let line = loop {
        n += 1;
        s.acquire_ok(&format!("ev/next{n}"), "h").await;
        if let Ok(line) = tokio::time::timeout(Duration::from_millis(500), lines.next_line()).await
        {
            break line.expect("read").expect("a line");
        }
        assert!(n < 40, "the follower printed nothing");
    };
    let ev: Value = serde_json::from_str(&line).expect("one event per line");
    assert_eq!(ev["type"], "lease.acquired");
    assert!(
        ev["lease"]["resource"]
            .as_str()
            .is_some_and(|r| r.starts_with("ev/next")),
        "not the old ev/a: {ev}"
    );
    drop(follower);

    let mut people = hf(&s, "events --follow --after 0").spawn().expect("spawn");
    let mut lines = BufReader::new(people.stdout.take().expect("stdout")).lines();
    let header = next_line(&mut lines).await.expect("line");
    let first = next_line(&mut lines).await.expect("line");
    assert_eq!(
        header.split_whitespace().collect::<Vec<_>>(),
        ["SEQ", "TIME", "TYPE", "SUBJECT"],
        "{header}"
    );
    assert!(
        first.contains("lease.acquired") && first.contains("ev/a"),
        "{first}"
    );
    // The columns line up under the header: TYPE starts where the type does.
    assert_eq!(
        header.find("TYPE"),
        first.find("lease.acquired"),
        "{header}\n{first}"
    );
}

#[tokio::test]
async fn cli_followers_wait_out_a_server_that_is_down() {
    // Over the Unix socket, so that the server started again answers where
    // the first did.
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("hf.sock");
    let sock = sock.to_str().expect("utf-8 path");
    let args = ["--unix-socket", sock];
    let s = Server::start_in(dir.path(), &args).await;
    s.acquire_ok("down/1", "h").await;
    let mut follower = holdfast(&[
        "--socket", sock, "events", "--follow", "--json", "--after", "0",
    ])
    .spawn()
    .expect("spawn");
    let mut lines = BufReader::new(follower.stdout.take().expect("stdout")).lines();
    let mut said = BufReader::new(follower.stderr.take().expect("stderr")).lines();
    let first = next_line(&mut lines).await.expect("a line");
    assert!(first.contains("down/1"), "{first}");

    s.kill9().await;
    let note = next_line(&mut said).await.expect("a line");
    assert!(note.contains("trying again until interrupted"), "{note}");
    // Longer than any one call's retries (and than the five seconds this
    // follower once gave up after): what is tested is time passing.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        follower.try_wait().expect("try_wait").is_none(),
        "the follower gave up"
    );

    // One that never reached the server is told so at once, as any
    // command (a wrong --url must not wait for ever), with or without
    // --after, for events and for logs.
    let p = "0193a6c5-6a4c-7d6e-8f00-000000000000";
    for cmd in [
        &["events", "--follow"][..],
        &["events", "--follow", "--after", "3"],
        &["logs", p, "--follow"],
    ] {
        let mut all = vec!["--socket", sock];
        all.extend_from_slice(cmd);
        let o = out(holdfast(&all)).await;
        assert_eq!(o.code, 69, "{cmd:?}: {}", o.stderr);
        assert_error_line(&o, "unreachable");
    }

    let s = Server::start_in(dir.path(), &args).await;
    s.acquire_ok("down/2", "h").await;
    let line = next_line(&mut lines).await.expect("a line");
    let ev: Value = serde_json::from_str(&line).expect("one event per line");
    assert_eq!(
        ev["lease"]["resource"], "down/2",
        "from the last seq seen: {ev}"
    );
    assert_eq!(
        next_line(&mut said).await.expect("a line"),
        "holdfast: connected again"
    );
}

#[tokio::test]
async fn cli_followers_end_when_their_reader_does() {
    let s = Server::start().await;
    s.acquire_ok("gone/1", "h").await;
    let p = s
        .spawn(json!({"kind": "talker", "ttl_ms": 60000,
            "command": {"argv": ["sh", "-c", "echo hello; exec sleep 60"]}}))
        .await;
    let logs = format!("logs {} --follow", id(&p));
    for line in ["events --follow --after 0", logs.as_str()] {
        let mut follower = hf(&s, line).spawn().expect("spawn");
        let mut lines = BufReader::new(follower.stdout.take().expect("stdout")).lines();
        assert!(next_line(&mut lines).await.is_some(), "{line}");
        // The reader goes away (as `| head -1` would) while nothing new is
        // written: the follower learns it from the pipe, not from a write.
        drop(lines);
        let o = finish(follower).await;
        assert_eq!(o.code, 1, "{line}: {}", o.stderr);
        assert_eq!(
            o.stderr, "",
            "{line}: quietly, as a writer killed by SIGPIPE"
        );
    }
    let stopped = s
        .process_op(&id(&p), "stop", json!({"token": p["token"], "grace_ms": 0}))
        .await;
    assert_eq!(stopped.status, StatusCode::OK, "{}", stopped.body);
}

#[tokio::test]
async fn cli_output_that_reaches_nowhere_fails_the_command() {
    let s = Server::start().await;
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    let mut cmd = hf(&s, "--json lease acquire full/1 --holder me --ttl 1m");
    cmd.stdout(full);
    let o = out(cmd).await;
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert_error_line(&o, "local");
    assert!(o.stderr.contains("writing the output"), "{}", o.stderr);
    // The lease was taken all the same: the caller learns it did not see it.
    assert_eq!(lease_of(&s, "full/1").await["state"], "active");
}

// ---- holdfast run ----------------------------------------------------------

/// What a command under test runs last: wait until the test creates `go`.
const UNTIL_GO: &str = "while [ ! -e go ]; do sleep 0.05; done";

/// `holdfast run EXTRA -- sh -c SCRIPT`, in `dir`, against `s`.
fn run_sh(s: &Server, extra: &[&str], dir: &Path, script: &str) -> Command {
    let mut args = vec!["run"];
    args.extend_from_slice(extra);
    let script = format!("cd '{}' && {script}", dir.display());
    args.extend(["--", "sh", "-c", &script]);
    at(s, &args)
}

/// A `holdfast run` in the background whose command wrote its pid (the
/// pid of COMMAND's process group) to `pid` as it started.
struct Running {
    child: Child,
    pid: i32,
    /// The command, known by its start time too.
    seen: Seen,
    _group: Group,
}

async fn start(mut cmd: Command, dir: &Path) -> Running {
    let child = cmd.spawn().expect("spawn holdfast run");
    let pid = wait_for_file(&dir.join("pid"))
        .await
        .trim()
        .parse()
        .expect("a pid");
    Running {
        child,
        pid,
        seen: Seen::now(i64::from(pid)),
        _group: Group::new(pid),
    }
}

fn go(dir: &Path) {
    std::fs::write(dir.join("go"), "").expect("write go");
}

/// GET with a bearer token, for servers that want one.
async fn get_as(s: &Server, path: &str, token: &str) -> Value {
    let res = s.client.get(s.url(path)).bearer_auth(token).send().await;
    res.expect("GET").json().await.expect("JSON")
}

#[tokio::test]
async fn cli_run_gives_the_command_its_lease_and_exits_with_its_code() {
    let s = Server::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let mut run = run_sh(
        &s,
        &[
            "--lease",
            "job/env",
            "--holder",
            "ci step",
            "--metadata",
            r#"{"pipeline": 12}"#,
        ],
        dir,
        "env > env.txt; exit 7",
    );
    run.env("SOME_SETTING", "kept");
    let o = out(run).await;
    assert_eq!(o.code, 7, "{}", o.stderr);
    assert!(
        o.stdout.is_empty() && o.stderr.is_empty(),
        "{} {}",
        o.stdout,
        o.stderr
    );
    let env = std::fs::read_to_string(dir.join("env.txt")).expect("env");
    let lease = lease_of(&s, "job/env").await;
    assert!(
        env.contains(&format!("HOLDFAST_LEASE_ID={}\n", id(&lease))),
        "{env}"
    );
    assert!(
        env.contains(&format!("HOLDFAST_LEASE_TOKEN={}\n", lease["token"])),
        "{env}"
    );
    assert!(env.contains("HOLDFAST_RESOURCE=job/env\n"), "{env}");
    assert!(env.contains("SOME_SETTING=kept\n"), "{env}");
    assert_eq!(
        lease["state"], "released",
        "released when the command ended"
    );
    assert_eq!(lease["holder"], "ci step");
    assert_eq!(lease["metadata"], json!({"pipeline": 12}));

    assert_eq!(
        out(run_sh(&s, &["--lease", "job/env"], dir, "exit 0"))
            .await
            .code,
        0
    );
    let o = out(run_sh(&s, &["--lease", "job/env"], dir, "kill -9 $$")).await;
    assert_eq!(o.code, 128 + 9, "signal N ends it: 128 + N");
    let o = out(hf(&s, "run --lease job/env -- no-such-program-here")).await;
    assert_eq!(o.code, 127, "{}", o.stderr);
    let lease = lease_of(&s, "job/env").await;
    assert_eq!(lease["state"], "released");
    let holder = lease["holder"].as_str().unwrap_or_default();
    assert!(
        holder.ends_with(": no-such-program-here"),
        "default holder: {holder}"
    );
    let ps = s.get("/v1/processes?state=all").await.body;
    assert_eq!(ps["items"][0]["kind"], "run");
    assert_eq!(
        ps["items"][0]["lease"]["id"], lease["id"],
        "a managed process of the lease"
    );
}

#[tokio::test]
async fn cli_run_when_held_exits_75_or_waits() {
    let s = Server::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let held = s.acquire_ok("job/held", "someone-else").await;

    let o = out(run_sh(&s, &["--lease", "job/held"], dir, "touch ran")).await;
    assert_eq!(o.code, 75);
    assert_error_line(&o, "lease_held");
    assert!(
        o.stderr.contains("job/held") && o.stderr.contains("someone-else"),
        "{}",
        o.stderr
    );
    let args = [
        "--lease",
        "job/held",
        "--wait",
        "300ms",
        "--conflict-exit-code",
        "3",
    ];
    assert_eq!(out(run_sh(&s, &args, dir, "touch ran")).await.code, 3);
    assert!(!dir.join("ran").exists(), "the command did not run");

    let waiter = run_sh(
        &s,
        &["--lease", "job/held", "--wait", "30s"],
        dir,
        "touch ran",
    )
    .spawn()
    .expect("spawn");
    s.eventually("/metrics", Duration::from_secs(10), |m| {
        m.as_str()
            .is_some_and(|t| t.contains("holdfast_lease_waiters 1"))
    })
    .await;
    assert!(!dir.join("ran").exists());
    s.lease_op(&id(&held), "release", json!({"token": 1})).await;
    let o = finish(waiter).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(dir.join("ran").exists());
}

#[tokio::test]
async fn cli_run_passes_sigterm_on_and_returns_the_commands_code() {
    let s = Server::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let script =
        "trap 'echo TERM > got; exit 42' TERM; echo $$ > pid; while :; do sleep 0.05; done";
    let run = start(run_sh(&s, &["--lease", "job/term"], dir, script), dir).await;
    signal(&run.child, Signal::TERM);
    let o = finish(run.child).await;
    assert_eq!(o.code, 42, "{}", o.stderr);
    assert_eq!(
        std::fs::read_to_string(dir.join("got"))
            .expect("got")
            .trim(),
        "TERM"
    );
    assert_eq!(lease_of(&s, "job/term").await["state"], "released");
}

#[tokio::test]
async fn cli_run_killed_leaves_no_command_and_frees_the_lease() {
    let s = Server::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let mut run = start(
        run_sh(
            &s,
            &["--lease", "job/kill9"],
            dir,
            // Deaf to SIGTERM: the server needs its 5 s grace to stop it.
            "trap '' TERM; echo $$ > pid; exec sleep 120",
        ),
        dir,
    )
    .await;
    let pid = i64::from(run.pid);
    assert!(alive(pid));
    let owner = lease_of(&s, "job/kill9").await["owner"]["pid"].clone();
    assert_eq!(
        owner,
        run.child.id().expect("pid"),
        "over TCP the lease is owned by run's pid"
    );

    run.child.start_kill().expect("SIGKILL");
    run.child.wait().await.expect("reap");
    let killed = Instant::now();
    // The next run takes over at once (the owner is dead) and starts its
    // command only once the server has stopped the old one.
    let next = tempfile::tempdir().expect("tempdir");
    let script = format!("echo $$ > pid; {UNTIL_GO}");
    let args = ["--lease", "job/kill9", "--wait", "10s"];
    let second = start(run_sh(&s, &args, next.path(), &script), next.path()).await;
    assert!(
        !run.seen.runs(),
        "the killed run's command is gone before the next starts"
    );
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "{:?}",
        killed.elapsed()
    );
    let leases = s.get("/v1/leases?resource=job/kill9&state=all").await.body;
    assert_eq!(leases["items"][0]["token"], 2);
    assert_eq!(leases["items"][1]["state"], "reclaimed");
    assert_eq!(leases["items"][1]["end_reason"], "owner_dead:pid_absent");
    go(next.path());
    assert_eq!(finish(second.child).await.code, 0);
}

#[tokio::test]
async fn cli_run_stops_the_command_and_exits_75_when_the_lease_is_broken() {
    let s = Server::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // It ignores SIGTERM: --grace decides when SIGKILL comes.
    let script = "trap '' TERM; echo $$ > pid; while :; do sleep 0.05; done";
    let run = start(
        run_sh(
            &s,
            &["--lease", "job/broken", "--grace", "500ms"],
            dir,
            script,
        ),
        dir,
    )
    .await;
    let lease = lease_of(&s, "job/broken").await;
    let broken_at = Instant::now();
    let r = s
        .lease_op(&id(&lease), "break", json!({"reason": "maintenance"}))
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let o = finish(run.child).await;
    assert_eq!(o.code, 75, "{}", o.stderr);
    // run's own --grace, not the server's 5 s stop of the orphaned tree.
    assert!(
        broken_at.elapsed() < Duration::from_secs(4),
        "run saw the loss and killed after its grace: {:?}",
        broken_at.elapsed()
    );
    assert_error_line(&o, "lease_lost");
    assert!(o.stderr.contains("broken:maintenance"), "{}", o.stderr);
    assert!(
        !run.seen.runs(),
        "the command was stopped before run exited"
    );

    // --conflict-exit-code also names the code of a lost lease.
    std::fs::remove_file(dir.join("pid")).expect("rm");
    let args = ["--lease", "job/broken", "--conflict-exit-code", "12"];
    let run = start(
        run_sh(
            &s,
            &args,
            dir,
            "echo $$ > pid; while :; do sleep 0.05; done",
        ),
        dir,
    )
    .await;
    let lease = lease_of(&s, "job/broken").await;
    s.lease_op(&id(&lease), "break", json!({"reason": "again"}))
        .await;
    assert_eq!(finish(run.child).await.code, 12);
}

#[tokio::test]
async fn cli_run_renews_a_ttl_while_the_command_runs() {
    let s = Server::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let script = format!("echo $$ > pid; {UNTIL_GO}");
    let run = start(
        run_sh(&s, &["--lease", "job/ttl", "--ttl", "1500ms"], dir, &script),
        dir,
    )
    .await;
    let renewed = s
        .eventually(
            "/v1/leases?resource=job/ttl",
            Duration::from_secs(10),
            |b| b["items"][0]["renewed_at"].is_string(),
        )
        .await;
    let lease = &renewed["items"][0];
    assert_eq!(
        (lease["ttl_ms"].as_i64(), lease["state"].as_str()),
        (Some(1500), Some("active"))
    );
    assert_eq!(lease["stale"], false);
    go(dir);
    assert_eq!(finish(run.child).await.code, 0);
}

#[tokio::test]
async fn cli_run_ports_reach_the_command_and_are_freed_after() {
    let s = Server::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let script =
        format!("echo \"$PORT $PORT_HTTP $PORT_DEBUG\" > ports; echo $$ > pid; {UNTIL_GO}");
    let args = ["--lease", "job/ports", "--port", "http", "--port", "debug"];
    let run = start(run_sh(&s, &args, dir, &script), dir).await;
    let text = std::fs::read_to_string(dir.join("ports")).expect("ports");
    let ports: Vec<u64> = text
        .split_whitespace()
        .map(|p| p.parse().expect("a port number"))
        .collect();
    assert_eq!(ports.len(), 3, "{text}");
    assert_eq!(ports[0], ports[1], "PORT is the first");
    assert_ne!(ports[1], ports[2]);
    let lease = id(&lease_of(&s, "job/ports").await);
    let reserved = s.get("/v1/ports").await.body;
    let mut held: Vec<(u64, &str)> = reserved["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|p| {
            (
                p["port"].as_u64().unwrap_or(0),
                p["owner"]["lease"]["id"].as_str().unwrap_or(""),
            )
        })
        .collect();
    held.sort();
    let mut want = vec![(ports[1], lease.as_str()), (ports[2], lease.as_str())];
    want.sort();
    assert_eq!(held, want, "reserved for the lease");
    go(dir);
    assert_eq!(finish(run.child).await.code, 0);
    assert_eq!(
        s.get("/v1/ports").await.body["items"],
        json!([]),
        "freed with the lease"
    );
}

#[tokio::test]
async fn cli_run_over_the_unix_socket_is_owned_by_run_and_never_sees_the_token() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let token = dir.join("token");
    std::fs::write(&token, "very-secret-token\n").expect("write");
    let sock = dir.join("hf.sock");
    let (token_arg, sock_arg) = (token.display().to_string(), sock.display().to_string());
    let s =
        Server::start_with(&["--auth-token-file", &token_arg, "--unix-socket", &sock_arg]).await;
    let mut cmd = run_sh(
        &s,
        &["--lease", "job/sock"],
        dir,
        &format!("env > env.txt; echo $$ > pid; {UNTIL_GO}"),
    );
    cmd.env_remove("HOLDFAST_URL")
        .env("HOLDFAST_SOCKET", &sock)
        .env("HOLDFAST_TOKEN_FILE", &token)
        .env("HOLDFAST_TOKEN", "very-secret-token");
    let run = start(cmd, dir).await;
    let lease = get_as(&s, "/v1/leases?resource=job/sock", "very-secret-token").await;
    let owner = &lease["items"][0]["owner"];
    assert_eq!(
        owner["pid"],
        run.child.id().expect("pid"),
        "\"caller\" is run itself"
    );
    assert_eq!(lease["items"][0]["owner_status"], "live");
    let env = std::fs::read_to_string(dir.join("env.txt")).expect("env");
    assert!(env.contains("HOLDFAST_LEASE_ID="), "{env}");
    assert!(!env.contains("very-secret-token"), "{env}");
    assert!(!env.contains("HOLDFAST_TOKEN"), "{env}");
    go(dir);
    let o = finish(run.child).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
}

#[tokio::test]
async fn cli_run_against_a_server_in_its_own_session_says_to_start_it_in_another() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // As `holdfast serve &` in the shell that then calls `holdfast run`: a
    // shell leading a new session (the test's own may be invisible, as is
    // the session of a CI job started by an init that never made one)
    // starts `run` in the background, then becomes the server. `run` reads
    // the server's address from a FIFO once the server listens.
    let go = dir.join("go");
    let made = std::process::Command::new("mkfifo")
        .arg(&go)
        .status()
        .expect("mkfifo");
    assert!(made.success(), "mkfifo {}", go.display());
    let _unblock = Unblock(go.clone());
    let script = r#"d=$1; shift
        ( read -r url < "$d/go" &&
          env -u HOLDFAST_SOCKET -u HOLDFAST_TOKEN -u HOLDFAST_TOKEN_FILE HOLDFAST_URL="$url" \
            "$1" run --lease job/same-session -- sh -c ": > '$d/ran'" 2> "$d/stderr"
          echo $? > "$d/code" ) &
        exec "$@""#;
    let d = dir.display().to_string();
    let s = Server::start_under(&["setsid", "sh", "-c", script, "sh", &d], dir, &[]).await;
    hand_over(&go, &format!("{}\n", s.base)).await;
    let code = wait_for_file(&dir.join("code")).await;
    let o = Out {
        code: code.trim().parse().expect("an exit code"),
        stdout: String::new(),
        stderr: std::fs::read_to_string(dir.join("stderr")).expect("stderr"),
    };
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert_error_line(&o, "forbidden");
    assert!(
        o.stderr.contains("session of its own") && !o.stderr.contains("Unix socket"),
        "it says what to do instead: {}",
        o.stderr
    );
    assert!(!dir.join("ran").exists(), "the command never ran");
}

/// Write `text` into the FIFO `path` once its reader has it open, within
/// LIMIT: a blocking open would wait for ever for a reader that died.
async fn hand_over(path: &Path, text: &str) {
    use std::io::Write;
    let mut fifo = None;
    let opened = until(LIMIT, || {
        fifo = fifo_writer(path).ok();
        fifo.is_some()
    })
    .await;
    assert!(opened, "nothing opened {} to read", path.display());
    // Less than PIPE_BUF, into an empty pipe: written whole, at once.
    fifo.expect("opened")
        .write_all(text.as_bytes())
        .expect("hand the FIFO's reader its text");
}

/// Ends a wait on the FIFO `.0` that a failed test never fed: a writer that
/// opens and closes it gives the reader end-of-file.
struct Unblock(std::path::PathBuf);

impl Drop for Unblock {
    fn drop(&mut self) {
        let _ = fifo_writer(&self.0);
    }
}

/// The FIFO `path` opened to write without waiting: ENXIO while no reader
/// has it open.
fn fifo_writer(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)
}

#[tokio::test]
async fn cli_run_refused_confirmation_never_starts_the_command() {
    if !rustix::process::geteuid().is_root() {
        eprintln!(
            "SKIPPED: needs root, whose processes TCP callers with an ordinary token may not confirm"
        );
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let token = dir.join("token");
    std::fs::write(&token, "ordinary\n").expect("write");
    let token_arg = token.display().to_string();
    let s = Server::start_with(&["--auth-token-file", &token_arg]).await;
    let o = out(run_sh(
        &s,
        &["--lease", "job/refused", "--token-file", &token_arg],
        dir,
        // A builtin, no fork: were COMMAND let out before the refusal, it
        // would write this before run could kill it.
        ": > ran",
    ))
    .await;
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert_error_line(&o, "forbidden");
    assert!(
        o.stderr.contains("Unix socket"),
        "it says what to use: {}",
        o.stderr
    );
    assert!(!dir.join("ran").exists(), "the command never ran");
    let lease = get_as(&s, "/v1/leases?resource=job/refused&state=all", "ordinary").await;
    assert_eq!(lease["items"][0]["state"], "released");
}
