//! Query parameters, each checked: an unknown, repeated or malformed one is a `400` that
//! names it.

use super::problem::ApiError;
use justonce_cli_support::parse_duration;
use justonce_sql::RowFilter;
use std::collections::BTreeMap;
use std::time::Duration;

/// The most rows one page lists.
pub const MAX_LIMIT: u32 = 1_000;

/// The parameters of one request.
pub struct Params(BTreeMap<String, String>);

impl Params {
    /// Reads `query`, which may hold only the parameters `known`.
    pub fn parse(query: Option<&str>, known: &[&str]) -> Result<Self, ApiError> {
        let mut params = BTreeMap::new();
        for (name, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
            if !known.contains(&name.as_ref()) {
                let known = known.join(", ");
                let problem = match known.as_str() {
                    "" => format!("{name} is not a parameter of this route: it takes none"),
                    known => format!("{name} is not a parameter of this route; it takes {known}"),
                };
                return Err(ApiError::bad(&name, problem));
            }
            if params.insert(name.to_string(), value.to_string()).is_some() {
                return Err(ApiError::bad(&name, format!("{name} is given twice")));
            }
        }
        Ok(Self(params))
    }

    /// The text of `name`, if given.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// The text of `name`, a key or a part of one, if given: a control character, which
    /// no key holds, is a `400`.
    pub fn key_text(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.text(name) {
            Some(text) if text.chars().any(char::is_control) => Err(ApiError::bad(
                name,
                format!("{name}: it contains a control character, which no key holds"),
            )),
            text => Ok(text),
        }
    }

    /// A duration such as `2h`.
    pub fn duration(&self, name: &str) -> Result<Option<Duration>, ApiError> {
        self.text(name)
            .map(|text| {
                parse_duration(text).map_err(|e| ApiError::bad(name, format!("{name}: {e}")))
            })
            .transpose()
    }

    /// `true` or `false`, `false` when not given.
    pub fn flag(&self, name: &str) -> Result<bool, ApiError> {
        match self.text(name) {
            None | Some("false") => Ok(false),
            Some("true") => Ok(true),
            Some(other) => Err(ApiError::bad(
                name,
                format!("{name}: {other:?} is not true or false"),
            )),
        }
    }

    /// A page's size: from 1 to [`MAX_LIMIT`], 50 when not given.
    pub fn limit(&self) -> Result<u32, ApiError> {
        let Some(text) = self.text("limit") else {
            return Ok(50);
        };
        match text.parse::<u32>() {
            Ok(limit) if (1..=MAX_LIMIT).contains(&limit) => Ok(limit),
            _ => Err(ApiError::bad(
                "limit",
                format!("limit: {text:?} is not a whole number from 1 to {MAX_LIMIT}"),
            )),
        }
    }

    /// The outbox rows the parameters `destination`, `since` and `until` select.
    pub fn window(&self) -> Result<RowFilter, ApiError> {
        let mut filter = RowFilter::default();
        if let Some(destination) = self.text("destination") {
            filter = filter.destination(destination);
        }
        if let Some(since) = self.duration("since")? {
            filter = filter.since(since);
        }
        if let Some(until) = self.duration("until")? {
            filter = filter.until(until);
        }
        Ok(filter)
    }

    /// Whether any of `destination`, `since` and `until` is given.
    pub fn has_window(&self) -> bool {
        ["destination", "since", "until"]
            .iter()
            .any(|name| self.0.contains_key(*name))
    }
}

/// A number in a path, such as a delivery's id.
pub fn path_id(name: &str, text: &str) -> Result<i64, ApiError> {
    text.parse()
        .map_err(|_| ApiError::bad(name, format!("{name}: {text:?} is not a whole number")))
}

/// The page's rows and the cursor of the next page: `rows` were read one beyond `limit`,
/// so that a full page says whether another follows. The cursor is opaque to clients: it
/// is the last id listed.
pub fn page<T>(mut rows: Vec<T>, limit: u32, id: impl Fn(&T) -> i64) -> (Vec<T>, Option<String>) {
    let limit = limit as usize;
    if rows.len() <= limit {
        return (rows, None);
    }
    rows.truncate(limit);
    let next = rows.last().map(|row| id(row).to_string());
    (rows, next)
}

/// The id a `cursor` parameter gives, from [`page`].
pub fn cursor(params: &Params) -> Result<Option<i64>, ApiError> {
    params
        .text("cursor")
        .map(|text| {
            text.parse().map_err(|_| {
                ApiError::bad(
                    "cursor",
                    "cursor: not a cursor this API gave; start without one",
                )
            })
        })
        .transpose()
}
