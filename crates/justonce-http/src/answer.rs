//! What the receiver and the Idempotency-Key layer answer with, and how they read bodies.

use axum::body::Body;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

/// An `application/problem+json` answer (RFC 9457).
pub fn problem(status: StatusCode, title: &str, detail: impl Into<String>) -> Response {
    problem_with(status, title, detail, serde_json::Map::new())
}

/// [`problem`] with extension `members` beside the standard ones, for a client to read
/// what the detail says in words.
pub fn problem_with(
    status: StatusCode,
    title: &str,
    detail: impl Into<String>,
    members: serde_json::Map<String, serde_json::Value>,
) -> Response {
    let mut body = members;
    body.insert("type".to_owned(), "about:blank".into());
    body.insert("title".to_owned(), title.into());
    body.insert("status".to_owned(), status.as_u16().into());
    body.insert("detail".to_owned(), detail.into().into());
    (
        status,
        [(CONTENT_TYPE, "application/problem+json")],
        serde_json::Value::Object(body).to_string(),
    )
        .into_response()
}

/// The body, read no further than `limit` bytes: a larger Content-Length is refused before
/// reading, and a body that grows past the limit is refused when it does.
pub(crate) async fn read_limited(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<axum::body::Bytes, Response> {
    let too_large = || {
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body too large",
            format!("the body may be at most {limit} bytes"),
        )
    };
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, limit).await.map_err(|error| {
        let over_limit = std::error::Error::source(&error)
            .is_some_and(|source| source.is::<http_body_util::LengthLimitError>());
        if over_limit {
            too_large()
        } else {
            problem(
                StatusCode::BAD_REQUEST,
                "unreadable body",
                error.to_string(),
            )
        }
    })
}
