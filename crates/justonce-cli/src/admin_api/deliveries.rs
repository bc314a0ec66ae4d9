//! `GET /api/v1/deliveries/{id}`: one delivery with its stored body and its attempts.

use super::AdminState;
use super::params::{Params, path_id};
use super::problem::{ApiError, json};
use crate::commands::deliveries::state_of;
use crate::commands::output::{attempt_json, bytes_json};
use axum::extract::{Path, RawQuery, State};
use axum::response::Response;
use justonce_sql::{Attempt, Backend, Row};

pub async fn show<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    Params::parse(query.as_deref(), &[])?;
    let id = path_id("id", &id)?;
    let outbox = admin.inbox.outbox();
    let row = outbox
        .get(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no delivery has id {id}")))?;
    let attempts = outbox.attempts(id).await?;
    Ok(json(delivery_json(&row, &attempts)))
}

/// A delivery as JSON: its state, headers, body and attempts, oldest first.
pub fn delivery_json(row: &Row, attempts: &[Attempt]) -> serde_json::Value {
    let mut object = serde_json::json!({
        "id": row.id,
        "scope": (!row.scope.is_empty()).then_some(&row.scope),
        "key": row.key,
        "destination": row.destination,
        "state": state_of(row),
        "attempts": row.attempts,
        "last_error": row.last_error,
        "headers": row.headers.iter().map(|(name, value)| [name, value]).collect::<Vec<_>>(),
        "history": attempts.iter().map(attempt_json).collect::<Vec<_>>(),
    });
    bytes_json(&mut object, "body", &row.payload);
    object
}
