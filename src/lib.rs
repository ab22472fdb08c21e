//! holdfast: exclusive leases with fencing tokens, over HTTP/JSON.
//!
//! `App::build` opens the store and wires the parts; `serve` runs the HTTP
//! server and the reconciler until a shutdown signal.
//!
//! # How the code is laid out
//!
//! Dependencies point down, never back up (`farm-studio look` draws them):
//!
//! - `main.rs` and `cli/`: the binary: `serve`, and the client verbs, which
//!   speak only the public API with the request and record types of `api`
//!   and `model`.
//! - `api/`: HTTP only. A handler parses, validates, calls one service
//!   method and maps the result; `openapi.rs` completes the document that
//!   the routes generate; `error.rs` turns refusals into problem JSON.
//! - Services: `leases/`, `processes/`, `ports/`, `events.rs` (`EventLog`).
//!   Reads and writes both go through them. Each has its transaction scripts
//!   (`ops.rs`: one write transaction that re-reads, re-checks and appends
//!   its events) and its pure rules (`rules.rs`, table-tested).
//! - `tx/`: the context a script runs in (`Ctx`, `in_tx!`) and what several
//!   services' scripts share (`tx::ports`: picking, recording and ending
//!   port reservations).
//! - `store/`: the `Tx` and `Backend` traits, implemented once for both
//!   databases through sqlx (`sql_tx.rs`, `sql_store.rs`) on statements
//!   written once (`rows/`, column lists and filters in `sql.rs`). What the
//!   databases differ in is the `Db` trait (`db.rs`), implemented in
//!   `sqlite/` and `postgres/`, each with its own writer behind the shared
//!   group commit (`group.rs`): SQLite's runs its statements on the
//!   batch's own task through rusqlite (`sqlite/direct.rs`), PostgreSQL's
//!   queues the hot writes of a transaction for its commit
//!   (`postgres/pipeline.rs`, see docs/development.md); PostgreSQL renews
//!   plain leases outside its writer (`postgres/renewals.rs`); migrations
//!   in `migrate.rs`.
//! - `host/`: this machine: identities from /proc, pidfd signals, spawning,
//!   behind the `Host` trait. `model/`: records and the contract's names.
//!
//! A new endpoint: a handler in the matching `api/<resource>.rs` (added to
//! its `router()`), a service method, and a script in `ops.rs` when it
//! writes; regenerate `openapi/openapi.json` (`holdfast openapi`).
//! A new statement: a function in `store/rows/`, and a method on `Tx`
//! (inside a write, `store/sql_tx.rs`) or `Backend` (a read,
//! `store/sql_store.rs`) that calls it, declared in `store/mod.rs`.

pub mod api;
pub mod caller;
pub mod config;
pub mod data_dir;
pub mod events;
pub mod host;
pub mod idempotency;
pub mod leases;
pub mod metrics;
pub mod model;
pub mod ports;
pub mod processes;
pub mod reconcile;
pub mod server;
pub mod store;
pub mod time;
pub mod tx;
pub mod waiters;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use config::{Config, Database, Listen};
use host::{Host, LocalFacts, ProcHost};
use store::postgres::{PgStore, PoolSettings};
use store::{Store, sqlite::SqliteStore};
use waiters::Hub;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(String),
    #[error("reading this host's identity: {0}")]
    Host(std::io::Error),
    #[error("opening the store: {0}")]
    Store(#[from] store::StoreError),
    #[error("creating the data directory {path}: {source}")]
    DataDir {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Lock(#[from] data_dir::LockError),
    #[error("cannot listen on {on}: {source} (see {flag})")]
    Listen {
        on: String,
        flag: &'static str,
        source: std::io::Error,
    },
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
}

/// A built service: its state and the configuration it was built from.
pub struct App {
    pub state: api::AppState,
    pub config: Config,
    /// The data dir and SQLite file, this server's until it ends.
    _held: Vec<data_dir::Held>,
}

impl App {
    pub async fn build(config: Config) -> Result<Self, StartError> {
        if !cfg!(target_os = "linux") {
            return Err(StartError::Config(
                "holdfast needs Linux (/proc, pidfd, process groups)".into(),
            ));
        }
        let tokens = config.tokens().map_err(StartError::Config)?;
        config.check_exposure(&tokens).map_err(StartError::Config)?;
        let tcp_loopback = match config.listen {
            Listen::Tcp(addr) => {
                if !tokens.any() && rustix::process::geteuid().is_root() {
                    tracing::warn!(
                        %addr,
                        "running as root with a TCP listener and no token: any local user can act as root \
                         through this API. Set --auth-token-file, or use --unix-socket and --listen none"
                    );
                }
                addr.ip().is_loopback()
            }
            Listen::None => false,
        };
        let access = Arc::new(api::auth::Access {
            tokens,
            allowed_hosts: config.allowed_hosts.clone(),
            tcp_loopback,
        });
        let facts = LocalFacts::read(config.host_id.clone()).map_err(StartError::Host)?;
        let host: Arc<dyn Host> = Arc::new(ProcHost::new(facts.clone()));
        let hub = Arc::new(Hub::new(0));
        let data_dir = config.data_dir();
        let create = |dir: &std::path::Path| {
            data_dir::create_private_dir(dir).map_err(|source| StartError::DataDir {
                path: dir.display().to_string(),
                source,
            })
        };
        // In `logs/`, which is what it guards, and which is all a server
        // on PostgreSQL writes of its data dir.
        let logs = data_dir.join("logs");
        create(&logs)?;
        data_dir::warn_if_open(&[&data_dir, &logs]);
        let mut held = vec![
            data_dir::hold(
                logs.join("holdfast.lock"),
                &data_dir::Guarded {
                    what: "the data directory",
                    path: &data_dir,
                    flag: "--data-dir",
                },
            )
            .await?,
        ];
        let backend: Arc<dyn store::Backend> =
            match config.database().map_err(StartError::Config)? {
                Database::Sqlite(path) => {
                    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                        create(dir)?;
                    }
                    // Its own lock too: another data dir may name the same
                    // file, through a link as well.
                    let mut lock = data_dir::resolved(&path).into_os_string();
                    lock.push(".lock");
                    held.push(
                        data_dir::hold(
                            lock.into(),
                            &data_dir::Guarded {
                                what: "the database",
                                path: &path,
                                flag: "--database",
                            },
                        )
                        .await?,
                    );
                    Arc::new(
                        SqliteStore::open(&path, &facts.boot_id, time::now_ms(), hub.clone())
                            .await?,
                    )
                }
                Database::Postgres(url) => {
                    let settings = PoolSettings {
                        max_connections: config.database_pool_size,
                        timeout: Duration::from_millis(config.database_timeout_ms),
                    };
                    Arc::new(PgStore::connect(&url, &settings, hub.clone()).await?)
                }
            };
        let store = Store::new(backend);
        hub.event_committed(store.backend().last_event_seq().await?);
        hub.pruned_through.store(
            store.backend().pruned_through().await?,
            std::sync::atomic::Ordering::SeqCst,
        );
        let metrics = Arc::new(metrics::Metrics::new(store.backend().write_counters()));
        let leases = leases::Leases::new(store.clone(), host.clone(), &hub, metrics.clone());
        let reaper = host::spawn::Reaper::start()?;
        let processes = processes::Processes::new(store.clone(), host.clone(), reaper, &data_dir)
            .map_err(|source| StartError::DataDir {
            path: data_dir.display().to_string(),
            source,
        })?;
        let ports = ports::Ports::new(store.clone(), host);
        let state = Arc::new(api::Services {
            leases,
            processes,
            ports,
            events: events::EventLog::new(store.clone(), hub.clone()),
            store,
            hub,
            metrics,
            openapi: Arc::new(api::openapi_json()),
            access,
            unkept: Arc::default(),
            in_flight: Arc::default(),
        });
        Ok(Self {
            state,
            config,
            _held: held,
        })
    }

    pub fn router(&self) -> axum::Router {
        api::router(self.state.clone())
    }

    /// Bind the listeners the configuration asks for. A stale Unix socket
    /// file from an earlier run is replaced; the new one gets the configured mode.
    pub async fn bind(&self) -> Result<Listeners, StartError> {
        let tcp = match self.config.listen {
            Listen::Tcp(addr) => {
                Some(
                    TcpListener::bind(addr)
                        .await
                        .map_err(|source| StartError::Listen {
                            on: addr.to_string(),
                            flag: "--listen",
                            source,
                        })?,
                )
            }
            Listen::None => None,
        };
        let unix = match &self.config.unix_socket {
            Some(path) => Some(bind_unix(path, self.config.unix_socket_mode)?),
            None => None,
        };
        Ok(Listeners { tcp, unix })
    }

    /// Serve on the listeners until `shutdown` resolves, with the reconciler
    /// running beside; then close the store.
    pub async fn serve(
        self,
        listeners: Listeners,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), StartError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let interval = Duration::from_millis(self.config.reconcile_interval_ms);
        self.state.processes.adopt().await?;
        let reconciler = tokio::spawn(reconcile::run(
            reconcile::Parts {
                store: self.state.store.clone(),
                leases: self.state.leases.clone(),
                processes: self.state.processes.clone(),
                hub: self.state.hub.clone(),
                metrics: self.state.metrics.clone(),
                retention: self.config.event_retention,
                record_retention: self.config.record_retention.0,
            },
            interval,
            stop_rx.clone(),
        ));
        let router = self.router();
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let mut servers = tokio::task::JoinSet::new();
        // One cap for both listeners: it bounds the server, not a socket.
        let connections = Arc::new(tokio::sync::Semaphore::new(self.config.max_connections));
        if let Some(tcp) = listeners.tcp {
            let done = stopped(stop_rx.clone());
            let (app, conns) = (router.clone(), connections.clone());
            let tcp = Arc::new(tcp);
            let accept = move || {
                let tcp = tcp.clone();
                async move {
                    let (stream, _) = tcp.accept().await?;
                    // Answers are written in one go; do not let Nagle hold them.
                    let _ = stream.set_nodelay(true);
                    Ok((stream, api::auth::Peer::Tcp))
                }
            };
            servers.spawn(server::serve(accept, app, conns, done));
        }
        if let Some(unix) = listeners.unix {
            let done = stopped(stop_rx.clone());
            let unix = Arc::new(unix);
            let accept = move || {
                let unix = unix.clone();
                async move {
                    let (stream, _) = unix.accept().await?;
                    let peer = api::auth::peer_of(&stream);
                    Ok((stream, peer))
                }
            };
            servers.spawn(server::serve(accept, router, connections, done));
        }
        let mut first_error = None;
        tokio::select! {
            () = shutdown => {}
            Some(res) = servers.join_next() => first_error = res.ok().and_then(Result::err),
        }
        self.state.hub.waiters.close();
        let _ = stop_tx.send(true);
        while let Some(res) = servers.join_next().await {
            if let Ok(Err(e)) = res {
                first_error.get_or_insert(e);
            }
        }
        let _ = reconciler.await;
        self.state.unkept.drain(Duration::from_secs(5)).await;
        self.state.store.backend().close().await;
        if let Some(path) = &self.config.unix_socket {
            let _ = std::fs::remove_file(path);
        }
        first_error.map_or(Ok(()), |e| Err(StartError::Io(e)))
    }
}

/// The sockets a server answers on.
pub struct Listeners {
    pub tcp: Option<TcpListener>,
    pub unix: Option<tokio::net::UnixListener>,
}

fn bind_unix(path: &std::path::Path, mode: u32) -> Result<tokio::net::UnixListener, StartError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let failed = |source| StartError::Listen {
        on: path.display().to_string(),
        flag: "--unix-socket",
        source,
    };
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        // Stale only when nothing accepts on it: a live server's socket,
        // unlinked, would leave that server unreachable.
        match std::os::unix::net::UnixStream::connect(path) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path).map_err(failed)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Ok(_) => {
                return Err(failed(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    "a server is listening on it",
                )));
            }
            Err(e) => return Err(failed(e)),
        }
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(failed)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(failed)?;
    Ok(listener)
}
