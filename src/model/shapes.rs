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

/// A port's name: `[a-z][a-z0-9_]{0,31}`; a spawned child gets it as `PORT_<NAME>`.
pub struct PortName;

impl PartialSchema for PortName {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some("^[a-z][a-z0-9_]{0,31}$"))
            .examples([serde_json::json!("http")])
            .into()
    }
}

impl ToSchema for PortName {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("PortName")
    }
}

/// An inclusive range of ports, `[low, high]`, within 1024..=65535.
pub struct PortRange;

impl PartialSchema for PortRange {
    fn schema() -> RefOr<Schema> {
        let port = ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(1024))
            .maximum(Some(65535));
        utoipa::openapi::schema::ArrayBuilder::new()
            .items(port)
            .min_items(Some(2))
            .max_items(Some(2))
            .examples([serde_json::json!([20000, 29999])])
            .into()
    }
}

impl ToSchema for PortRange {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("PortRange")
    }
}
