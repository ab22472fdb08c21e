//! `/v1/leases`: parse, validate, call `Leases`, map the result.

use std::time::Duration;

use axum::Json;
use axum::extract::{Extension, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::auth::{Caller, Peer};
use super::error::{ApiError, Problem};
use super::extract::{Admin, Body, Params};
use super::idempotency::answer_in_tx;
use super::owner::{OwnerSpec, resolve_owner};
use super::paging;
use super::validate::{self, NAME_MAX, RESOURCE_MAX, TTL_MS, WAIT_MS};
use crate::leases::{Acquire, Acquired, LeaseError, Outcome, Reclaimed, Released};
use crate::model::{LeaseFilter, LeaseView, StateFilter};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(acquire_lease, list_leases))
        .routes(routes!(get_lease))
        .routes(routes!(renew_lease))
        .routes(routes!(activate_lease))
        .routes(routes!(release_lease))
        .routes(routes!(break_lease))
}

/// The parent lease a new lease is acquired under; it must be current.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ParentSpec {
    pub id: String,
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    /// 1..=512 bytes of UTF-8 without control characters.
    #[schema(
        example = "workspace/alpha",
        min_length = 1,
        max_length = 512,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$"
    )]
    pub resource: String,
    /// 1..=256 bytes of UTF-8 without control characters.
    #[schema(
        example = "supervisor-1",
        min_length = 1,
        max_length = 256,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$"
    )]
    pub holder: String,
    /// 1000..=86400000; required unless `owner` is given.
    #[schema(minimum = 1000, maximum = 86_400_000, example = 30000)]
    #[serde(default, deserialize_with = "crate::model::int::opt_i64")]
    pub ttl_ms: Option<i64>,
    pub owner: Option<OwnerSpec>,
    pub parent: Option<ParentSpec>,
    /// Create the lease in state `reserved`, to be activated later.
    #[serde(default)]
    pub reserve: bool,
    /// Wait up to this long (0..=60000) for a held lease to end.
    #[schema(minimum = 0, maximum = 60000)]
    #[serde(default, deserialize_with = "crate::model::int::opt_i64")]
    pub wait_ms: Option<i64>,
    #[schema(value_type = Option<crate::model::Metadata>)]
    pub metadata: Option<Map<String, Value>>,
}

/// The acquired lease; `reclaimed` only when this acquire ended the previous one.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AcquireResponse {
    #[serde(flatten)]
    pub lease: LeaseView,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub reclaimed: Option<Reclaimed>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
    /// New TTL; defaults to the lease's current one.
    #[schema(minimum = 1000, maximum = 86_400_000)]
    #[serde(default, deserialize_with = "crate::model::int::opt_i64")]
    pub ttl_ms: Option<i64>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ActivateRequest {
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
    /// The process the active lease is bound to; keeps the reserved one's owner when absent.
    pub owner: Option<OwnerSpec>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BreakRequest {
    /// Why the lease is broken; recorded as `broken:<reason>`. 1..=256 bytes of UTF-8 without control characters.
    #[schema(
        min_length = 1,
        max_length = 256,
        pattern = "^[^\\x00-\\x1F\\x7F-\\x9F]*$"
    )]
    pub reason: String,
}

#[derive(Debug, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Exact resource name.
    pub resource: Option<String>,
    /// Resource prefix, matched literally.
    pub prefix: Option<String>,
    pub holder: Option<String>,
    /// Id of the parent lease.
    #[param(format = "uuid")]
    pub parent: Option<String>,
    /// `current` (default), `ended` or `all`.
    pub state: Option<StateFilter>,
    /// 1..=1000, default 100.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page.
    #[param(format = "uuid")]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct LeaseList {
    pub items: Vec<LeaseView>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

/// Acquire a lease.
#[utoipa::path(
    post, path = "/v1/leases", tag = "leases",
    request_body = AcquireRequest,
    responses(
        (status = 201, description = "Acquired (with `reclaimed` when it took over)", body = AcquireResponse,
         headers(("Location" = String, description = "URL of the new lease"))),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`lease_held`, `owner_remote`, `owner_unverifiable`, `parent_fenced` or `identity_mismatch`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`validation` or `process_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`busy` or `unavailable`", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn acquire_lease(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Body(req): Body<AcquireRequest>,
) -> Result<Response, ApiError> {
    validate::text("resource", &req.resource, RESOURCE_MAX)?;
    validate::text("holder", &req.holder, NAME_MAX)?;
    if let Some(ttl) = req.ttl_ms {
        validate::in_range("ttl_ms", ttl, TTL_MS)?;
    } else if req.owner.is_none() {
        return Err(ApiError::validation(
            "ttl_ms",
            "ttl_ms is required when no owner is given",
        ));
    }
    let wait_ms = req.wait_ms.unwrap_or(0);
    validate::in_range("wait_ms", wait_ms, WAIT_MS)?;
    let parent = match req.parent {
        Some(p) => {
            validate::token("parent.token", p.token)?;
            let id = uuid::Uuid::parse_str(&p.id).map_err(|_| {
                ApiError::validation("parent.id", "parent.id must be a lease id (UUID)")
            })?;
            Some((id.hyphenated().to_string(), p.token))
        }
        None => None,
    };
    let metadata = validate::metadata(req.metadata)?;
    let owner = req
        .owner
        .map(|o| resolve_owner(state.leases.host(), o, "owner", &caller))
        .transpose()?;
    let cmd = Acquire {
        resource: req.resource,
        holder: req.holder,
        ttl_ms: req.ttl_ms,
        owner,
        parent,
        reserve: req.reserve,
        metadata,
    };
    let wait = Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0));
    answer_in_tx(move |out| {
        match out.downcast_ref::<Outcome<Acquired>>()? {
            Ok(a) => Some(acquired_answer(a.clone())),
            // It waits on, unless its time is up; the answer comes later.
            Err(LeaseError::Held(_)) if !wait.is_zero() => None,
            Err(e) => Some(ApiError::Lease(e.clone()).into_response()),
        }
    });
    Ok(acquired_answer(state.leases.acquire(cmd, wait).await?))
}

fn acquired_answer(acquired: Acquired) -> Response {
    let location = format!("/v1/leases/{}", acquired.lease.id);
    let body = AcquireResponse {
        lease: acquired.lease,
        reclaimed: acquired.reclaimed,
    };
    let headers = [(header::LOCATION, location)];
    (StatusCode::CREATED, headers, Json(body)).into_response()
}

/// Let the transaction of a lease operation answered with the lease (or
/// a refusal) keep that answer (`idempotency::answer_in_tx`), as the
/// handler's `Json` gives it.
fn answer_lease_in_tx() {
    answer_in_tx(|out| {
        let out = match out.downcast_ref::<Outcome<LeaseView>>() {
            Some(o) => o,
            None => &out.downcast_ref::<Released>()?.out,
        };
        Some(match out {
            Ok(lease) => Json(lease).into_response(),
            Err(e) => ApiError::Lease(e.clone()).into_response(),
        })
    });
}

/// Get one lease, current or ended.
#[utoipa::path(
    get, path = "/v1/leases/{id}", tag = "leases",
    params(("id" = String, Path, format = "uuid", description = "Lease id")),
    responses(
        (status = 200, description = "The lease, its owner judged now", body = LeaseView),
        (status = 404, description = "No such lease", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn get_lease(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<LeaseView>, ApiError> {
    let id = validate::id("lease", &id)?;
    let lease = state.leases.get(&id).await?;
    lease
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no lease with id {id}")))
}

/// List leases, newest first.
#[utoipa::path(
    get, path = "/v1/leases", tag = "leases",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of leases", body = LeaseList),
        (status = 422, description = "A bad parameter", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn list_leases(
    State(state): State<AppState>,
    Params(q): Params<ListQuery>,
) -> Result<Json<LeaseList>, ApiError> {
    let page = paging::page(q.limit, q.cursor, paging::id_cursor)?;
    let filter = LeaseFilter {
        resource: q.resource,
        prefix: q.prefix,
        holder: q.holder,
        parent: validate::id_filter("parent", q.parent)?,
        state: q.state.unwrap_or_default(),
        limit: page.fetch,
        before_id: page.after,
    };
    let leases = state.leases.list(&filter).await?;
    let (items, next_cursor) = paging::finish(leases, page.limit, |l| l.id.clone());
    Ok(Json(LeaseList { items, next_cursor }))
}

/// Renew a lease: a new `expires_at` from now.
#[utoipa::path(
    post, path = "/v1/leases/{id}/renew", tag = "leases",
    params(("id" = String, Path, format = "uuid", description = "Lease id")),
    request_body = RenewRequest,
    responses(
        (status = 200, description = "Renewed", body = LeaseView),
        (status = 404, description = "No such lease", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`fenced` or `parent_fenced`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid request", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn renew_lease(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Body(req): Body<RenewRequest>,
) -> Result<Json<LeaseView>, ApiError> {
    let id = validate::id("lease", &id)?;
    validate::token("token", req.token)?;
    if let Some(ttl) = req.ttl_ms {
        validate::in_range("ttl_ms", ttl, TTL_MS)?;
    }
    answer_lease_in_tx();
    Ok(Json(state.leases.renew(id, req.token, req.ttl_ms).await?))
}

/// Activate a reserved lease, binding it to its owner; the token stays.
#[utoipa::path(
    post, path = "/v1/leases/{id}/activate", tag = "leases",
    params(("id" = String, Path, format = "uuid", description = "Lease id")),
    request_body = ActivateRequest,
    responses(
        (status = 200, description = "Active", body = LeaseView),
        (status = 404, description = "No such lease", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`not_reserved`, `fenced`, `parent_fenced` or `identity_mismatch`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`validation` or `process_not_found`", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn activate_lease(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(req): Body<ActivateRequest>,
) -> Result<Json<LeaseView>, ApiError> {
    let id = validate::id("lease", &id)?;
    validate::token("token", req.token)?;
    let owner = req
        .owner
        .map(|o| resolve_owner(state.leases.host(), o, "owner", &caller))
        .transpose()?;
    answer_lease_in_tx();
    Ok(Json(state.leases.activate(id, req.token, owner).await?))
}

/// Release a lease. Releasing it again with the same token answers 200 again.
#[utoipa::path(
    post, path = "/v1/leases/{id}/release", tag = "leases",
    params(("id" = String, Path, format = "uuid", description = "Lease id")),
    request_body = ReleaseRequest,
    responses(
        (status = 200, description = "Released", body = LeaseView),
        (status = 404, description = "No such lease", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`fenced`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid request", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn release_lease(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Body(req): Body<ReleaseRequest>,
) -> Result<Json<LeaseView>, ApiError> {
    let id = validate::id("lease", &id)?;
    validate::token("token", req.token)?;
    answer_lease_in_tx();
    Ok(Json(state.leases.release(id, req.token).await?))
}

/// Break a current lease whatever its owner's status (admin only).
#[utoipa::path(
    post, path = "/v1/leases/{id}/break", tag = "leases",
    params(("id" = String, Path, format = "uuid", description = "Lease id")),
    request_body = BreakRequest,
    responses(
        (status = 200, description = "Broken", body = LeaseView),
        (status = 403, description = "Not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such lease", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`fenced`: the lease has already ended", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid request", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn break_lease(
    State(state): State<AppState>,
    Admin(caller): Admin,
    Path(id): Path<String>,
    Body(req): Body<BreakRequest>,
) -> Result<Json<LeaseView>, ApiError> {
    let id = validate::id("lease", &id)?;
    validate::text("reason", &req.reason, NAME_MAX)?;
    let by = match caller.peer {
        Peer::Unix { uid, pid, .. } => format!(
            "admin (uid {uid}, pid {})",
            pid.map_or("?".into(), |p| p.to_string())
        ),
        Peer::Tcp => "admin".to_owned(),
    };
    answer_lease_in_tx();
    Ok(Json(state.leases.break_lease(id, req.reason, by).await?))
}
