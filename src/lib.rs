//! holdfast: exclusive leases with fencing tokens, over HTTP/JSON.
//!
//! `App::build` opens the store and wires the parts; `serve` runs the HTTP
//! server and the reconciler until a shutdown signal.

pub mod api;
pub mod config;
pub mod events;
pub mod host;
pub mod leases;
pub mod metrics;
pub mod model;
pub mod ports;
pub mod processes;
pub mod reconcile;
pub mod store;
pub mod time;
pub mod waiters;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use config::{Config, Database};
use host::{Host, LocalFacts, ProcHost};
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
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
}

/// A built service: its state and the configuration it was built from.
pub struct App {
    pub state: api::AppState,
    pub config: Config,
}

impl App {
    pub async fn build(config: Config) -> Result<Self, StartError> {
        if !cfg!(target_os = "linux") {
            return Err(StartError::Config(
                "holdfast needs Linux (/proc, pidfd, process groups)".into(),
            ));
        }
        let facts = LocalFacts::read(config.host_id.clone()).map_err(StartError::Host)?;
        let host: Arc<dyn Host> = Arc::new(ProcHost::new(facts.clone()));
        let Database::Sqlite(path) = config.database().map_err(StartError::Config)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StartError::DataDir {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let hub = Arc::new(Hub::new(0));
        let backend = SqliteStore::open(&path, &facts.boot_id, time::now_ms(), hub.clone())?;
        let store = Store::new(Arc::new(backend));
        hub.event_committed(store.backend().last_event_seq().await?);
        let metrics = Arc::new(metrics::Metrics::default());
        let leases = leases::Leases::new(
            store.clone(),
            host.clone(),
            hub.waiters.clone(),
            metrics.clone(),
        );
        let reaper = host::spawn::Reaper::start()?;
        let data_dir = config.data_dir();
        let processes = processes::Processes::new(store.clone(), host.clone(), reaper, &data_dir)
            .map_err(|source| StartError::DataDir {
            path: data_dir.display().to_string(),
            source,
        })?;
        let ports = ports::Ports::new(store.clone(), host);
        let state = api::AppState {
            leases,
            processes,
            ports,
            store,
            hub,
            metrics,
            openapi: Arc::new(api::openapi_json()),
        };
        Ok(Self { state, config })
    }

    pub fn router(&self) -> axum::Router {
        api::router(self.state.clone())
    }

    /// Serve on `listener` until `shutdown` resolves, with the reconciler
    /// running beside; then close the store.
    pub async fn serve(
        self,
        listener: TcpListener,
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
            },
            interval,
            stop_rx,
        ));
        let router = self.router();
        let served = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await;
        let _ = stop_tx.send(true);
        let _ = reconciler.await;
        self.state.store.backend().close().await;
        served.map_err(StartError::Io)
    }
}
