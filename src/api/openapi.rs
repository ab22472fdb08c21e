//! The OpenAPI document: generated from the routes and their types, then
//! completed with what the derive cannot know: the bearer scheme and which
//! paths are open, the refusals every operation can meet, and that a
//! returned record never omits a member.

use std::collections::BTreeSet;

use utoipa::OpenApi;
use utoipa::openapi::path::Operation;
use utoipa::openapi::schema::{ArrayItems, Schema};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi as Document, Ref, RefOr, ResponseBuilder};

/// The security scheme's name in the document.
const BEARER: &str = "bearer";
/// Paths served without a token.
const OPEN_PATHS: &[&str] = &["/healthz", "/readyz", "/openapi.json"];

#[derive(OpenApi)]
#[openapi(
    info(
        title = "holdfast",
        description = "Exclusive leases with fencing tokens, a registry of managed processes, and port reservations.",
        license(name = "MIT OR Apache-2.0", identifier = "MIT OR Apache-2.0")
    ),
    servers((url = "http://127.0.0.1:7427", description = "The default listen address")),
    tags(
        (name = "leases", description = "Exclusive, fenced ownership of named resources"),
        (name = "processes", description = "Processes spawned or registered, watched and stopped safely"),
        (name = "ports", description = "Port reservations that do not collide"),
        (name = "events", description = "The ordered log of state changes"),
        (name = "service", description = "Health, readiness, metrics and this document"),
    ),
    // Types named only in parameters or by `value_type` are registered here.
    components(schemas(
        crate::model::StateFilter,
        crate::model::EventType,
        crate::model::Metadata,
        crate::model::PortMap,
        super::processes::Stream,
        super::error::Code,
        super::events::SseData,
    ))
)]
pub(super) struct ApiDoc;

/// The OpenAPI document, generated from the routes themselves.
pub fn openapi() -> Document {
    let mut doc = super::routes().split_for_parts().1;
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    add_security(&mut doc);
    add_common_refusals(&mut doc);
    add_idempotency_key(&mut doc);
    add_response_headers(&mut doc);
    describe_sse_data(&mut doc);
    require_sent_members(&mut doc);
    doc
}

/// The OpenAPI document as served and checked in.
pub fn openapi_json() -> String {
    let mut text = openapi().to_pretty_json().unwrap_or_default();
    text.push('\n');
    text
}

/// Every operation with its path and whether it is a POST (the API has
/// only GETs and POSTs).
fn operations(doc: &mut Document) -> impl Iterator<Item = (&String, bool, &mut Operation)> {
    doc.paths.paths.iter_mut().flat_map(|(path, item)| {
        [(false, &mut item.get), (true, &mut item.post)]
            .into_iter()
            .filter_map(move |(post, op)| op.as_mut().map(|op| (path, post, op)))
    })
}

/// Every `/v1` operation and `/metrics` need the bearer token when one is
/// configured; the health checks and this document never do.
fn add_security(doc: &mut Document) {
    let mut http = Http::new(HttpAuthScheme::Bearer);
    http.description = Some(
        "The token of `--auth-token-file` (or `--admin-token-file`); not needed when the server has none configured."
            .into(),
    );
    doc.components
        .get_or_insert_with(Default::default)
        .add_security_scheme(BEARER, SecurityScheme::Http(http));
    doc.security = Some(vec![SecurityRequirement::new(BEARER, Vec::<String>::new())]);
    for (path, _, op) in operations(doc) {
        if OPEN_PATHS.contains(&path.as_str()) {
            op.security = Some(Vec::new());
        }
    }
}

/// Refusals any operation can meet, documented once here rather than on
/// each path: (status, description, only with a request body, only with a token).
const COMMON: &[(&str, &str, bool, bool)] = &[
    (
        "400",
        "`malformed_json`: the body is not a JSON object",
        true,
        false,
    ),
    (
        "401",
        "`unauthorized`: a token is configured and the bearer token is missing or wrong",
        false,
        true,
    ),
    (
        "403",
        "`forbidden`: the caller may not do this, or the Host / Origin is refused",
        false,
        false,
    ),
    ("405", "`method_not_allowed`", false, false),
    (
        "413",
        "`payload_too_large`: the body is over 64 KiB",
        true,
        false,
    ),
    (
        "415",
        "`unsupported_media_type`: the body is not sent as JSON",
        true,
        false,
    ),
    (
        "422",
        "`validation`: a member or parameter is missing, of the wrong type or out of range",
        false,
        false,
    ),
    (
        "431",
        "`headers_too_large`: the request headers are over 16 KiB",
        false,
        false,
    ),
    (
        "503",
        "`busy` (with Retry-After) or `unavailable`",
        false,
        false,
    ),
];

/// An SSE message's `data` is the JSON text of an `SseData`: said with
/// JSON Schema's keywords for a string's content, which the derive has no
/// attribute for.
fn describe_sse_data(doc: &mut Document) {
    let Some(components) = doc.components.as_mut() else {
        return;
    };
    if let Some(RefOr::T(Schema::Object(message))) = components.schemas.get_mut("SseMessage")
        && let Some(RefOr::T(Schema::Object(data))) = message.properties.get_mut("data")
    {
        data.content_media_type = "application/json".to_owned();
        data.content_schema = Some(Box::new(Ref::from_schema_name("SseData").into()));
    }
}

/// Headers the middleware sets, which no route declares: a generated
/// client shows only the headers the document names.
fn add_response_headers(doc: &mut Document) {
    use utoipa::openapi::header::HeaderBuilder;
    use utoipa::openapi::{ObjectBuilder, Type};
    let header = |ty: Type, description: &str| {
        HeaderBuilder::new()
            .schema(Some(ObjectBuilder::new().schema_type(ty).build()))
            .description(Some(description))
            .build()
    };
    for (_, post, op) in operations(doc) {
        for (status, response) in &mut op.responses.responses {
            let RefOr::T(response) = response else {
                continue;
            };
            let added = match status.as_str() {
                "503" => (
                    "Retry-After",
                    header(Type::Integer, "Seconds to wait before trying again."),
                ),
                "401" => ("WWW-Authenticate", header(Type::String, "`Bearer`.")),
                s if post && s.starts_with('2') => (
                    "Idempotent-Replayed",
                    header(
                        Type::String,
                        "`true` when this is the stored answer of an earlier request with the same \
                         `Idempotency-Key`; absent otherwise.",
                    ),
                ),
                _ => continue,
            };
            response
                .headers
                .insert(added.0.to_owned(), RefOr::T(added.1));
        }
    }
}

/// Every POST takes an `Idempotency-Key` (see `api::idempotency`).
fn add_idempotency_key(doc: &mut Document) {
    use utoipa::openapi::path::{ParameterBuilder, ParameterIn};
    use utoipa::openapi::{ObjectBuilder, Required, Type};
    const IN_PROGRESS: &str =
        "`request_in_progress`: a request with the same Idempotency-Key is still being answered";
    for item in doc.paths.paths.values_mut() {
        let Some(op) = item.post.as_mut() else {
            continue;
        };
        let schema = ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(128))
            .pattern(Some("^[\\x20-\\x7E]+$"))
            .build();
        let header = ParameterBuilder::new()
            .name("Idempotency-Key")
            .parameter_in(ParameterIn::Header)
            .required(Required::False)
            .description(Some(
                "Makes the request safe to retry: a repeat with the same key, method, path and \
                 body within 24 hours answers the first answer again (with `Idempotent-Replayed: \
                 true`) and does nothing; the key with another request is `422 validation` \
                 (`field: \"Idempotency-Key\"`).",
            ))
            .schema(Some(schema))
            .build();
        op.parameters
            .get_or_insert_with(Vec::new)
            .push(RefOr::T(header));
        match op.responses.responses.get_mut("409") {
            Some(RefOr::T(r)) => {
                r.description = format!("{}; {IN_PROGRESS}", r.description);
            }
            Some(RefOr::Ref(_)) => {}
            None => {
                let problem = ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("Problem")))
                    .build();
                op.responses.responses.insert(
                    "409".to_owned(),
                    RefOr::T(
                        ResponseBuilder::new()
                            .description(IN_PROGRESS)
                            .content("application/problem+json", problem)
                            .build(),
                    ),
                );
            }
        }
    }
}

fn add_common_refusals(doc: &mut Document) {
    for (path, _, op) in operations(doc) {
        let has_body = op.request_body.is_some();
        let open = OPEN_PATHS.contains(&path.as_str());
        for (code, what, body_only, token_only) in COMMON {
            if (*body_only && !has_body) || (*token_only && open) {
                continue;
            }
            let problem = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("Problem")))
                .build();
            op.responses
                .responses
                .entry((*code).to_owned())
                .or_insert_with(|| {
                    ResponseBuilder::new()
                        .description(*what)
                        .content("application/problem+json", problem)
                        .into()
                });
        }
    }
}

/// The contract: "Fields of a returned record are never omitted: an unknown
/// or absent value is `null`." So every member of every object schema a
/// successful answer reaches is `required` (nullable where it can be null).
/// Members of composed (`allOf`) schemas are left as derived: that is where
/// `reclaimed` is, which is sent only by the acquire that took over. Nor
/// are two answers that are no records, though a 2xx reaches them: a
/// Problem (the event stream's `error` message carries one), whose
/// extension members come with the codes that have them, and the stream's
/// frame, whose `id` an `error` message has none of.
fn require_sent_members(doc: &mut Document) {
    let names = reached_by_success(doc);
    let Some(components) = doc.components.as_mut() else {
        return;
    };
    for name in names
        .into_iter()
        .filter(|n| !["Problem", "SseMessage"].contains(&n.as_str()))
    {
        if let Some(RefOr::T(Schema::Object(obj))) = components.schemas.get_mut(&name) {
            obj.required = obj.properties.keys().cloned().collect();
        }
    }
}

/// Names of the component schemas that 2xx responses reach, through refs,
/// properties, items and compositions.
fn reached_by_success(doc: &Document) -> BTreeSet<String> {
    let mut todo: Vec<&RefOr<Schema>> = Vec::new();
    for item in doc.paths.paths.values() {
        for op in [&item.get, &item.post].into_iter().flatten() {
            for (status, response) in &op.responses.responses {
                if !status.starts_with('2') {
                    continue;
                }
                if let RefOr::T(response) = response {
                    todo.extend(response.content.values().filter_map(|c| match c {
                        RefOr::T(c) => c.schema.as_ref(),
                        RefOr::Ref(_) => None,
                    }));
                }
            }
        }
    }
    let schemas = doc.components.as_ref().map(|c| &c.schemas);
    let mut seen = BTreeSet::new();
    while let Some(next) = todo.pop() {
        match next {
            RefOr::Ref(r) => {
                let name = r
                    .ref_location
                    .trim_start_matches("#/components/schemas/")
                    .to_owned();
                if let Some(target) = schemas.and_then(|s| s.get(&name))
                    && seen.insert(name)
                {
                    todo.push(target);
                }
            }
            RefOr::T(schema) => todo.extend(children(schema)),
        }
    }
    seen
}

fn children(schema: &Schema) -> Vec<&RefOr<Schema>> {
    match schema {
        Schema::Object(obj) => obj.properties.values().collect(),
        Schema::Array(arr) => match &arr.items {
            ArrayItems::RefOrSchema(item) => vec![item.as_ref()],
            ArrayItems::False => Vec::new(),
        },
        Schema::OneOf(s) => s.items.iter().collect(),
        Schema::AllOf(s) => s.items.iter().collect(),
        Schema::AnyOf(s) => s.items.iter().collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    fn doc() -> Value {
        serde_json::from_str(&super::openapi_json()).expect("the document is JSON")
    }

    fn operations(doc: &Value) -> Vec<(String, &Value)> {
        let mut out = Vec::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for op in item.as_object().expect("path item").values() {
                out.push((path.clone(), op));
            }
        }
        out
    }

    #[test]
    fn operation_ids_are_unique_verb_noun_names() {
        let doc = doc();
        let mut ids = std::collections::BTreeSet::new();
        for (path, op) in operations(&doc) {
            let id = op["operationId"].as_str().expect("operationId");
            assert!(id.contains('_'), "{path}: {id} names a verb and a noun");
            assert!(ids.insert(id.to_owned()), "{id} is used twice");
        }
        assert!(ids.contains("acquire_lease") && ids.contains("get_process_logs"));
    }

    #[test]
    fn every_response_has_a_description() {
        let doc = doc();
        for (path, op) in operations(&doc) {
            for (status, res) in op["responses"].as_object().expect("responses") {
                let text = res["description"].as_str().unwrap_or_default();
                assert!(!text.is_empty(), "{path} {status} has no description");
            }
        }
    }

    #[test]
    fn the_token_guards_v1_and_metrics_and_nothing_else() {
        let doc = doc();
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        assert_eq!(doc["security"], serde_json::json!([{"bearer": []}]));
        for (path, op) in operations(&doc) {
            let open = ["/healthz", "/readyz", "/openapi.json"].contains(&path.as_str());
            if open {
                assert_eq!(op["security"], serde_json::json!([]), "{path} is open");
                assert!(
                    op["responses"].get("401").is_none(),
                    "{path} never says 401"
                );
            } else {
                assert!(
                    op.get("security").is_none(),
                    "{path} inherits the bearer scheme"
                );
                assert!(op["responses"].get("401").is_some(), "{path} may say 401");
            }
        }
    }

    #[test]
    fn records_list_every_member_as_required() {
        let doc = doc();
        for name in [
            "Lease",
            "Process",
            "PortReservation",
            "Identity",
            "Exit",
            "Event",
        ] {
            let schema = &doc["components"]["schemas"][name];
            let props: Vec<&String> = schema["properties"]
                .as_object()
                .expect(name)
                .keys()
                .collect();
            let required: Vec<&str> = schema["required"]
                .as_array()
                .expect(name)
                .iter()
                .filter_map(Value::as_str)
                .collect();
            for p in props {
                assert!(required.contains(&p.as_str()), "{name}.{p} is required");
            }
        }
        // Sent only by the acquire that took over; request members stay optional.
        let acquired = &doc["components"]["schemas"]["AcquireResponse"];
        assert!(
            !acquired
                .to_string()
                .contains("\"required\":[\"reclaimed\"]")
        );
        let req = &doc["components"]["schemas"]["CommandSpec"]["required"];
        assert_eq!(req, &serde_json::json!(["argv"]));
        // A problem's extension members come with their codes only.
        let problem = &doc["components"]["schemas"]["Problem"]["required"];
        assert_eq!(
            problem,
            &serde_json::json!(["type", "title", "status", "code", "detail"])
        );
    }

    /// The headers the middleware sets are declared where it sets them.
    #[test]
    fn the_middleware_s_headers_are_declared() {
        let doc = doc();
        let mut seen = 0;
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("path item") {
                for (status, r) in op["responses"].as_object().expect("responses") {
                    let want = match status.as_str() {
                        "503" => "Retry-After",
                        "401" => "WWW-Authenticate",
                        s if method == "post" && s.starts_with('2') => "Idempotent-Replayed",
                        _ => continue,
                    };
                    seen += 1;
                    assert!(
                        r["headers"][want].is_object(),
                        "{method} {path} {status}: {want}"
                    );
                }
            }
        }
        assert!(seen > 30, "{seen}");
    }

    /// The stream's schema is a message's frame; its `data` is the JSON
    /// text of an Event, or of the Problem of an `error` message. Every port
    /// map is a string -> integer map.
    #[test]
    fn the_stream_s_data_is_typed() {
        let doc = doc();
        let stream = &doc["paths"]["/v1/events/stream"]["get"]["responses"]["200"]["content"];
        let frame = stream["text/event-stream"]["schema"]["$ref"]
            .as_str()
            .and_then(|r| r.strip_prefix("#/components/schemas/"))
            .expect("a named schema");
        let text = &doc["components"]["schemas"][frame]["properties"]["data"];
        assert_eq!(text["type"], "string");
        assert_eq!(text["contentMediaType"], "application/json");
        let required = &doc["components"]["schemas"][frame]["required"];
        assert_eq!(
            required,
            &serde_json::json!(["event", "data"]),
            "no id on an error"
        );
        let data = text["contentSchema"]["$ref"]
            .as_str()
            .and_then(|r| r.strip_prefix("#/components/schemas/"))
            .expect("a named schema");
        let refs: Vec<&str> = doc["components"]["schemas"][data]["oneOf"]
            .as_array()
            .expect("oneOf")
            .iter()
            .filter_map(|s| s["$ref"].as_str())
            .collect();
        assert_eq!(
            refs,
            ["#/components/schemas/Event", "#/components/schemas/Problem"]
        );
        let reserved = &doc["components"]["schemas"]["Reserved"]["properties"]["ports"];
        assert_eq!(reserved["$ref"], "#/components/schemas/PortMap");
    }

    #[test]
    fn problem_codes_are_the_serialized_names() {
        let doc = doc();
        let names = doc["components"]["schemas"]["ProblemCode"]["enum"]
            .as_array()
            .expect("enum")
            .clone();
        assert!(names.contains(&Value::from("lease_held")));
        for name in names {
            let code: super::super::error::Code =
                serde_json::from_value(name.clone()).expect("a code");
            assert_eq!(Value::from(code.as_str()), name);
        }
    }
}
