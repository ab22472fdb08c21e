//! `/v1/processes`: parse, validate, call `Processes`, map the result.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::Json;
use axum::extract::{Extension, Path, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, Problem};
use super::extract::{Body, Params};
use super::idempotency::answer_in_tx;
use super::owner::{OwnerSpec, resolve_owner};
use super::paging;
use super::validate::{self, NAME_MAX, TTL_MS};
use crate::model::{
    Command, ProcessFilter, ProcessRecord, ProcessState, ProcessView, StateFilter, TokenRef,
};
use crate::processes::ops::{Finish, Outcome, StopStart};
use crate::processes::stop::StopParams;
use crate::processes::{CreateRequest, DEFAULT_GRACE, Error as ProcessesError, SpawnFailure};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_process, list_processes))
        .routes(routes!(get_process))
        .routes(routes!(confirm_process))
        .routes(routes!(heartbeat_process))
        .routes(routes!(stop_process))
        .routes(routes!(finish_process))
        .routes(routes!(get_process_logs))
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateProcessRequest {
    /// 1..=256 bytes of UTF-8 without control characters.
    #[schema(
        example = "dev-server",
        min_length = 1,
        max_length = 256,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$"
    )]
    pub kind: String,
    /// At most one current process per operation id; 1..=256 bytes of UTF-8 without control characters.
    #[schema(
        min_length = 1,
        max_length = 256,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$"
    )]
    pub operation_id: Option<String>,
    /// The owning lease; it must be current.
    pub lease: Option<TokenRef>,
    /// The process whose heartbeats keep this one.
    pub owner: Option<OwnerSpec>,
    /// Heartbeat TTL, 1000..=86400000.
    #[schema(minimum = 1000, maximum = 86_400_000)]
    #[serde(default, deserialize_with = "crate::model::int::opt_i64")]
    pub ttl_ms: Option<i64>,
    /// Spawn this command; without it the record is registered as `starting`.
    pub command: Option<CommandSpec>,
    /// Port names to reserve; a spawned child gets `PORT_<NAME>` (and `PORT` for the first).
    #[schema(value_type = Option<BTreeSet<crate::model::PortName>>)]
    pub ports: Option<Vec<String>>,
    #[schema(value_type = Option<crate::model::Metadata>)]
    pub metadata: Option<Map<String, Value>>,
}

/// What to spawn.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommandSpec {
    /// Program and arguments; no shell is involved.
    #[schema(example = json!(["npm", "run", "dev"]))]
    pub argv: Vec<String>,
    /// Working directory; the server's own when absent.
    pub cwd: Option<String>,
    /// Added to the server's environment (without its `HOLDFAST_*` variables).
    pub env: Option<BTreeMap<String, String>>,
}

impl From<CommandSpec> for Command {
    fn from(c: CommandSpec) -> Self {
        Command {
            argv: c.argv,
            cwd: c.cwd,
            env: c.env.unwrap_or_default(),
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConfirmRequest {
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
    #[schema(minimum = 1, maximum = 2_147_483_647)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub pid: i64,
    /// The process leads its own process group, which stop then signals.
    #[serde(default)]
    pub process_group: bool,
    /// The start time the client saw (`/proc/<pid>/stat` field 22, as
    /// identities show it): a process at `pid` now with another one is
    /// not the client's (its child died and the pid was given again) and
    /// the confirm is `409 identity_mismatch`, nothing recorded.
    #[serde(default)]
    #[schema(example = "8879")]
    pub start_time: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
    #[schema(minimum = 1000, maximum = 86_400_000)]
    #[serde(default, deserialize_with = "crate::model::int::opt_i64")]
    pub ttl_ms: Option<i64>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StopRequest {
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
    /// How long to wait after SIGTERM (default 5000, at most 600000).
    #[schema(minimum = 0, maximum = 600_000)]
    #[serde(default, deserialize_with = "crate::model::int::opt_i64")]
    pub grace_ms: Option<i64>,
    /// SIGKILL after the grace period (default true).
    pub force: Option<bool>,
    /// 1..=256 bytes of UTF-8 without control characters.
    #[schema(
        min_length = 1,
        max_length = 256,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$"
    )]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishState {
    Stopped,
    Failed,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FinishRequest {
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
    pub state: FinishState,
    /// 1..=256 bytes of UTF-8 without control characters.
    #[schema(
        min_length = 1,
        max_length = 256,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$"
    )]
    pub reason: Option<String>,
    #[serde(default, deserialize_with = "crate::model::int::opt_i32")]
    pub exit_code: Option<i32>,
    /// With the admin token only (`403 forbidden` otherwise): `true` ends a
    /// record of another host, which is `409 remote_process` without it.
    /// Only that host can tell whether the process still runs: say it of a
    /// host gone for good, whose records would otherwise keep their
    /// operation ids and ports. Nothing is signalled; the event's `detail`
    /// is `{"host_gone": true}`. A record of another PID namespace on this
    /// host stays `remote_process`.
    pub host_gone: Option<bool>,
}

#[derive(Debug, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// `current` (default), `ended` or `all`.
    pub state: Option<StateFilter>,
    pub kind: Option<String>,
    pub operation_id: Option<String>,
    /// Id of the owning lease.
    #[param(format = "uuid")]
    pub lease: Option<String>,
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    #[param(format = "uuid")]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ProcessList {
    pub items: Vec<ProcessView>,
    pub next_cursor: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    #[default]
    Stdout,
    Stderr,
}

#[derive(Debug, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LogsQuery {
    pub stream: Option<Stream>,
    #[param(minimum = 0)]
    pub offset: Option<i64>,
    /// At most 1 MiB (default 65536).
    #[param(minimum = 1, maximum = 1_048_576)]
    pub limit: Option<i64>,
}

const LOG_LIMIT_MAX: i64 = 1 << 20;

fn positive_token(t: i64) -> Result<i64, ApiError> {
    validate::token("token", t).map(|()| t)
}

fn process_id(id: &str) -> Result<String, ApiError> {
    validate::id("process", id)
}

/// Spawn or register a process.
#[utoipa::path(
    post, path = "/v1/processes", tag = "processes",
    request_body = CreateProcessRequest,
    responses(
        (status = 201, description = "Spawned (`running`) or registered (`starting`)", body = ProcessView,
         headers(("Location" = String, description = "URL of the process"))),
        (status = 409, description = "`operation_in_progress`, `parent_fenced`, `ports_exhausted`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`validation` (e.g. a program that cannot be executed)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`busy` or `unavailable`", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn create_process(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Body(req): Body<CreateProcessRequest>,
) -> Result<impl IntoResponse, ApiError> {
    validate::text("kind", &req.kind, NAME_MAX)?;
    if let Some(op) = &req.operation_id {
        validate::text("operation_id", op, NAME_MAX)?;
    }
    if let Some(ttl) = req.ttl_ms {
        validate::in_range("ttl_ms", ttl, TTL_MS)?;
    }
    if let Some(l) = &req.lease {
        validate::token("lease.token", l.token)?;
        validate::id("lease", &l.id)
            .map_err(|_| ApiError::validation("lease.id", "lease.id must be a lease id (UUID)"))?;
    }
    let command = req.command.map(Command::from);
    if let Some(cmd) = &command {
        validate::command(cmd)?;
    }
    let ports = req.ports.unwrap_or_default();
    for (i, name) in ports.iter().enumerate() {
        if !crate::model::valid_port_name(name) {
            return Err(ApiError::validation(
                format!("ports.{i}"),
                "a port name must match [a-z][a-z0-9_]{0,31}",
            ));
        }
        if ports[..i].contains(name) {
            return Err(ApiError::validation(
                format!("ports.{i}"),
                format!("port name {name:?} is given twice"),
            ));
        }
    }
    let metadata = validate::metadata(req.metadata)?;
    let owner = req
        .owner
        .map(|o| resolve_owner(state.processes.host(), o, "owner", &caller))
        .transpose()?;
    let create = CreateRequest {
        kind: req.kind,
        operation_id: req.operation_id,
        lease: req.lease,
        owner,
        ttl_ms: req.ttl_ms,
        metadata,
        command,
        ports,
    };
    answer_create_in_tx();
    let view = state
        .processes
        .create(create, crate::model::DEFAULT_PORT_RANGE, caller)
        .await?;
    Ok(created(view))
}

/// Get one process, its identity judged now.
#[utoipa::path(
    get, path = "/v1/processes/{id}", tag = "processes",
    params(("id" = String, Path, format = "uuid", description = "Process id")),
    responses(
        (status = 200, description = "The process, its identity judged now", body = ProcessView),
        (status = 404, description = "No such process", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn get_process(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ProcessView>, ApiError> {
    let id = process_id(&id)?;
    let view = state.processes.get(&id).await?;
    view.map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no process with id {id}")))
}

/// List processes, newest first.
#[utoipa::path(
    get, path = "/v1/processes", tag = "processes",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of processes", body = ProcessList),
        (status = 422, description = "A bad parameter", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn list_processes(
    State(state): State<AppState>,
    Params(q): Params<ListQuery>,
) -> Result<Json<ProcessList>, ApiError> {
    let page = paging::page(q.limit, q.cursor, paging::id_cursor)?;
    let filter = ProcessFilter {
        state: q.state.unwrap_or_default(),
        kind: q.kind,
        operation_id: q.operation_id,
        lease: validate::id_filter("lease", q.lease)?,
        limit: page.fetch,
        before_id: page.after,
    };
    let processes = state.processes.list(&filter).await?;
    let (items, next_cursor) = paging::finish(processes, page.limit, |p| p.id.clone());
    Ok(Json(ProcessList { items, next_cursor }))
}

/// Confirm a registered process: `starting` becomes `running` with the identity read now.
#[utoipa::path(
    post, path = "/v1/processes/{id}/confirm", tag = "processes",
    params(("id" = String, Path, format = "uuid", description = "Process id")),
    request_body = ConfirmRequest,
    responses(
        (status = 200, description = "Confirmed: `running`, with the identity read now", body = ProcessView),
        (status = 403, description = "pid 1, the server itself, its group or session", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such process", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`fenced`, or `identity_mismatch` (the pid is another process than the one whose `start_time` was sent)", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`process_not_found` or `validation`", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn confirm_process(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(req): Body<ConfirmRequest>,
) -> Result<Json<ProcessView>, ApiError> {
    let id = process_id(&id)?;
    let token = positive_token(req.token)?;
    let pid = i32::try_from(req.pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::validation("pid", "pid must be a positive process id"))?;
    answer_process_in_tx();
    Ok(Json(
        state
            .processes
            .confirm(
                id,
                token,
                pid,
                req.start_time.as_deref(),
                req.process_group,
                caller,
            )
            .await?,
    ))
}

/// Keep a process alive: a new `expires_at`.
#[utoipa::path(
    post, path = "/v1/processes/{id}/heartbeat", tag = "processes",
    params(("id" = String, Path, format = "uuid", description = "Process id")),
    request_body = HeartbeatRequest,
    responses(
        (status = 200, description = "Heartbeat recorded: a new `expires_at`", body = ProcessView),
        (status = 404, description = "No such process", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`fenced`", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn heartbeat_process(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Body(req): Body<HeartbeatRequest>,
) -> Result<Json<ProcessView>, ApiError> {
    let id = process_id(&id)?;
    let token = positive_token(req.token)?;
    if let Some(ttl) = req.ttl_ms {
        validate::in_range("ttl_ms", ttl, TTL_MS)?;
    }
    answer_process_in_tx();
    Ok(Json(
        state.processes.heartbeat(id, token, req.ttl_ms).await?,
    ))
}

/// Stop a process and its group: SIGTERM, grace, SIGKILL when forced.
#[utoipa::path(
    post, path = "/v1/processes/{id}/stop", tag = "processes",
    params(("id" = String, Path, format = "uuid", description = "Process id")),
    request_body = StopRequest,
    responses(
        (status = 200, description = "Stopped (or already ended, as it is)", body = ProcessView),
        (status = 403, description = "Not a process the server may signal", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such process", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`fenced`, `identity_mismatch`, `remote_process`, `process_tree_not_settled`", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn stop_process(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(req): Body<StopRequest>,
) -> Result<Json<ProcessView>, ApiError> {
    let id = process_id(&id)?;
    let token = positive_token(req.token)?;
    let grace = match req.grace_ms {
        Some(ms) => {
            validate::in_range("grace_ms", ms, 0..=600_000)?;
            Duration::from_millis(u64::try_from(ms).unwrap_or(0))
        }
        None => DEFAULT_GRACE,
    };
    if let Some(r) = &req.reason {
        validate::text("reason", r, NAME_MAX)?;
    }
    let params = StopParams {
        grace,
        force: req.force.unwrap_or(true),
        reason: req.reason.unwrap_or_else(|| "stopped".into()),
    };
    answer_process_in_tx();
    Ok(Json(state.processes.stop(id, token, params, caller).await?))
}

/// Report how a process the client ran itself ended.
#[utoipa::path(
    post, path = "/v1/processes/{id}/finish", tag = "processes",
    params(("id" = String, Path, format = "uuid", description = "Process id")),
    request_body = FinishRequest,
    responses(
        (status = 200, description = "Finished: the process ended as reported (or as it is, when it already had)", body = ProcessView),
        (status = 403, description = "`forbidden`: `host_gone` without the admin token, or the Host / Origin is refused", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such process", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`fenced`, `process_alive`, or `remote_process` (it runs on another host, which alone can tell whether it still runs; the admin token may end it with `host_gone`)", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn finish_process(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(req): Body<FinishRequest>,
) -> Result<Json<ProcessView>, ApiError> {
    let id = process_id(&id)?;
    let token = positive_token(req.token)?;
    let host_gone = req.host_gone == Some(true);
    if host_gone && !caller.admin {
        return Err(ApiError::Forbidden(
            "only the admin token may say a host is gone (host_gone)".into(),
        ));
    }
    if let Some(r) = &req.reason {
        validate::text("reason", r, NAME_MAX)?;
    }
    let target = match req.state {
        FinishState::Stopped => ProcessState::Stopped,
        FinishState::Failed => ProcessState::Failed,
    };
    answer_process_in_tx();
    Ok(Json(
        state
            .processes
            .finish(
                id,
                token,
                Finish {
                    state: target,
                    reason: req.reason,
                    exit_code: req.exit_code,
                    host_gone,
                },
            )
            .await?,
    ))
}

fn created(view: ProcessView) -> impl IntoResponse {
    let location = format!("/v1/processes/{}", view.id);
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(view),
    )
}

/// Let the last transaction of a spawn or registration keep its answer
/// (`idempotency::answer_in_tx`), as `create_process` gives it: a
/// registration's or a refusal's is its first, a spawn's the one that
/// records its started child or ends its record after a failure.
fn answer_create_in_tx() {
    answer_in_tx(|out| {
        if let Some(made) = out.downcast_ref::<Outcome<(ProcessRecord, BTreeMap<String, u16>)>>() {
            return match made {
                Err(e) => Some(ApiError::Proc(e.clone()).into_response()),
                Ok((rec, _)) if rec.spawned => None,
                // Without an identity: nothing to judge.
                Ok((rec, ports)) => {
                    let view = ProcessView::new(rec.clone(), None, ports.clone());
                    Some(created(view).into_response())
                }
            };
        }
        if let Some(started) = out.downcast_ref::<Outcome<ProcessView>>() {
            return Some(match started {
                Ok(view) => created(view.clone()).into_response(),
                Err(e) => ApiError::Proc(e.clone()).into_response(),
            });
        }
        let failed = out.downcast_ref::<SpawnFailure>()?;
        Some(ApiError::from(ProcessesError::from(failed.clone())).into_response())
    });
}

/// Let the last transaction of a request on a process keep its answer
/// (`idempotency::answer_in_tx`): the process, or a refusal, as the
/// handler's `Json` gives it. A stop's first transaction is its last only
/// when there is nothing to signal.
fn answer_process_in_tx() {
    answer_in_tx(|out| {
        let out = match out.downcast_ref::<Outcome<ProcessView>>() {
            Some(o) => o.as_ref(),
            None => match out.downcast_ref::<Outcome<StopStart>>()? {
                Ok(StopStart::Done(view)) => Ok(view),
                Ok(StopStart::Signal(_)) => return None,
                Err(e) => Err(e),
            },
        };
        Some(match out {
            Ok(view) => Json(view).into_response(),
            Err(e) => ApiError::Proc(e.clone()).into_response(),
        })
    });
}

/// Raw output of a spawned process, from `offset`, with `X-Next-Offset`.
#[utoipa::path(
    get, path = "/v1/processes/{id}/logs", tag = "processes",
    params(("id" = String, Path, format = "uuid", description = "Process id"), LogsQuery),
    responses(
        (status = 200, description = "Raw bytes", body = String, content_type = "text/plain",
         headers(("X-Next-Offset" = u64, description = "Offset to ask for next"))),
        (status = 404, description = "No such process, or it was not spawned", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A bad parameter", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn get_process_logs(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Params(q): Params<LogsQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let id = process_id(&id)?;
    let offset = q.offset.unwrap_or(0);
    validate::in_range("offset", offset, 0..=i64::MAX)?;
    let limit = q.limit.unwrap_or(65_536);
    validate::in_range("limit", limit, 1..=LOG_LIMIT_MAX)?;
    let logs = state
        .processes
        .logs(&id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no spawned process with id {id}")))?;
    let path = match q.stream.unwrap_or_default() {
        Stream::Stdout => logs.stdout,
        Stream::Stderr => logs.stderr,
    };
    let (offset, limit) = (
        u64::try_from(offset).unwrap_or(0),
        u64::try_from(limit).unwrap_or(0),
    );
    let bytes =
        tokio::task::spawn_blocking(move || read_range(std::path::Path::new(&path), offset, limit))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?
            .map_err(|e| ApiError::Internal(format!("reading the log: {e}")))?;
    let next = offset + bytes.len() as u64;
    Ok((
        [
            (header::CONTENT_TYPE, "text/plain; charset=utf-8".to_owned()),
            (
                header::HeaderName::from_static("x-next-offset"),
                next.to_string(),
            ),
        ],
        bytes,
    ))
}

fn read_range(path: &std::path::Path, offset: u64, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    // Past the end there is nothing to read; seeking there may even fail
    // (EINVAL past the filesystem's largest file size).
    if offset >= file.metadata()?.len() {
        return Ok(Vec::new());
    }
    file.seek(SeekFrom::Start(offset))?;
    let mut out = Vec::new();
    file.take(limit).read_to_end(&mut out)?;
    Ok(out)
}
