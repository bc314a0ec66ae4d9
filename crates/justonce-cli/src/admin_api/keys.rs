//! A claimed key: shown, and a lease in progress released or completed by hand, for a
//! worker that is stuck or gone.

use super::AdminState;
use super::params::Params;
use super::problem::{ApiError, json};
use crate::commands::keys::name;
use crate::commands::output::bytes_json;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::response::Response;
use justonce_sql::{Backend, Consumer, Identity, Inbox, Key, Scope, StoredKey};

/// `GET /api/v1/keys/{consumer}/{key}`.
pub async fn show<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    Path((consumer, key)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let identity = identity(consumer, key, query.as_deref())?;
    let stored = lookup(&admin.inbox, &identity).await?;
    Ok(json(key_json(&identity, &stored)))
}

/// `POST /api/v1/keys/{consumer}/{key}/release`: the lease runs out now, so that the next
/// claim takes the key at once.
pub async fn release<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    Path((consumer, key)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let identity = identity(consumer, key, query.as_deref())?;
    lease_in_progress(&admin.inbox, &identity, "release").await?;
    if !admin.inbox.release_key(&identity).await? {
        return Err(no_lease_any_more(&identity));
    }
    tracing::info!(key = %identity.key, consumer = %identity.consumer, "key released through the admin API");
    let stored = lookup(&admin.inbox, &identity).await?;
    Ok(json(key_json(&identity, &stored)))
}

/// `POST /api/v1/keys/{consumer}/{key}/complete`: done, with the body's `result`, if any.
pub async fn complete<DB: Backend>(
    State(admin): State<AdminState<DB>>,
    Path((consumer, key)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    let identity = identity(consumer, key, query.as_deref())?;
    let result = result_of(&body)?;
    lease_in_progress(&admin.inbox, &identity, "complete").await?;
    if !admin
        .inbox
        .complete_key(&identity, result.as_deref().map(str::as_bytes))
        .await?
    {
        return Err(no_lease_any_more(&identity));
    }
    tracing::info!(key = %identity.key, consumer = %identity.consumer, "key completed through the admin API");
    let stored = lookup(&admin.inbox, &identity).await?;
    Ok(json(key_json(&identity, &stored)))
}

/// The key the path names, in the scope the `scope` parameter names (none by default).
fn identity(consumer: String, key: String, query: Option<&str>) -> Result<Identity, ApiError> {
    let params = Params::parse(query, &["scope"])?;
    let bad = |name: &'static str| {
        move |error: justonce_sql::Error| ApiError::bad(name, error.to_string())
    };
    let scope = match params.text("scope") {
        Some(scope) => Scope::new(scope).map_err(bad("scope"))?,
        None => Scope::none(),
    };
    let consumer = Consumer::new(consumer).map_err(bad("consumer"))?;
    let key = Key::new(key).map_err(bad("key"))?;
    Ok(Identity::new(scope, consumer, key))
}

/// The `result` of a body `{"result": "…"}`; none for an empty body or a null result.
fn result_of(body: &[u8]) -> Result<Option<String>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Completion {
        result: Option<String>,
    }
    serde_json::from_slice::<Completion>(body)
        .map(|completion| completion.result)
        .map_err(|error| {
            ApiError::bad(
                "body",
                format!("the body is a JSON object with an optional text result: {error}"),
            )
        })
}

async fn lookup<DB: Backend>(
    inbox: &Inbox<DB>,
    identity: &Identity,
) -> Result<StoredKey, ApiError> {
    inbox
        .lookup(identity)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no {} is stored", name(identity))))
}

/// Fails unless the key is stored with a lease in progress, which `action` changes.
async fn lease_in_progress<DB: Backend>(
    inbox: &Inbox<DB>,
    identity: &Identity,
    action: &str,
) -> Result<(), ApiError> {
    if lookup(inbox, identity).await?.lease_remaining.is_none() {
        return Err(ApiError::Conflict(format!(
            "{} is done: there is no lease in progress to {action}",
            name(identity)
        )));
    }
    Ok(())
}

/// A lease that ended between the look and the change.
fn no_lease_any_more(identity: &Identity) -> ApiError {
    ApiError::Conflict(format!(
        "{} has no lease in progress any more",
        name(identity)
    ))
}

/// A key as JSON: its state, lease, fingerprint and stored result.
fn key_json(identity: &Identity, stored: &StoredKey) -> serde_json::Value {
    let fingerprint: String = stored
        .fingerprint
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut object = serde_json::json!({
        "key": identity.key.as_str(),
        "consumer": identity.consumer.as_str(),
        "scope": (!identity.scope.as_str().is_empty()).then_some(identity.scope.as_str()),
        "state": if stored.lease_remaining.is_some() { "in_progress" } else { "done" },
        "lease_remaining_seconds": stored.lease_remaining.map(|left| left.as_secs_f64()),
        "fingerprint": fingerprint,
    });
    match &stored.result {
        Some(result) => bytes_json(&mut object, "result", result),
        None => object["result"] = serde_json::Value::Null,
    }
    object
}
