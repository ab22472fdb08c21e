//! etcd (3.4, Debian's `etcd-server`) as the anchor of the lease workloads, through
//! its v3 JSON gateway (`POST /v3/...`, keys and values in base64, 64-bit integers
//! as strings). The workloads mean what holdfast's do, as closely as etcd allows:
//!
//! - `churn`: acquire = `lease/grant` (TTL 30 s) + `kv/txn` putting the client's key
//!   with that lease if it does not exist (create_revision == 0; a failed compare
//!   counts as an error), renew = `lease/keepalive`, release = `lease/revoke`;
//! - `renew`: one lease granted, then `lease/keepalive` back to back; revoked at the end;
//! - `contended`: the lock recipe of clientv3/concurrency.Mutex on one prefix: put
//!   `<prefix>/<lease id hex>` with the client's lease (and read the prefix's first
//!   key in the same txn); if another key was created before it, watch the deletion
//!   of the one created last before it, and check again. A hand-off is measured from
//!   the start of the attempt until held; release = delete the own key.
//!
//! etcd runs with its default fsync of every commit, like holdfast's durable commits.

use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::Client;
use rustix::process::Signal;
use serde_json::{Value, json};
use tokio::process::Command;

use crate::process::{self, Started};
use crate::stats::Stats;

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub fn b64(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let byte = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (byte(0) << 16) | (byte(1) << 8) | byte(2);
        for i in 0..4 {
            let sextet = (n >> (18 - 6 * i)) & 63;
            out.push(if i <= chunk.len() {
                char::from(ALPHABET[sextet as usize])
            } else {
                '='
            });
        }
    }
    out
}

/// The bytes of standard base64 (padding optional); None on any other character.
pub fn unb64(text: &str) -> Option<Vec<u8>> {
    let (mut out, mut acc, mut bits) = (Vec::with_capacity(text.len() / 4 * 3), 0u32, 0);
    for c in text.bytes().filter(|&c| c != b'=') {
        let sextet = ALPHABET.iter().position(|&a| a == c)?;
        acc = (acc << 6) | sextet as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// A 64-bit integer of the gateway's JSON (a string, or a number); None when absent.
fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        v => v.as_i64(),
    }
}

/// The v3 JSON gateway of one etcd, over the shared client.
#[derive(Clone)]
pub struct Etcd {
    pub client: Client,
    pub base: String,
}

impl Etcd {
    /// POSTs JSON to `/v3/<path>`; the JSON answer, or an error for any status but 200.
    async fn call(&self, path: &str, body: Value) -> Result<Value, String> {
        let url = format!("{}/v3/{path}", self.base);
        let resp = self.client.post(url).json(&body).send().await;
        let resp = resp.map_err(|e| format!("{path}: {e}"))?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| format!("{path}: {e}"))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes);
            return Err(format!("{path}: {status} {text}"));
        }
        serde_json::from_slice(&bytes).map_err(|e| format!("{path}: {e}"))
    }

    async fn grant(&self, ttl_s: u64) -> Result<i64, String> {
        let v = self.call("lease/grant", json!({"TTL": ttl_s})).await?;
        int(&v["ID"]).ok_or_else(|| format!("lease/grant: no ID in {v}"))
    }

    /// Puts `key` with `lease` if it does not exist; an error if it does.
    async fn create(&self, key: &str, lease: i64) -> Result<(), String> {
        let k = b64(key.as_bytes());
        let txn = json!({
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": "", "lease": lease.to_string()}}],
        });
        let v = self.call("kv/txn", txn).await?;
        match v["succeeded"].as_bool() {
            Some(true) => Ok(()),
            _ => Err(format!("kv/txn: {key} exists")),
        }
    }

    /// An error unless the lease is still there (the answer has its TTL).
    async fn keepalive(&self, lease: i64) -> Result<(), String> {
        let v = self
            .call("lease/keepalive", json!({"ID": lease.to_string()}))
            .await?;
        match int(&v["result"]["TTL"]) {
            Some(ttl) if ttl > 0 => Ok(()),
            _ => Err(format!("lease/keepalive: lease {lease:x} is gone: {v}")),
        }
    }

    async fn revoke(&self, lease: i64) -> Result<(), String> {
        let v = self
            .call("lease/revoke", json!({"ID": lease.to_string()}))
            .await;
        v.map(drop)
    }

    async fn delete(&self, key: &str) -> Result<(), String> {
        let v = self
            .call("kv/deleterange", json!({"key": b64(key.as_bytes())}))
            .await?;
        match int(&v["deleted"]) {
            Some(1) => Ok(()),
            _ => Err(format!("kv/deleterange: {key} was not there")),
        }
    }

    /// Takes the lock `prefix` with the key `<prefix>/<lease hex>` (the Mutex recipe).
    async fn lock(&self, prefix: &str, lease: i64) -> Result<String, String> {
        let key = format!("{prefix}/{lease:x}");
        let k = b64(key.as_bytes());
        // Every key under "<prefix>/": '0' is the byte after '/'.
        let (from, to) = (
            b64(format!("{prefix}/").as_bytes()),
            b64(format!("{prefix}0").as_bytes()),
        );
        let owner = json!({"key": from, "range_end": to, "sort_order": "ASCEND",
                           "sort_target": "CREATE", "limit": "1"});
        let txn = json!({
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": "", "lease": lease.to_string()}},
                        {"request_range": owner}],
            "failure": [{"request_range": {"key": k}}, {"request_range": owner}],
        });
        let v = self.call("kv/txn", txn).await?;
        let mine = if v["succeeded"].as_bool() == Some(true) {
            int(&v["header"]["revision"])
        } else {
            int(&v["responses"][0]["response_range"]["kvs"][0]["create_revision"])
        };
        let mine = mine.ok_or_else(|| format!("kv/txn: no revision in {v}"))?;
        let first = &v["responses"][1]["response_range"]["kvs"][0];
        let first_key = first["key"].as_str().and_then(unb64);
        if first_key.as_deref() == Some(key.as_bytes()) {
            return Ok(key);
        }
        // Wait for the deletion of the key created last before ours, until none is left.
        loop {
            let before = json!({"key": from, "range_end": to, "sort_order": "DESCEND",
                                "sort_target": "CREATE", "limit": "1",
                                "max_create_revision": (mine - 1).to_string()});
            let v = self.call("kv/range", before).await?;
            let Some(last) = v["kvs"][0]["key"].as_str() else {
                return Ok(key);
            };
            let at = int(&v["header"]["revision"]).ok_or("kv/range: no revision")?;
            self.wait_deleted(last, at + 1).await?;
        }
    }

    /// Watches the (base64) `key` from `revision` until an event deletes it: a streaming
    /// POST whose answer is one JSON message a line. Dropping the answer cancels it.
    async fn wait_deleted(&self, key: &str, revision: i64) -> Result<(), String> {
        let body = json!({"create_request": {"key": key, "start_revision": revision.to_string()}});
        let url = format!("{}/v3/watch", self.base);
        let resp = self.client.post(url).json(&body).send().await;
        let mut resp = resp.map_err(|e| format!("watch: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("watch: {}", resp.status()));
        }
        let mut pending = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| format!("watch: {e}"))? {
            pending.extend_from_slice(&chunk);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                if line.trim_ascii().is_empty() {
                    continue;
                }
                let v: Value = serde_json::from_slice(&line).map_err(|e| format!("watch: {e}"))?;
                let result = &v["result"];
                if v.get("error").is_some() || result["canceled"].as_bool() == Some(true) {
                    return Err(format!("watch: {v}"));
                }
                let events = result["events"].as_array().map_or(&[][..], Vec::as_slice);
                if events.iter().any(|e| e["type"] == "DELETE") {
                    return Ok(());
                }
            }
        }
        Err("watch: the stream ended".into())
    }
}

pub async fn churn_client(etcd: Etcd, key: String, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    while Instant::now() < deadline {
        let started = Instant::now();
        let ok = match etcd.grant(30).await {
            Ok(lease) => {
                let held = etcd.create(&key, lease).await;
                let renewed = match held {
                    Ok(()) => etcd.keepalive(lease).await,
                    Err(e) => Err(e),
                };
                let released = etcd.revoke(lease).await; // revoke even if the rest failed
                renewed.and(released)
            }
            Err(e) => Err(e),
        };
        match ok {
            Ok(()) => stats.record(started.elapsed()),
            Err(e) => {
                note(&e);
                stats.fail().await;
            }
        }
    }
    stats
}

pub async fn renew_client(etcd: Etcd, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    let lease = match etcd.grant(60).await {
        Ok(lease) => lease,
        Err(e) => {
            note(&e);
            stats.errors += 1;
            return stats;
        }
    };
    while Instant::now() < deadline {
        let started = Instant::now();
        match etcd.keepalive(lease).await {
            Ok(()) => stats.record(started.elapsed()),
            Err(e) => {
                note(&e);
                stats.fail().await;
            }
        }
    }
    if let Err(e) = etcd.revoke(lease).await {
        note(&e);
        stats.errors += 1;
    }
    stats
}

/// One session lease a client (as clientv3's concurrency.Session), kept alive between
/// attempts; an attempt that does not get the lock counts as lost.
pub async fn contended_client(etcd: Etcd, prefix: String, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    let mut session = None;
    while Instant::now() < deadline {
        let started = Instant::now();
        let held = match session_lease(&etcd, &mut session).await {
            Ok(lease) => etcd.lock(&prefix, lease).await,
            Err(e) => Err(e),
        };
        let key = match held {
            Ok(key) => key,
            Err(e) => {
                note(&e);
                // Revoking the lease deletes its key, which others may be queued behind.
                if let Some((lease, _)) = session.take() {
                    let _ = etcd.revoke(lease).await;
                }
                stats.lose().await;
                continue;
            }
        };
        let waited = started.elapsed();
        match etcd.delete(&key).await {
            Ok(()) => stats.record(waited),
            Err(e) => {
                note(&e);
                stats.fail().await;
            }
        }
    }
    if let Some((lease, _)) = session
        && let Err(e) = etcd.revoke(lease).await
    {
        note(&e);
        stats.errors += 1;
    }
    stats
}

/// The session's lease (granted with a TTL of 30 s; kept alive when 10 s old).
async fn session_lease(etcd: &Etcd, session: &mut Option<(i64, Instant)>) -> Result<i64, String> {
    let lease = match *session {
        Some((lease, renewed)) if renewed.elapsed() < Duration::from_secs(10) => return Ok(lease),
        Some((lease, _)) => etcd.keepalive(lease).await.map(|()| lease)?,
        None => etcd.grant(30).await?,
    };
    *session = Some((lease, Instant::now()));
    Ok(lease)
}

/// Shows the first few failures of a run on stderr (the counts are in the line).
fn note(error: &str) {
    use std::sync::atomic::{AtomicU32, Ordering};
    static SHOWN: AtomicU32 = AtomicU32::new(0);
    if SHOWN.fetch_add(1, Ordering::Relaxed) < 5 {
        eprintln!("holdfast-bench: etcd: {error}");
    }
}

/// Starts `etcd` on two free loopback ports (client, peer) with a fresh temp data dir;
/// returns it and its client URL.
pub fn start(bin: &Path) -> Result<(Started, String), String> {
    let &[client, peer] = process::free_ports(2)?.as_slice() else {
        return Err("no free port".into());
    };
    let dir = crate::ctx(tempfile::TempDir::new(), "cannot create a temp dir")?;
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut cmd = Command::new(bin);
    cmd.args(["--name", "bench", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("bench={peer_url}")]);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("ETCD") {
            cmd.env_remove(key);
        }
    }
    let server = Started::spawn("etcd", cmd, dir, "etcd.log", Signal::KILL)?;
    Ok((server, client_url))
}

/// Polls GET /health until it says `"health":"true"`; returns the server's version.
pub async fn wait_ready(etcd: &Etcd, server: &mut Started) -> Result<String, String> {
    let url = format!("{}/health", etcd.base);
    process::wait_ready(&url, Some(server), || async {
        let resp = etcd.client.get(&url).send().await;
        let text = resp.map_err(|e| e.to_string())?.text().await;
        let v: Value =
            serde_json::from_str(&text.map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        match v["health"].as_str() {
            Some("true") => Ok(()),
            _ => Err(format!("it answered {v}")),
        }
    })
    .await?;
    let version = etcd.client.get(format!("{}/version", etcd.base)).send();
    let version = match version.await {
        Ok(r) => r.json::<Value>().await.ok(),
        Err(_) => None,
    };
    let version = version.as_ref().and_then(|v| v["etcdserver"].as_str());
    Ok(version.unwrap_or("?").to_owned())
}
