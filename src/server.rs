//! The accept loop: one hyper HTTP/1.1 connection per socket, with the caps
//! that keep a flood from exhausting the server. Past the connection cap a
//! client gets `503 busy` at once instead of waiting in the backlog; a
//! client that sends no request head in time is dropped.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::caller::Peer;

/// Hyper's read buffer, and so the largest head it parses (it answers a bare
/// 431 past it). Heads over `api::HEAD_LIMIT` but under this get the
/// contract's problem JSON from the API layer.
pub const READ_BUFFER: usize = 64 * 1024;
/// For the whole request head, however it trickles in (hyper's deadline
/// runs from the first read of a head, not from each byte): a client that
/// sends a byte a second holds a connection slot this long at most.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long open connections (SSE streams, long polls) get to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(5);

const BUSY: &str = "{\"type\":\"about:blank\",\"title\":\"Busy\",\"status\":503,\"code\":\"busy\",\
\"detail\":\"too many connections; retry after the given delay\"}";

/// Files the server keeps open besides its connections and the store's:
/// the pidfds of the processes it watches, the log files of spawns.
const FD_HEADROOM: u64 = 256;

/// Raise the open-file limit to its hard maximum: every connection is a file.
pub fn raise_fd_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::warn!(error = %e, "cannot raise the open-file limit");
        }
    }
}

/// The connection cap that fits under the open-file limit, beside the
/// store's `store_files`: past that, `accept` fails with EMFILE and
/// connections hang unanswered, where the cap answers `503 busy`.
pub fn connections_that_fit(max_connections: usize, store_files: u64) -> usize {
    let files = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    let room = files.map_or(u64::MAX, |n| {
        n.saturating_sub(FD_HEADROOM.saturating_add(store_files))
    });
    let fits = usize::try_from(room).unwrap_or(usize::MAX).max(1);
    if fits < max_connections {
        tracing::warn!(
            open_files = files,
            max_connections,
            serving = fits,
            "the open-file limit leaves room for fewer connections than --max-connections: \
             past it they get 503 busy (raise it with ulimit -n or LimitNOFILE=)"
        );
        return fits;
    }
    max_connections
}

async fn refuse<S: AsyncWrite + Unpin>(mut stream: S) {
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        BUSY.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(BUSY.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Serve `router` on the connections `accept` yields until `shutdown`.
pub async fn serve<S, A, Fut>(
    mut accept: A,
    router: Router,
    connections: Arc<Semaphore>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    A: FnMut() -> Fut,
    Fut: Future<Output = std::io::Result<(S, Peer)>>,
{
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.max_buf_size(READ_BUFFER)
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of descriptors or similar: keep serving the others.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream));
            continue;
        };
        let app = router
            .clone()
            .map_request(move |mut req: hyper::Request<Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req
            });
        let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::info!("open connections did not finish in time; closing them");
    }
    Ok(())
}
