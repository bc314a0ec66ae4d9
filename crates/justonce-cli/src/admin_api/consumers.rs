//! `GET /api/v1/consumers` and `GET /api/v1/stats`: each consumer's connection, offsets
//! and delivery lag, and the store's counts.

use super::AdminState;
use super::params::Params;
use super::problem::{ApiError, json};
use crate::commands::stats::Stats;
use crate::probes::Connection;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use justonce_sql::Backend;

/// `GET /api/v1/stats`: what `justonce stats --json` prints.
pub async fn stats<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    Params::parse(query.as_deref(), &[])?;
    Ok(json(Stats::read(&admin.inbox).await?.to_json()))
}

/// `GET /api/v1/consumers`: each configured consumer's connection to its broker as the
/// service knows it now, the offsets it stored, and its deliveries to its target: those
/// waiting and the age of the oldest, which is how far delivery lags.
pub async fn list<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    Params::parse(query.as_deref(), &[])?;
    let offsets = admin.inbox.all_offsets().await?;
    let by_destination = admin.inbox.outbox().stats_by_destination().await?;
    let consumers: Vec<_> = admin
        .consumers
        .states()
        .into_iter()
        .map(|(name, state)| {
            let (connection, last_error) = match state {
                Connection::Connected => ("connected", None),
                Connection::Connecting { last_error } => ("connecting", last_error),
            };
            let offsets: Vec<_> = offsets
                .iter()
                .filter(|stored| stored.consumer == name)
                .map(|stored| {
                    serde_json::json!({
                        "stream": stored.stream,
                        "partition": stored.partition,
                        "position": stored.offset.position,
                        "sequence": stored.offset.sequence,
                    })
                })
                .collect();
            // A consumer's deliveries go to the destination named after it.
            let deliveries = by_destination
                .iter()
                .find(|(destination, _)| *destination == name)
                .map(|(_, counts)| *counts);
            let count =
                |of: fn(&justonce_sql::OutboxStats) -> i64| deliveries.as_ref().map_or(0, of);
            serde_json::json!({
                "name": name,
                "connection": connection,
                "last_error": last_error,
                "offsets": offsets,
                "deliveries": {
                    "sent": count(|c| c.sent),
                    "due": count(|c| c.due),
                    "dead": count(|c| c.dead),
                    "oldest_due_age_seconds":
                        deliveries.map_or(0.0, |c| c.oldest_due.as_secs_f64()),
                },
            })
        })
        .collect();
    Ok(json(serde_json::json!({ "consumers": consumers })))
}
