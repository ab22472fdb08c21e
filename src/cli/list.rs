//! List endpoints: one page as the server answered it, or with `--all`
//! every page's items joined into one `{"items": [...], "next_cursor": null}`.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::error::CliError;
use super::error::say;
use super::http::Client;
use super::table::Table;

pub struct Listing<T> {
    /// What `--json` prints.
    pub json: String,
    pub items: Vec<T>,
    /// Without `--all`: whether the server has more than this page.
    pub more: bool,
}

impl<T> Listing<T> {
    /// `table` of the items for people, and on stderr, when the page was
    /// not the last, how to see the rest: a page ends at 100 records, and a
    /// table that just stops there reads as the whole list.
    pub fn print_table(&self, table: &Table) -> Result<(), CliError> {
        table.print()?;
        if self.more {
            say!(
                "holdfast: the first {} only; --all lists every page",
                self.items.len()
            );
        }
        Ok(())
    }
}

pub async fn fetch<T: DeserializeOwned>(
    client: &Client,
    path: &str,
    query: &impl Serialize,
    all: bool,
) -> Result<Listing<T>, CliError> {
    let query = serde_urlencoded::to_string(query)
        .map_err(|e| CliError::local(format!("cannot encode the query: {e}")))?;
    let url = |cursor: Option<&str>| {
        let mut q = query.clone();
        if let Some(c) = cursor {
            let c = form_urlencoded::Serializer::new(String::new())
                .append_pair("cursor", c)
                .finish();
            q = if q.is_empty() { c } else { format!("{q}&{c}") };
        }
        if q.is_empty() {
            path.to_owned()
        } else {
            format!("{path}?{q}")
        }
    };
    let first = client.get(&url(None)).await?;
    let mut page: Value = first.json()?;
    let mut items = take_items(&mut page)?;
    let more = !all && page["next_cursor"].is_string();
    let json = if all {
        while let Some(cursor) = page["next_cursor"].as_str().map(str::to_owned) {
            page = client.get(&url(Some(&cursor))).await?.json()?;
            items.extend(take_items(&mut page)?);
        }
        json!({"items": items, "next_cursor": null}).to_string()
    } else {
        String::from_utf8_lossy(&first.body).into_owned()
    };
    let items = serde_json::from_value(Value::Array(items))
        .map_err(|e| CliError::local(format!("the server's list does not parse: {e}")))?;
    Ok(Listing { json, items, more })
}

fn take_items(page: &mut Value) -> Result<Vec<Value>, CliError> {
    match page.get_mut("items").map(Value::take) {
        Some(Value::Array(items)) => Ok(items),
        _ => Err(CliError::local("the server's list has no items")),
    }
}
