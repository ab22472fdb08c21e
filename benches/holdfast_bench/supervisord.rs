//! supervisord (4.2, Debian's `supervisor`) as the anchor of `spawn` and `stop50`, through its
//! XML-RPC interface (`POST /RPC2`, bodies written by hand). Client i owns the program
//! `bench_<i>` (`/bin/sleep 600`, `startsecs=0`); a cycle is
//! `supervisor.startProcess(name, true)`, then `supervisor.getProcessInfo(name)` for
//! its pid and a wait until that process has exec'd `sleep`, then
//! `supervisor.stopProcess(name, true)` (answers once it ended). A `<fault>` in an
//! answer is an error.
//!
//! Why the wait: with `startsecs=0` startProcess answers right after the fork, and
//! a SIGTERM that reaches the child before its exec is swallowed by the signal
//! handlers it inherited from supervisord, so the stop then takes `stopwaitsecs` (5 s)
//! and ends with SIGKILL (about half of the cycles when the stop follows at once).
//! holdfast answers a spawn only after the exec, so the cycle waits for it here too.
//!
//! `stop50` (`stop_round`) starts `bench_0` to `bench_49` that way, all at once, then
//! times 50 concurrent `supervisor.stopProcess(name, true)` calls (not
//! stopAllProcesses), from the first sent to the last answer.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::Client;
use rustix::process::Signal;
use tokio::process::Command;
use tokio::task::JoinSet;

use crate::ctx;
use crate::process::{self, Started};
use crate::stats::Stats;

/// One parameter of an XML-RPC call.
enum Param<'a> {
    Str(&'a str),
    Bool(bool),
}

/// The XML-RPC endpoint of one supervisord, over the shared client.
#[derive(Clone)]
pub struct Rpc {
    pub client: Client,
    pub url: String,
}

impl Rpc {
    /// Calls `method`; the answer's XML, or an error on a status but 200 or a fault.
    async fn call(&self, method: &str, params: &[Param<'_>]) -> Result<String, String> {
        let mut body =
            format!("<?xml version=\"1.0\"?><methodCall><methodName>{method}</methodName><params>");
        for p in params {
            let _ = match p {
                Param::Str(s) => write!(body, "<param><value><string>{s}</string></value></param>"),
                Param::Bool(b) => {
                    let b = u8::from(*b);
                    write!(body, "<param><value><boolean>{b}</boolean></value></param>")
                }
            };
        }
        body.push_str("</params></methodCall>");
        let resp = self
            .client
            .post(&self.url)
            .header("content-type", "text/xml")
            .body(body)
            .send()
            .await;
        let resp = resp.map_err(|e| format!("{method}: {e}"))?;
        let status = resp.status();
        let text = resp.text().await.map_err(|e| format!("{method}: {e}"))?;
        if !status.is_success() {
            return Err(format!("{method}: {status} {text}"));
        }
        if text.contains("<fault>") {
            let fault = first_string(&text).unwrap_or(&text);
            return Err(format!("{method}: fault {fault}"));
        }
        Ok(text)
    }
}

impl Rpc {
    /// Waits until the process of `program` (its pid from getProcessInfo) has exec'd
    /// `exe`; an error after 5 s.
    async fn wait_exec(&self, program: &str, exe: &Path) -> Result<(), String> {
        let info = self
            .call("supervisor.getProcessInfo", &[Param::Str(program)])
            .await?;
        let pid = member_int(&info, "pid").filter(|&p| p > 0);
        let pid = pid.ok_or_else(|| format!("getProcessInfo: no pid for {program}: {info}"))?;
        let link = format!("/proc/{pid}/exe");
        let give_up = Instant::now() + Duration::from_secs(5);
        while std::fs::read_link(&link).ok().as_deref() != Some(exe) {
            if Instant::now() > give_up {
                return Err(format!(
                    "{program} (pid {pid}) did not exec {} in 5 s",
                    exe.display()
                ));
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        Ok(())
    }
}

/// The integer member `name` of the struct in an answer.
fn member_int(xml: &str, name: &str) -> Option<i64> {
    let after = &xml[xml.find(&format!("<name>{name}</name>"))?..];
    let value = &after[after.find("<value>")? + "<value>".len()..];
    let value = value.trim_start();
    let inner = value
        .strip_prefix("<int>")
        .or_else(|| value.strip_prefix("<i4>"))?;
    inner[..inner.find("</")?].trim().parse().ok()
}

/// The text of the first `<string>` of an answer.
fn first_string(xml: &str) -> Option<&str> {
    let start = xml.find("<string>")? + "<string>".len();
    let len = xml[start..].find("</string>")?;
    Some(&xml[start..start + len])
}

pub async fn spawn_client(rpc: Rpc, program: String, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    let args = [Param::Str(&program), Param::Bool(true)];
    let sleep = std::fs::canonicalize("/bin/sleep").unwrap_or_else(|_| "/bin/sleep".into());
    while Instant::now() < deadline {
        let started = Instant::now();
        let cycle = match rpc.call("supervisor.startProcess", &args).await {
            Ok(_) => match rpc.wait_exec(&program, &sleep).await {
                Ok(()) => rpc.call("supervisor.stopProcess", &args).await,
                Err(e) => {
                    let _ = rpc.call("supervisor.stopProcess", &args).await;
                    Err(e)
                }
            },
            Err(e) => Err(e),
        };
        match cycle {
            Ok(_) => stats.record(started.elapsed()),
            Err(e) => {
                note(&e);
                stats.fail().await;
            }
        }
    }
    stats
}

/// One round of `stop50`: starts the programs `bench_0` to `bench_<n-1>` at once
/// (startProcess, then the wait for the exec, as `spawn_client` does), then sends
/// their `n` `supervisor.stopProcess(name, true)` calls at once. The time from the
/// first stop sent to the last answer when every start and stop succeeded (else
/// None), and the number of those that did not. After a failed start all `n` are
/// still stopped, and the faults of those not running are not counted.
pub async fn stop_round(rpc: &Rpc, n: usize) -> (Option<Duration>, u64) {
    let sleep = std::fs::canonicalize("/bin/sleep").unwrap_or_else(|_| "/bin/sleep".into());
    let mut starts = JoinSet::new();
    for i in 0..n {
        let (rpc, sleep) = (rpc.clone(), sleep.clone());
        starts.spawn(async move {
            let name = program(i);
            let args = [Param::Str(&name), Param::Bool(true)];
            rpc.call("supervisor.startProcess", &args).await?;
            rpc.wait_exec(&name, &sleep).await
        });
    }
    let start_failures = failures(starts).await;
    start_failures.iter().for_each(|e| note(e));
    let started = Instant::now();
    let mut stops = JoinSet::new();
    for i in 0..n {
        let rpc = rpc.clone();
        stops.spawn(async move {
            let name = program(i);
            let args = [Param::Str(&name), Param::Bool(true)];
            rpc.call("supervisor.stopProcess", &args).await.map(drop)
        });
    }
    let stop_failures = failures(stops).await;
    let elapsed = started.elapsed();
    // After a failed start, the stops of programs that never ran fail too.
    let stop_errors = if start_failures.is_empty() {
        stop_failures.iter().for_each(|e| note(e));
        stop_failures.len()
    } else {
        0
    };
    let errors = (start_failures.len() + stop_errors) as u64;
    ((errors == 0).then_some(elapsed), errors)
}

/// The errors of the calls in `set`, once every one has answered.
async fn failures(mut set: JoinSet<Result<(), String>>) -> Vec<String> {
    let mut errors = Vec::new();
    while let Some(done) = set.join_next().await {
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(e.to_string()),
        }
    }
    errors
}

/// Shows the first few failures of a run on stderr (the counts are in the line).
fn note(error: &str) {
    use std::sync::atomic::{AtomicU32, Ordering};
    static SHOWN: AtomicU32 = AtomicU32::new(0);
    if SHOWN.fetch_add(1, Ordering::Relaxed) < 5 {
        eprintln!("holdfast-bench: supervisord: {error}");
    }
}

/// The name of client i's program.
pub fn program(i: usize) -> String {
    format!("bench_{i}")
}

/// Starts `supervisord` in the foreground on a free loopback port, with a config in a
/// fresh temp dir that defines `programs` programs (none started); returns it and
/// the URL of its XML-RPC endpoint. It is stopped with SIGTERM, so that it stops the
/// programs still running before it exits.
pub fn start(bin: &Path, programs: usize) -> Result<(Started, String), String> {
    let &[port] = process::free_ports(1)?.as_slice() else {
        return Err("no free port".into());
    };
    let dir = ctx(tempfile::TempDir::new(), "cannot create a temp dir")?;
    let d = dir.path().display().to_string();
    if d.contains('%') {
        return Err(format!(
            "{d}: a % in the temp dir would be expanded by supervisord"
        ));
    }
    let mut conf = format!(
        "[supervisord]\nnodaemon=true\nlogfile={d}/supervisord.log\npidfile={d}/supervisord.pid\n\
         childlogdir={d}\n\n[inet_http_server]\nport=127.0.0.1:{port}\n\n\
         [rpcinterface:supervisor]\n\
         supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n"
    );
    for i in 0..programs {
        let name = program(i);
        let _ = write!(
            conf,
            "\n[program:{name}]\ncommand=/bin/sleep 600\nautostart=false\nautorestart=false\n\
             startsecs=0\nstopwaitsecs=5\nstdout_logfile={d}/{name}.out\n\
             stderr_logfile={d}/{name}.err\n"
        );
    }
    let path = dir.path().join("supervisord.conf");
    ctx(
        std::fs::write(&path, conf),
        format!("cannot write {}", path.display()),
    )?;
    let mut cmd = Command::new(bin);
    cmd.arg("--configuration").arg(&path);
    let server = Started::spawn("supervisord", cmd, dir, "stdout.log", Signal::TERM)?;
    Ok((server, format!("http://127.0.0.1:{port}/RPC2")))
}

/// Polls `supervisor.getState` until it is RUNNING; returns the server's version.
pub async fn wait_ready(rpc: &Rpc, server: &mut Started) -> Result<String, String> {
    process::wait_ready(&rpc.url, Some(server), || async {
        let xml = rpc.call("supervisor.getState", &[]).await?;
        match xml.contains("<string>RUNNING</string>") {
            true => Ok(()),
            false => Err(format!("state: {xml}")),
        }
    })
    .await?;
    let version = rpc.call("supervisor.getSupervisorVersion", &[]).await?;
    Ok(first_string(&version).unwrap_or("?").to_owned())
}
