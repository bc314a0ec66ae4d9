//! `GET /api/v1/dashboard`: the store's activity minute by minute over a range ending now,
//! and the deliveries waiting, as the console's dashboard shows them.

use super::AdminState;
use super::params::Params;
use super::problem::{ApiError, json};
use crate::commands::output::utc_text;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use justonce_sql::{Backend, Dashboard, DashboardTotals};
use std::time::Duration;

/// The range when none is given.
const DEFAULT_RANGE: Duration = Duration::from_secs(3_600);
/// The longest range: a minute a bar, a week is already ten thousand.
const MAX_RANGE: Duration = Duration::from_secs(7 * 86_400);

/// The range `since` gives, such as `6h`: from a minute to a week, an hour by default.
pub fn range(params: &Params) -> Result<Duration, ApiError> {
    let range = params.duration("since")?.unwrap_or(DEFAULT_RANGE);
    if range < Duration::from_secs(60) || range > MAX_RANGE {
        return Err(ApiError::bad(
            "since",
            "since: give a range from 1m to 7d, such as 1h, 6h or 24h",
        ));
    }
    Ok(range)
}

/// `GET /api/v1/dashboard?since=`.
pub async fn show<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let params = Params::parse(query.as_deref(), &["since"])?;
    let dashboard = admin.inbox.outbox().dashboard(range(&params)?).await?;
    Ok(json(dashboard_json(&dashboard)))
}

fn dashboard_json(dashboard: &Dashboard) -> serde_json::Value {
    let oldest = |age: Option<Duration>| age.map(|age| age.as_secs());
    let minutes: Vec<_> = dashboard
        .minutes
        .iter()
        .map(|minute| {
            let mut counts = totals_json(&minute.counts);
            counts["start"] = utc_text(minute.start).into();
            counts
        })
        .collect();
    let destinations: Vec<_> = dashboard
        .destinations
        .iter()
        .map(|destination| {
            let mut counts = totals_json(&destination.totals);
            counts["name"] = destination.name.clone().into();
            counts["due"] = destination.due.into();
            counts["oldest_due_seconds"] = oldest(destination.oldest_due).into();
            counts
        })
        .collect();
    serde_json::json!({
        "since": utc_text(dashboard.since),
        "totals": totals_json(&dashboard.totals),
        "due": dashboard.due,
        "oldest_due_seconds": oldest(dashboard.oldest_due),
        "minutes": minutes,
        "destinations": destinations,
    })
}

fn totals_json(totals: &DashboardTotals) -> serde_json::Value {
    serde_json::json!({
        "accepted": totals.accepted,
        "duplicates": totals.duplicates,
        "sent": totals.sent,
        "failed": totals.failed,
    })
}
