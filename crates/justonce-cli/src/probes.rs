//! What the probes, `/metrics` and the console know of the parts the service depends
//! on: the database, checked with a short timeout, and each consumer's broker connection.

use crate::config::{Role, Roles};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use justonce_sql::{Backend, Inbox};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a probe waits for the database before it counts it as down.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// A consumer's connection to its broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Connection {
    /// Not connected yet, or connecting again after a failure.
    Connecting { last_error: Option<String> },
    /// Consuming.
    Connected,
}

impl std::fmt::Display for Connection {
    /// What `/readyz` and the console say of it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Connection::Connected => f.write_str("connected"),
            Connection::Connecting { last_error: None } => f.write_str("not connected yet"),
            Connection::Connecting {
                last_error: Some(error),
            } => write!(f, "not connected: {error}"),
        }
    }
}

const CONSUMER_UP: &str = "justonce_consumer_up";

/// Describes the metric of this module, for its `# HELP` line.
pub fn describe_metrics() {
    metrics::describe_gauge!(
        CONSUMER_UP,
        "1 while a consumer is consuming from its broker, 0 while it is connecting, by consumer"
    );
}

/// The state of each consumer, shared by the consumers and the probes.
#[derive(Debug, Default)]
pub struct Consumers {
    states: Mutex<BTreeMap<String, Connection>>,
}

impl Consumers {
    /// Every consumer of `names`, none connected yet.
    pub fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let states = names
            .into_iter()
            .map(|name| {
                metrics::gauge!(CONSUMER_UP, "consumer" => name.to_owned()).set(0.0);
                (name.to_owned(), Connection::Connecting { last_error: None })
            })
            .collect();
        Self {
            states: Mutex::new(states),
        }
    }

    /// Records that `consumer` is consuming.
    pub fn connected(&self, consumer: &str) {
        self.set(consumer, Connection::Connected);
    }

    /// Records why `consumer` is not consuming; it is trying again.
    pub fn failed(&self, consumer: &str, error: String) {
        self.set(
            consumer,
            Connection::Connecting {
                last_error: Some(error),
            },
        );
    }

    /// Records `state`, and logs a change between consuming and not: one line when a
    /// broker goes away, one when it is back, none for each failed retry between. The
    /// consumer's span, around its calls, names it in those lines.
    fn set(&self, consumer: &str, state: Connection) {
        let up = if state == Connection::Connected {
            1.0
        } else {
            0.0
        };
        metrics::gauge!(CONSUMER_UP, "consumer" => consumer.to_owned()).set(up);
        let before = self.lock().insert(consumer.to_owned(), state.clone());
        let was_down = matches!(
            before,
            Some(Connection::Connecting {
                last_error: Some(_)
            })
        );
        match state {
            Connection::Connected if was_down => tracing::info!("consuming again"),
            Connection::Connected if before != Some(Connection::Connected) => {
                tracing::info!("consuming")
            }
            Connection::Connecting {
                last_error: Some(error),
            } if !was_down => tracing::warn!(
                %error,
                "not consuming: the broker is unreachable or failed; trying again every few seconds"
            ),
            Connection::Connecting {
                last_error: Some(error),
            } => tracing::debug!(%error, "the broker is still unreachable"),
            _ => {}
        }
    }

    /// Each consumer's state, by name.
    pub fn states(&self) -> BTreeMap<String, Connection> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Connection>> {
        // A panic elsewhere while holding the lock leaves the map whole: use it.
        self.states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

struct Probed<DB: Backend> {
    inbox: Inbox<DB>,
    consumers: Arc<Consumers>,
    /// The roles this process runs, named in each answer of `/readyz`.
    roles: Vec<&'static str>,
}

/// `GET /livez` and `GET /readyz`, for both listeners.
///
/// `/livez` answers `200` from memory: the process serves. `/readyz` answers `200` when the
/// database answered within a second and every consumer is consuming, and `503`
/// problem+json naming each part that is not otherwise, with the same states and each
/// consumer's last error as members. Both answers name the roles the process runs.
pub fn router<DB: Backend>(inbox: &Inbox<DB>, consumers: &Arc<Consumers>, roles: &Roles) -> Router {
    let probed = Arc::new(Probed {
        inbox: inbox.clone(),
        consumers: Arc::clone(consumers),
        roles: roles.iter().map(Role::name).collect(),
    });
    Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz::<DB>))
        .with_state(probed)
}

async fn livez() -> Response {
    ([(CONTENT_TYPE, "application/json")], r#"{"status":"ok"}"#).into_response()
}

async fn readyz<DB: Backend>(State(probed): State<Arc<Probed<DB>>>) -> Response {
    let mut failing = Vec::new();
    let store = match tokio::time::timeout(STORE_TIMEOUT, probed.inbox.check()).await {
        Ok(Ok(())) => "up",
        Ok(Err(error)) => {
            failing.push(format!("the database: {error}"));
            "down"
        }
        Err(_) => {
            failing.push("the database: no answer within 1 s".to_owned());
            "down"
        }
    };
    let mut consumers = serde_json::Map::new();
    let mut last_errors = serde_json::Map::new();
    for (name, state) in probed.consumers.states() {
        let connected = state == Connection::Connected;
        if !connected {
            failing.push(format!("consumer {name}: {state}"));
        }
        if let Connection::Connecting {
            last_error: Some(error),
        } = &state
        {
            last_errors.insert(name.clone(), error.as_str().into());
        }
        let state = if connected { "connected" } else { "connecting" };
        consumers.insert(name, state.into());
    }
    if failing.is_empty() {
        let body = serde_json::json!({
            "status": "ready",
            "roles": probed.roles,
            "database": store,
            "consumers": consumers,
        });
        ([(CONTENT_TYPE, "application/json")], body.to_string()).into_response()
    } else {
        // The states as the ready answer gives them, and each consumer's last error, for a
        // monitor to read.
        let members = serde_json::Map::from_iter([
            ("roles".to_owned(), probed.roles.clone().into()),
            ("database".to_owned(), store.into()),
            ("consumers".to_owned(), consumers.into()),
            ("last_errors".to_owned(), last_errors.into()),
        ]);
        justonce_http::problem_with(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready",
            failing.join("; "),
            members,
        )
    }
}
