//! Paging shared by every list endpoint: `limit` (default 100, at most
//! 1000), an opaque `cursor`, and `next_cursor` when there may be more.

use super::error::ApiError;
use super::validate;

pub const DEFAULT_LIMIT: i64 = 100;
pub const MAX_LIMIT: i64 = 1000;

/// A validated page request.
pub struct Page<C> {
    pub limit: usize,
    /// What to ask the store for: one more than the limit tells whether
    /// there is a next page.
    pub fetch: u32,
    pub after: Option<C>,
}

/// Validate `limit` and decode `cursor` with `decode` (None: not one we gave).
pub fn page<C>(
    limit: Option<i64>,
    cursor: Option<String>,
    decode: impl Fn(&str) -> Option<C>,
) -> Result<Page<C>, ApiError> {
    let limit = limit.unwrap_or(DEFAULT_LIMIT);
    validate::in_range("limit", limit, 1..=MAX_LIMIT)?;
    let after = cursor
        .map(|c| {
            decode(&c)
                .ok_or_else(|| ApiError::validation("cursor", "cursor is not one this server gave"))
        })
        .transpose()?;
    Ok(Page {
        limit: usize::try_from(limit).unwrap_or(usize::MAX),
        fetch: u32::try_from(limit + 1).unwrap_or(u32::MAX),
        after,
    })
}

/// Cut `items` to the page and give the cursor of the next one.
pub fn finish<T>(
    mut items: Vec<T>,
    limit: usize,
    cursor_of: impl Fn(&T) -> String,
) -> (Vec<T>, Option<String>) {
    let more = items.len() > limit;
    items.truncate(limit);
    let next = if more {
        items.last().map(cursor_of)
    } else {
        None
    };
    (items, next)
}

/// Lease and process cursors are the id of the last item shown.
pub fn id_cursor(c: &str) -> Option<String> {
    uuid::Uuid::parse_str(c)
        .ok()
        .map(|u| u.hyphenated().to_string())
}
