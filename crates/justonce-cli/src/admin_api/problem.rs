//! The API's answers: JSON bodies, and each failure as problem+json with its status.

use crate::errors::store_error;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use justonce_http::{problem, problem_with};

/// `value` as a `200` JSON answer.
pub fn json(value: serde_json::Value) -> Response {
    ([(CONTENT_TYPE, "application/json")], value.to_string()).into_response()
}

/// Why a request failed, each with the status it is answered with.
#[derive(Debug)]
pub enum ApiError {
    /// A query parameter, path segment or body the API cannot use: `400`, naming it.
    BadParameter { name: String, problem: String },
    /// Nothing is stored under what the path names: `404`.
    NotFound(String),
    /// What the path names is not in a state the change applies to: `409`.
    Conflict(String),
    /// The database failed or did not answer: `503`, for a client to try again.
    Store(justonce_sql::Error),
}

impl ApiError {
    /// A bad `name`, in words.
    pub fn bad(name: &str, problem: impl Into<String>) -> Self {
        Self::BadParameter {
            name: name.to_owned(),
            problem: problem.into(),
        }
    }
}

impl From<justonce_sql::Error> for ApiError {
    fn from(error: justonce_sql::Error) -> Self {
        match error {
            justonce_sql::Error::InvalidCursor(problem) => Self::bad("cursor", problem),
            running @ justonce_sql::Error::ReplayRunning { .. } => {
                Self::Conflict(running.to_string())
            }
            error => Self::Store(error),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::BadParameter { name, problem } => {
                let members = serde_json::Map::from_iter([("parameter".to_owned(), name.into())]);
                problem_with(StatusCode::BAD_REQUEST, "bad parameter", problem, members)
            }
            ApiError::NotFound(detail) => problem(StatusCode::NOT_FOUND, "not found", detail),
            ApiError::Conflict(detail) => problem(StatusCode::CONFLICT, "conflict", detail),
            ApiError::Store(error) => {
                tracing::warn!(error = %store_error(&error), "an admin API request failed");
                problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the database failed",
                    store_error(&error),
                )
            }
        }
    }
}
