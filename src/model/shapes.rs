//! Named OpenAPI shapes of JSON members that have no Rust type of their own,
//! so generated clients get a precise type (`Record<string, unknown>`,
//! `Record<string, number>`) instead of an empty object.

use std::borrow::Cow;

use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{AdditionalProperties, ObjectBuilder, Schema, Type};
use utoipa::{PartialSchema, ToSchema};

/// `metadata`: a JSON object with members of any JSON value.
pub struct Metadata;

impl PartialSchema for Metadata {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .description(Some(
                "Free-form JSON object kept with the record (at most 16 KiB serialized).",
            ))
            .additional_properties(Some(AdditionalProperties::<Schema>::FreeForm(true)))
            .examples([serde_json::json!({"run": 7})])
            .into()
    }
}

impl ToSchema for Metadata {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("Metadata")
    }
}

/// Ports by name: `{"http": 23817}`.
pub struct PortMap;

impl PartialSchema for PortMap {
    fn schema() -> RefOr<Schema> {
        let port = ObjectBuilder::new()
            .schema_type(Type::Integer)
            .format(Some(utoipa::openapi::SchemaFormat::KnownFormat(
                utoipa::openapi::KnownFormat::Int32,
            )))
            .minimum(Some(1))
            .maximum(Some(65535));
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .description(Some("Reserved port numbers by port name."))
            .additional_properties(Some(port))
            .examples([serde_json::json!({"http": 23817})])
            .into()
    }
}

impl ToSchema for PortMap {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("PortMap")
    }
}
