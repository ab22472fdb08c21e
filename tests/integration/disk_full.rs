//! A store that cannot be written answers `503 unavailable`, loses nothing it
//! answered, and serves again once there is room.

use std::path::{Path, PathBuf};
use std::process::Command;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::{Reply, Server, holders_under};

/// A small tmpfs, unmounted when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: &Path) -> Option<Self> {
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self(dir.to_path_buf()))
    }

    /// Write filler until the disk is full.
    fn fill(&self) {
        let filler = self.0.join("filler");
        let _ = Command::new("dd")
            .args(["if=/dev/zero", "bs=64k"])
            .arg(format!("of={}", filler.display()))
            .stderr(std::process::Stdio::null())
            .status();
    }

    fn free(&self) {
        std::fs::remove_file(self.0.join("filler")).expect("remove filler");
    }
}

impl SmallDisk {
    /// A data directory on a small disk for `test`, or None (and a line
    /// saying so) where no tmpfs can be mounted.
    fn for_test(test: &str) -> Option<(tempfile::TempDir, Self)> {
        let tmp = tempfile::tempdir().expect("tempdir");
        let Some(disk) = Self::mount(tmp.path()) else {
            eprintln!("SKIPPED {test}: cannot mount a tmpfs here (needs root)");
            return None;
        };
        Some((tmp, disk))
    }
}

/// POST `body(i)` to `path`, for i = 0.., until one is not 201: the
/// answered bodies, and that answer.
async fn until_refused(
    s: &Server,
    path: &str,
    body: impl Fn(usize) -> Value,
) -> (Vec<Value>, Reply) {
    let mut answered = Vec::new();
    for i in 0..64 {
        let r = s.post(path, body(i)).await;
        if r.status != StatusCode::CREATED {
            return (answered, r);
        }
        answered.push(r.body);
    }
    panic!("64 writes to {path} on a full disk all succeeded");
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test]
async fn a_full_disk_is_503_unavailable_and_nothing_answered_is_lost() {
    let Some((tmp, disk)) = SmallDisk::for_test("a_full_disk") else {
        return;
    };
    let s = Server::start_in(tmp.path(), &[]).await;
    let kept = s.acquire_ok("disk/kept", "h").await;
    disk.fill();

    let meta = json!({"pad": "p".repeat(15_000)});
    let (_, r) = until_refused(&s, "/v1/leases", |i| {
        json!({"resource": format!("disk/{i}"), "holder": "h", "ttl_ms": 60_000, "metadata": meta})
    })
    .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    assert_eq!(r.code(), "unavailable");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(
        s.get("/readyz").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        s.get("/healthz").await.status,
        StatusCode::OK,
        "still serving"
    );
    assert_eq!(
        s.lease(kept["id"].as_str().expect("id")).await["state"],
        "active",
        "reads still work"
    );

    disk.free();
    assert_eq!(
        s.get("/readyz").await.status,
        StatusCode::OK,
        "ready again once there is room"
    );
    let id = kept["id"].as_str().expect("id");
    assert_eq!(
        s.lease_op(id, "release", json!({"token": 1})).await.status,
        StatusCode::OK
    );
    drop(s);
}

#[tokio::test]
async fn spawns_on_a_full_disk_are_503_and_leave_no_child_or_half_record() {
    let Some((tmp, disk)) = SmallDisk::for_test("spawns_on_a_full_disk") else {
        return;
    };
    let s = Server::start_in(tmp.path(), &[]).await;
    disk.fill();

    let spawn = json!({"kind": "disk", "command": {"argv": ["sleep", "300"]}, "metadata": {"pad": "p".repeat(15_000)}});
    let (answered, r) = until_refused(&s, "/v1/processes", |_| spawn.clone()).await;
    let answered: Vec<String> = answered
        .iter()
        .map(|p| p["id"].as_str().expect("id").to_owned())
        .collect();
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    assert_eq!(r.code(), "unavailable");

    // Nothing half-done: the only records are the answered ones, and every
    // process holding a log file is one of theirs.
    let current = s.get("/v1/processes?state=all&limit=1000").await.body;
    let ids: Vec<&str> = current["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|p| p["id"].as_str())
        .collect();
    assert_eq!(ids.len(), answered.len(), "{current}");
    let pids: Vec<i64> = current["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|p| p["pid"].as_i64())
        .collect();
    for pid in holders_under(&tmp.path().join("logs")) {
        assert!(pids.contains(&i64::from(pid)), "untracked child {pid}");
    }

    disk.free();
    let p = s
        .spawn(json!({"kind": "disk", "command": {"argv": ["sh", "-c", "echo back"]}}))
        .await;
    let id = p["id"].as_str().expect("id");
    s.eventually(
        &format!("/v1/processes/{id}"),
        std::time::Duration::from_secs(10),
        |p| p["state"] == "exited",
    )
    .await;
    let (status, out, _) = s.logs(id, "stream=stdout").await;
    assert_eq!(
        (status, out.as_str()),
        (StatusCode::OK, "back\n"),
        "spawns again once there is room"
    );
    for id in answered {
        let p = s.process(&id).await;
        let r = s
            .process_op(&id, "stop", json!({"token": p["token"], "grace_ms": 0}))
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    }
    drop(s);
}
