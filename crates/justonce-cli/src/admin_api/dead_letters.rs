//! Dead letters: listed by destination and time, in pages; replayed one or by filter;
//! purged by filter.

use super::AdminState;
use super::params::{Params, cursor, page, path_id};
use super::problem::{ApiError, json};
use crate::commands::deliveries::{Listed, state_of, summary_json};
use axum::extract::{Path, RawQuery, State};
use axum::response::Response;
use justonce_sql::Backend;

/// The filters every dead-letter route takes.
const WINDOW: [&str; 3] = ["destination", "since", "until"];

/// `GET /api/v1/dead-letters`: oldest first, a page at a time.
pub async fn list<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let params = Params::parse(
        query.as_deref(),
        &[&WINDOW[..], &["limit", "cursor"][..]].concat(),
    )?;
    let limit = params.limit()?;
    // One more than the page, to tell whether another follows.
    let mut filter = params.window()?.limit(limit + 1);
    if let Some(after) = cursor(&params)? {
        filter = filter.after(after);
    }
    let rows = admin.inbox.outbox().list_dead(&filter).await?;
    let (rows, next_cursor) = page(rows, limit, |row| row.id);
    let items: Vec<_> = rows
        .iter()
        .map(|row| summary_json(row, Listed::Dead))
        .collect();
    Ok(json(
        serde_json::json!({ "items": items, "next_cursor": next_cursor }),
    ))
}

/// `POST /api/v1/dead-letters/{id}/replay`: due again with its attempts reset, and the
/// same key.
pub async fn replay<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    Params::parse(query.as_deref(), &[])?;
    let id = path_id("id", &id)?;
    let outbox = admin.inbox.outbox();
    if outbox.replay(id).await? {
        tracing::info!(id, "dead letter replayed through the admin API");
        return Ok(json(serde_json::json!({ "id": id, "replayed": 1 })));
    }
    match outbox.get(id).await? {
        None => Err(ApiError::NotFound(format!("no delivery has id {id}"))),
        Some(row) => Err(ApiError::Conflict(format!(
            "delivery {id} is not a dead letter: it is {}",
            state_of(&row)
        ))),
    }
}

/// `POST /api/v1/dead-letters/replay`: every dead letter the filters select, or all of
/// them with `all=true`.
pub async fn replay_matching<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let params = filtered(query.as_deref(), "replay")?;
    let filter = params.window()?.limit(u32::MAX);
    let replayed = admin.inbox.outbox().replay_matching(&filter).await?;
    tracing::info!(replayed, "dead letters replayed through the admin API");
    Ok(json(serde_json::json!({ "replayed": replayed })))
}

/// `DELETE /api/v1/dead-letters`: every dead letter the filters select, or all of them
/// with `all=true`.
pub async fn purge<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let params = filtered(query.as_deref(), "purge")?;
    let purged = admin
        .inbox
        .outbox()
        .purge_dead_matching(&params.window()?)
        .await?;
    tracing::info!(purged, "dead letters purged through the admin API");
    Ok(json(serde_json::json!({ "purged": purged })))
}

/// The parameters of a change to many dead letters: a filter, or `all=true` to say that
/// every one is meant.
fn filtered(query: Option<&str>, action: &str) -> Result<Params, ApiError> {
    let params = Params::parse(query, &[&WINDOW[..], &["all"][..]].concat())?;
    let all = params.flag("all")?;
    if all == params.has_window() {
        let problem = match all {
            true => "all=true means every dead letter: give it without destination, since or until",
            false => "give destination, since or until, or all=true to change every dead letter",
        };
        return Err(ApiError::bad("all", format!("{action}: {problem}")));
    }
    Ok(params)
}
