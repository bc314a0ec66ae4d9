//! Stored events: listed by source or consumer, key prefix, time and state, a page at a
//! time; one shown with its body and attempts; replayed one or by time range, each with
//! its own key again.

use super::AdminState;
use super::params::{Params, path_id};
use super::problem::{ApiError, json};
use crate::commands::events::{detail_json, page_json};
use crate::commands::output::utc_text;
use axum::extract::{Path, RawQuery, State};
use axum::response::Response;
use justonce_cli_support::parse_time;
use justonce_sql::{Backend, EventFilter, ReplayRange};
use std::time::SystemTime;

/// `GET /api/v1/events`: oldest first (by time received, then id).
pub async fn list<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let known = [
        "source",
        "consumer",
        "key_prefix",
        "since",
        "until",
        "state",
        "limit",
        "cursor",
    ];
    let params = Params::parse(query.as_deref(), &known)?;
    let mut filter = EventFilter::default().limit(params.limit()?);
    if let Some(origin) = origin(&params)? {
        filter = filter.origin(origin);
    }
    if let Some(prefix) = params.text("key_prefix") {
        filter = filter.key_prefix(prefix);
    }
    if let Some(since) = time(&params, "since")? {
        filter = filter.since(since);
    }
    if let Some(until) = time(&params, "until")? {
        filter = filter.until(until);
    }
    if let Some(state) = params.text("state") {
        let state = state
            .parse()
            .map_err(|problem| ApiError::bad("state", format!("state: {problem}")))?;
        filter = filter.state(state);
    }
    if let Some(cursor) = params.text("cursor") {
        filter = filter.after(cursor)?;
    }
    Ok(json(page_json(
        &admin.inbox.outbox().events(&filter).await?,
    )))
}

/// `GET /api/v1/events/{id}`.
pub async fn show<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    Params::parse(query.as_deref(), &[])?;
    let id = path_id("id", &id)?;
    let shown = admin.inbox.outbox().event(id).await?;
    let shown = shown.ok_or_else(|| ApiError::NotFound(format!("no event has id {id}")))?;
    Ok(json(detail_json(&shown)))
}

/// `POST /api/v1/events/{id}/replay`: a delivered or dead event delivered again, with
/// the same key; one still waiting for its delivery is a `409`.
pub async fn replay<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    Params::parse(query.as_deref(), &[])?;
    let id = path_id("id", &id)?;
    let outbox = admin.inbox.outbox();
    if outbox.replay_event(id).await? {
        return Ok(json(serde_json::json!({ "id": id, "replayed": 1 })));
    }
    match outbox.event(id).await? {
        None => Err(ApiError::NotFound(format!("no event has id {id}"))),
        Some(_) => Err(ApiError::Conflict(format!(
            "event {id} waits for a delivery already: it is not replayed twice"
        ))),
    }
}

/// `POST /api/v1/events/replay`: every delivered or dead event of a source or consumer
/// received within `since` and `until` (now by default), recorded as a replay; one that
/// overlaps a replay still running is a `409`.
pub async fn replay_range<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let params = Params::parse(query.as_deref(), &["source", "consumer", "since", "until"])?;
    let origin = origin(&params)?
        .ok_or_else(|| ApiError::bad("source", "name the source or the consumer to replay"))?;
    let since = time(&params, "since")?
        .ok_or_else(|| ApiError::bad("since", "since: give where the range starts, such as 2h"))?;
    let mut range = ReplayRange::new(origin, since);
    if let Some(until) = time(&params, "until")? {
        range = range.until(until);
    }
    let window = admin.inbox.outbox().replay_range(&range).await?;
    Ok(json(serde_json::json!({
        "id": window.id,
        "origin": window.origin,
        "since": utc_text(window.since),
        "until": utc_text(window.until),
        "started_at": utc_text(window.started_at),
        "events": window.events,
        "running": window.running,
    })))
}

/// The origin `source` or `consumer` names; not both.
fn origin(params: &Params) -> Result<Option<&str>, ApiError> {
    match (params.text("source"), params.text("consumer")) {
        (Some(_), Some(_)) => Err(ApiError::bad(
            "consumer",
            "give source or consumer, not both: an event has one origin",
        )),
        (source, consumer) => Ok(source.or(consumer)),
    }
}

/// A time given as a duration ago, such as `2h`, or in RFC 3339.
pub(crate) fn time(params: &Params, name: &str) -> Result<Option<SystemTime>, ApiError> {
    params
        .text(name)
        .map(|text| {
            parse_time(text, SystemTime::now())
                .map_err(|e| ApiError::bad(name, format!("{name}: {e}")))
        })
        .transpose()
}
