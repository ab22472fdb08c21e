//! Request extractors whose every rejection is a problem with the contract's
//! code: body JSON (`Body`), query strings (`Params`) and path ids.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{header, request::Parts};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::error::ApiError;

/// A JSON object body, strictly parsed: content type checked (415), size
/// limited (413), syntax (400), then shape (422 with the member's path).
pub struct Body<T>(pub T);

fn is_json(content_type: &str) -> bool {
    let mime = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// serde reports a missing or repeated member at its parent's path (and an unknown one
/// at its own): name the member itself, which is what a client must fix.
fn member_path(path: &str, message: &str) -> String {
    let named = ["missing field `", "duplicate field `"]
        .iter()
        .find_map(|p| message.split_once(p));
    let Some((_, rest)) = named else {
        return path.to_owned();
    };
    let name = rest.split('`').next().unwrap_or_default();
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

/// Deserialize `value` into `T`, mapping failures to `validation` on the path.
pub fn from_value<T: DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = super::strict::dotted(e.path());
        let message = e.inner().to_string();
        ApiError::validation(member_path(&path, &message), message)
    })
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        // A declared length over the limit is refused from the header alone,
        // without waiting for a body that may never come.
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > super::BODY_LIMIT as u64) {
            return Err(ApiError::PayloadTooLarge);
        }
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json);
        if !json {
            return Err(ApiError::UnsupportedMediaType);
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge
            } else {
                ApiError::MalformedJson(format!("the body could not be read: {e}"))
            }
        })?;
        let value = super::strict::parse(&bytes).map_err(|(dup, detail)| match dup {
            Some(path) => ApiError::validation(path, detail),
            None => ApiError::MalformedJson(format!("the body is not valid JSON: {detail}")),
        })?;
        if !value.is_object() {
            return Err(ApiError::MalformedJson(
                "the body must be a JSON object".into(),
            ));
        }
        from_value(value).map(Body)
    }
}

/// A caller with the admin token, or `403 forbidden` before the body is
/// read: a caller who may not ask learns that first, whatever it sent.
/// Only `break` needs it.
pub struct Admin(pub crate::caller::Caller);

impl<S: Send + Sync> FromRequestParts<S> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let caller = parts
            .extensions
            .get::<crate::caller::Caller>()
            .cloned()
            .ok_or_else(|| ApiError::Internal("no caller for the request".into()))?;
        if !caller.admin {
            return Err(ApiError::Forbidden(
                "only the admin token may break a lease".into(),
            ));
        }
        Ok(Admin(caller))
    }
}

/// Query parameters, strictly parsed (unknown parameters are refused).
pub struct Params<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let query = parts.uri.query().unwrap_or("");
        let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(de)
            .map(Params)
            .map_err(|e| {
                let path = super::strict::dotted(e.path());
                let message = e.inner().to_string();
                ApiError::validation(member_path(&path, &message), message)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        assert!(is_json("application/json"));
        assert!(is_json("application/json; charset=utf-8"));
        assert!(is_json("Application/JSON"));
        assert!(is_json("application/merge-patch+json"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/x-www-form-urlencoded"));
    }

    #[test]
    fn unknown_and_missing_members_are_named() {
        let unknown = "unknown field `bogus`, expected one of `a`";
        assert_eq!(member_path("bogus", unknown), "bogus");
        assert_eq!(member_path("owner.x", "unknown field `x`"), "owner.x");
        assert_eq!(member_path("", "missing field `holder`"), "holder");
        assert_eq!(
            member_path("parent", "missing field `token`"),
            "parent.token"
        );
        assert_eq!(member_path("ttl_ms", "invalid type: string"), "ttl_ms");
    }
}
