//! Stored events: listed by source or consumer, key (a part or its start), time and state, a page at a
//! time; one shown with its body and attempts; replayed one, by key or by time range, each
//! with its own key again; and the replays of time ranges.

use super::params::{Params, path_id};
use super::problem::{ApiError, json};
use super::{Admin, AdminState};
use crate::commands::events::{detail_json, page_json};
use crate::commands::output::utc_text;
use axum::extract::{Path, RawQuery, State};
use axum::response::Response;
use justonce_cli_support::parse_time;
use justonce_sql::{Backend, EventFilter, ReplayRange, ReplayWindow};
use std::time::SystemTime;

/// `GET /api/v1/events`: oldest first (by time received, then id).
pub async fn list<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let known = [
        "source",
        "consumer",
        "key",
        "key_prefix",
        "since",
        "until",
        "state",
        "limit",
        "cursor",
    ];
    let params = Params::parse(query.as_deref(), &known)?;
    let mut filter = EventFilter::default().limit(params.limit()?);
    if let Some(origin) = origin(&admin, &params)? {
        filter = filter.origin(origin);
    }
    if let Some(part) = params.key_text("key")? {
        filter = filter.key_contains(part);
    }
    if let Some(prefix) = params.key_text("key_prefix")? {
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

/// `POST /api/v1/events/replay`: every delivered or dead event with `key`; or every one
/// of a source or consumer received within `since` and `until` (now by default), recorded
/// as a replay, one that overlaps a replay still running being a `409`.
pub async fn replay_range<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let params = Params::parse(
        query.as_deref(),
        &["key", "source", "consumer", "since", "until"],
    )?;
    if let Some(key) = params.text("key") {
        return replay_key(&admin, &params, key).await;
    }
    let origin = origin(&admin, &params)?.ok_or_else(|| {
        ApiError::bad(
            "source",
            "name the source or the consumer to replay, or give the key",
        )
    })?;
    let since = time(&params, "since")?
        .ok_or_else(|| ApiError::bad("since", "since: give where the range starts, such as 2h"))?;
    let mut range = ReplayRange::new(origin, since);
    if let Some(until) = time(&params, "until")? {
        range = range.until(until);
    }
    let window = admin.inbox.outbox().replay_range(&range).await?;
    Ok(json(window_json(&window)))
}

/// Every delivered or dead event with `key`, as `justonce replay --key` replays them: the
/// key names them alone, so no other parameter is taken with it.
async fn replay_key<DB: Backend>(
    admin: &Admin<DB>,
    params: &Params,
    key: &str,
) -> Result<Response, ApiError> {
    if let Some(other) = ["source", "consumer", "since", "until"]
        .into_iter()
        .find(|name| params.text(name).is_some())
    {
        return Err(ApiError::bad(
            other,
            format!("{other} is not taken with key: the key names the events to replay"),
        ));
    }
    let outbox = admin.inbox.outbox();
    let replayed = outbox.replay_key(key).await?;
    if replayed == 0 && outbox.events_with_key(key).await?.is_empty() {
        return Err(ApiError::NotFound(format!("no event has key {key}")));
    }
    Ok(json(
        serde_json::json!({ "key": key, "replayed": replayed }),
    ))
}

/// `GET /api/v1/replays`: the latest replays of time ranges, newest first, and whether
/// each still has events waiting for their delivery.
pub async fn replays<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let params = Params::parse(query.as_deref(), &["limit"])?;
    let windows = admin.inbox.outbox().replay_windows(params.limit()?).await?;
    Ok(json(serde_json::json!({
        "replays": windows.iter().map(window_json).collect::<Vec<_>>(),
    })))
}

fn window_json(window: &ReplayWindow) -> serde_json::Value {
    serde_json::json!({
        "id": window.id,
        "origin": window.origin,
        "since": utc_text(window.since),
        "until": utc_text(window.until),
        "started_at": utc_text(window.started_at),
        "events": window.events,
        "running": window.running,
    })
}

/// The origin `source` or `consumer` names, not both, checked against the configuration:
/// a misspelt name is said, not answered with no events.
fn origin<'p, DB: Backend>(
    admin: &Admin<DB>,
    params: &'p Params,
) -> Result<Option<&'p str>, ApiError> {
    match (params.text("source"), params.text("consumer")) {
        (Some(_), Some(_)) => Err(ApiError::bad(
            "consumer",
            "give source or consumer, not both: an event has one origin",
        )),
        (Some(source), None) if !admin.sources.iter().any(|name| name == source) => Err(
            ApiError::bad("source", format!("no source is named {source:?}")),
        ),
        (None, Some(consumer)) if !admin.consumer_names.iter().any(|name| name == consumer) => Err(
            ApiError::bad("consumer", format!("no consumer is named {consumer:?}")),
        ),
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
