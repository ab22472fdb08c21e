//! `/v1/ports`: reservations of ports that bind on 127.0.0.1.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::error::{ApiError, Problem};
use super::extract::{Body, Params};
use super::idempotency::answer_in_tx;
use super::paging;
use super::validate;
use crate::model::{PortOwner, PortRecord, TokenRef};
use crate::ports::ops::PortError;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(reserve_ports, list_ports))
        .routes(routes!(release_port))
}

/// Exactly one of `process` or `lease`, with its current token.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerRef {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<TokenRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease: Option<TokenRef>,
}

/// The owner of new reservations: exactly one of `process` or `lease`,
/// with its current token.
#[derive(Debug, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // documents `OwnerRef`, whose two members are checked by hand
pub enum PortOwnerSpec {
    Process(ProcessOwner),
    Lease(LeaseOwner),
}

#[derive(Debug, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct ProcessOwner {
    process: TokenRef,
}

#[derive(Debug, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct LeaseOwner {
    lease: TokenRef,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReserveRequest {
    /// Names matching `[a-z][a-z0-9_]{0,31}`.
    #[schema(value_type = BTreeSet<crate::model::PortName>, min_items = 1, max_items = 64)]
    pub names: Vec<String>,
    #[schema(value_type = PortOwnerSpec)]
    pub owner: OwnerRef,
    /// Inclusive `[lowest, highest]` within 1024..=65535, lowest first; default `[20000, 29999]`.
    #[schema(value_type = Option<crate::model::PortRange>)]
    #[serde(default, deserialize_with = "crate::model::int::opt_port_pair")]
    pub range: Option<[u16; 2]>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Reserved {
    /// Port by name.
    #[schema(value_type = crate::model::PortMap)]
    pub ports: BTreeMap<String, u16>,
    pub reservations: Vec<PortRecord>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PortReleaseRequest {
    /// The owner's current token.
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
    /// The id of the lease or process the reservation belongs to. Tokens
    /// count per resource (every resource's first lease has token 1), so
    /// the token alone may be another owner's too; given, a reservation of
    /// any other owner is `409 fenced`. Send it.
    #[serde(default)]
    #[schema(format = "uuid")]
    pub owner_id: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page.
    #[param(format = "uuid")]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PortList {
    pub items: Vec<PortRecord>,
    pub next_cursor: Option<String>,
}

/// Reserve free ports for a lease or a process.
#[utoipa::path(
    post, path = "/v1/ports", tag = "ports",
    request_body = ReserveRequest,
    responses(
        (status = 201, description = "Reserved: the ports by name and their reservations", body = Reserved),
        (status = 404, description = "No such owner", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`fenced` or `ports_exhausted`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid request", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn reserve_ports(
    State(state): State<AppState>,
    Body(req): Body<ReserveRequest>,
) -> Result<Response, ApiError> {
    if req.names.is_empty() || req.names.len() > 64 {
        return Err(ApiError::validation(
            "names",
            "names must have 1 to 64 entries",
        ));
    }
    for (i, name) in req.names.iter().enumerate() {
        if !crate::model::valid_port_name(name) {
            return Err(ApiError::validation(
                format!("names.{i}"),
                "a port name must match [a-z][a-z0-9_]{0,31}",
            ));
        }
        if req.names[..i].contains(name) {
            return Err(ApiError::validation(
                format!("names.{i}"),
                format!("{name:?} is given twice"),
            ));
        }
    }
    let owner = match (req.owner.process, req.owner.lease) {
        (Some(p), None) => PortOwner {
            process: Some(p),
            lease: None,
        },
        (None, Some(l)) => PortOwner {
            process: None,
            lease: Some(l),
        },
        _ => {
            return Err(ApiError::validation(
                "owner",
                "owner must name exactly one of process or lease",
            ));
        }
    };
    if let Some(t) = owner.target() {
        validate::token("owner.token", t.token)?;
        if uuid::Uuid::parse_str(&t.id).is_err() {
            return Err(ApiError::validation("owner.id", "owner id must be a UUID"));
        }
    }
    let range = match req.range {
        Some([a, b]) if crate::model::PORTS_ALLOWED.contains(&a) && a <= b => a..=b,
        Some([a, b]) if a > b => {
            return Err(ApiError::validation(
                "range",
                format!("range must be [lowest, highest]: {a} is above {b}"),
            ));
        }
        Some(_) => {
            return Err(ApiError::validation(
                "range",
                "range must be two ports within 1024..=65535",
            ));
        }
        None => crate::model::DEFAULT_PORT_RANGE,
    };
    answer_in_tx(|out| {
        let out = out.downcast_ref::<Result<Vec<PortRecord>, PortError>>()?;
        Some(match out {
            Ok(reservations) => reserved_answer(reservations.clone()),
            Err(e) => ApiError::Port(e.clone()).into_response(),
        })
    });
    let reservations = state.ports.reserve(owner, req.names, range).await?;
    Ok(reserved_answer(reservations))
}

fn reserved_answer(reservations: Vec<PortRecord>) -> Response {
    let ports = reservations
        .iter()
        .map(|r| (r.name.clone(), r.port))
        .collect();
    let body = Reserved {
        ports,
        reservations,
    };
    (StatusCode::CREATED, Json(body)).into_response()
}

/// Current reservations, newest first.
#[utoipa::path(
    get, path = "/v1/ports", tag = "ports",
    params(ListQuery),
    responses((status = 200, description = "A page of current reservations", body = PortList))
)]
async fn list_ports(
    State(state): State<AppState>,
    Params(q): Params<ListQuery>,
) -> Result<Json<PortList>, ApiError> {
    let page = paging::page(q.limit, q.cursor, paging::id_cursor)?;
    let items = state
        .store
        .backend()
        .list_ports(
            Some(&state.ports.host_id()),
            page.after.as_deref(),
            page.fetch,
        )
        .await?;
    let (items, next_cursor) = paging::finish(items, page.limit, |p| p.id.clone());
    Ok(Json(PortList { items, next_cursor }))
}

/// Release a reservation with its owner's token.
#[utoipa::path(
    post, path = "/v1/ports/{port}/release", tag = "ports",
    params(("port" = u16, Path, description = "The reserved port")),
    request_body = PortReleaseRequest,
    responses(
        (status = 200, description = "Released: the reservation, ended", body = PortRecord),
        (status = 404, description = "No current reservation of that port", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`fenced`", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn release_port(
    State(state): State<AppState>,
    Path(port): Path<String>,
    Body(req): Body<PortReleaseRequest>,
) -> Result<Json<PortRecord>, ApiError> {
    let port: u16 = port
        .parse()
        .map_err(|_| ApiError::NotFound(format!("no reservation of port {port:?}")))?;
    validate::token("token", req.token)?;
    let owner_id = match &req.owner_id {
        Some(id) => Some(validate::uuid(id).ok_or_else(|| {
            ApiError::validation(
                "owner_id",
                "owner_id must be the id (a UUID) of the lease or process the port is reserved for",
            )
        })?),
        None => None,
    };
    answer_in_tx(|out| {
        let out = out.downcast_ref::<Result<PortRecord, PortError>>()?;
        Some(match out {
            Ok(released) => Json(released).into_response(),
            Err(e) => ApiError::Port(e.clone()).into_response(),
        })
    });
    Ok(Json(state.ports.release(port, req.token, owner_id).await?))
}
