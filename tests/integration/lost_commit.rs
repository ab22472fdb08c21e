//! A COMMIT to PostgreSQL whose answer is lost: the server asks the
//! database whether it committed, answers the request as it went, and its
//! keyed retry replays that answer, even when the database cannot be
//! reached for a while after the cut.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::campaigns::list_all;
use crate::support::Server;

/// A TCP proxy to PostgreSQL that, once armed, passes on the next COMMIT
/// of a batch with writes and drops the connection before its answer comes
/// back: a COMMIT that happens while its client is told the connection
/// broke. With an `outage`, the database is then out of reach for that
/// long: every open connection is dropped, and new ones as soon as they
/// are made.
struct CommitCutter {
    port: u16,
    faults: Arc<Faults>,
}

struct Faults {
    armed: AtomicBool,
    outage: Option<Duration>,
    /// New connections are dropped until then.
    refuse_until: Mutex<Option<tokio::time::Instant>>,
    /// Connections dropped so.
    refused: AtomicUsize,
    /// Told when a COMMIT is cut.
    cuts: tokio::sync::Notify,
    /// Moved on when an outage begins: every open connection is dropped.
    down: tokio::sync::watch::Sender<u64>,
}

impl Faults {
    fn refusing(&self) -> bool {
        self.refuse_until
            .lock()
            .expect("lock")
            .is_some_and(|t| tokio::time::Instant::now() < t)
    }

    /// Resolves when an outage begins after this call.
    fn outage_begins(&self) -> impl std::future::Future<Output = ()> + use<> {
        let mut down = self.down.subscribe();
        async move {
            let _ = down.changed().await;
        }
    }
}

impl CommitCutter {
    async fn start(upstream: String, outage: Option<Duration>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let faults = Arc::new(Faults {
            armed: AtomicBool::new(false),
            outage,
            refuse_until: Mutex::new(None),
            refused: AtomicUsize::new(0),
            cuts: tokio::sync::Notify::new(),
            down: tokio::sync::watch::Sender::new(0),
        });
        let f = faults.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if f.refusing() {
                    f.refused.fetch_add(1, Ordering::SeqCst);
                    drop(client);
                    continue;
                }
                let server = tokio::net::TcpStream::connect(&upstream)
                    .await
                    .expect("connect upstream");
                // Watched from here: an outage that begins before its task
                // runs must cut it too.
                let downs = [f.outage_begins(), f.outage_begins()];
                tokio::spawn(Self::pipe(f.clone(), downs, client, server));
            }
        });
        Self { port, faults }
    }

    async fn pipe(
        f: Arc<Faults>,
        [down_in, down_out]: [impl std::future::Future<Output = ()> + Send + 'static; 2],
        client: tokio::net::TcpStream,
        server: tokio::net::TcpStream,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        let cut = Arc::new(tokio::sync::Notify::new());
        let to_client = {
            let (cut, down) = (cut.clone(), down_in);
            tokio::spawn(async move {
                tokio::pin!(down);
                let mut buf = vec![0u8; 65536];
                loop {
                    tokio::select! {
                        biased;
                        // The COMMIT's answer, and all after it, never arrives.
                        () = cut.notified() => return,
                        () = &mut down => return,
                        n = sr.read(&mut buf) => match n {
                            Ok(0) | Err(_) => return,
                            Ok(n) => if cw.write_all(&buf[..n]).await.is_err() { return },
                        },
                    }
                }
            })
        };
        let down = down_out;
        tokio::pin!(down);
        let mut buf = vec![0u8; 65536];
        loop {
            let n = tokio::select! {
                () = &mut down => break,
                n = cr.read(&mut buf) => match n {
                    Ok(n) => n,
                    Err(_) => break,
                },
            };
            // A batch's writes and its COMMIT, which go as one query: not
            // the COMMIT of a background write that changed nothing.
            let has = |what: &[u8]| buf[..n].windows(what.len()).any(|w| w == what);
            let commit = has(b"COMMIT\0") && has(b"holdfast_write");
            // Cut before the COMMIT goes, so that its answer cannot pass.
            let cutting = commit && f.armed.swap(false, Ordering::SeqCst);

            if cutting {
                cut.notify_one();
            }
            // PostgreSQL reads the COMMIT before the end of the stream, and
            // commits.
            let passed = n > 0 && sw.write_all(&buf[..n]).await.is_ok();
            if cutting {
                if let Some(outage) = f.outage {
                    *f.refuse_until.lock().expect("lock") =
                        Some(tokio::time::Instant::now() + outage);
                    f.down.send_modify(|n| *n += 1);
                }
                f.cuts.notify_one();
            }
            if !passed || cutting {
                break;
            }
        }
        let _ = to_client.await;
    }
}

/// A server whose only way to its database is `proxy`, and the data
/// directory that holds it.
async fn server_behind(
    outage: Option<Duration>,
) -> Option<(Server, CommitCutter, tempfile::TempDir)> {
    crate::stores::postgres_base()?;
    let tmp = tempfile::tempdir().expect("tempdir");
    let url = crate::stores::database_for(tmp.path()).await;
    let rest = url.split_once("://").expect("url").1;
    let (auth, rest) = rest.split_once('@').expect("user@host");
    let (host, name) = rest.split_once('/').expect("host/db");
    let proxy = CommitCutter::start(host.to_owned(), outage).await;
    let through = format!("postgres://{auth}@127.0.0.1:{}/{name}", proxy.port);
    let s = Server::start_in(
        tmp.path(),
        &["--database", &through, "--reconcile-interval-ms", "3600000"],
    )
    .await;
    // The reconciler's first pass (at start) writes too: the cut is
    // for the request's COMMIT.
    s.eventually("/metrics", Duration::from_secs(10), |m| {
        crate::support::metric(m, "holdfast_reconciler_passes_total").is_some_and(|n| n > 0)
    })
    .await;
    Some((s, proxy, tmp))
}

/// Run as a SQLite test, so that the server is given only the proxy's
/// address as its database, not the database's own.
async fn as_sqlite(test: impl std::future::Future<Output = ()>) {
    crate::stores::run(crate::stores::Store::Sqlite, test).await
}

#[tokio::test]
async fn a_commit_whose_answer_is_lost_is_answered_as_kept_and_its_retry_replays_it() {
    as_sqlite(async {
        let Some((s, proxy, tmp)) = server_behind(None).await else {
            return;
        };
        let body = json!({"resource": "lost/commit", "holder": "h", "ttl_ms": 60_000});
        proxy.faults.armed.store(true, Ordering::SeqCst);
        let first = s.post_keyed("/v1/leases", "lost-1", body.clone()).await;
        assert!(
            !proxy.faults.armed.load(Ordering::SeqCst),
            "a COMMIT was cut"
        );
        assert_eq!(
            first.status,
            StatusCode::CREATED,
            "the change was kept, and answered so: {}",
            first.body
        );
        let again = s.post_keyed("/v1/leases", "lost-1", body).await;
        assert_eq!(again.status, StatusCode::CREATED, "{}", again.body);
        assert_eq!(again.body, first.body);
        let leases = list_all(&s, "/v1/leases?state=all&resource=lost/commit").await;
        assert_eq!(leases.len(), 1, "{leases:?}");
        drop(s);
        crate::stores::drop_database_of(tmp.path());
    })
    .await
}

/// Past the first seconds of an outage (the database out of reach), the
/// server still learns the lost COMMIT's outcome once the database is back,
/// and answers the request by it: its key is not left `request_in_progress`
/// for a day. Other writes do not wait for that: they are answered at once
/// (`503` while the database is out of reach).
#[tokio::test]
async fn a_lost_commit_is_answered_after_an_outage_and_other_writes_go_on_meanwhile() {
    // Past the 5 s the server used to give the question.
    const OUTAGE: Duration = Duration::from_secs(7);
    as_sqlite(async {
        let Some((s, proxy, tmp)) = server_behind(Some(OUTAGE)).await else {
            return;
        };
        let body = json!({"resource": "lost/outage", "holder": "h", "ttl_ms": 60_000});
        proxy.faults.armed.store(true, Ordering::SeqCst);
        let first = {
            let req = s
                .client
                .post(s.url("/v1/leases"))
                .header("idempotency-key", "outage-1")
                .json(&body);
            tokio::spawn(async move {
                let res = req.send().await.expect("POST");
                let status = res.status();
                (status, res.json::<Value>().await.expect("json"))
            })
        };
        // Once the COMMIT is cut: a write of a later batch.
        proxy.faults.cuts.notified().await;
        let sent = std::time::Instant::now();
        let other = s
            .post(
                "/v1/leases",
                json!({"resource": "other", "holder": "h", "ttl_ms": 60_000}),
            )
            .await;
        let took = sent.elapsed();
        assert_eq!(
            other.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            other.body
        );
        assert!(
            proxy.faults.refusing(),
            "another write is answered within the outage, not after it: it took {took:?}"
        );
        if first.is_finished() {
            let (status, body) = first.await.expect("first");
            panic!(
                "the lost COMMIT is still being looked into while the database is out of \
                 reach, yet its request was answered {status} {body}"
            );
        }

        let (status, lease) = first.await.expect("first");
        assert!(
            proxy.faults.refused.load(Ordering::SeqCst) > 0,
            "the outage refused a connection"
        );
        assert_eq!(
            status,
            StatusCode::CREATED,
            "kept, and answered so: {lease}"
        );
        let again = s.post_keyed("/v1/leases", "outage-1", body).await;
        assert_eq!(again.status, StatusCode::CREATED, "{}", again.body);
        assert_eq!(again.body["id"], lease["id"]);
        let leases = list_all(&s, "/v1/leases?state=all&resource=lost/outage").await;
        assert_eq!(leases.len(), 1, "{leases:?}");
        drop(s);
        crate::stores::drop_database_of(tmp.path());
    })
    .await
}
