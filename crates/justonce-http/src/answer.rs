//! What the receiver and the Idempotency-Key layer answer with, and how they read bodies.

use axum::body::Body;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

/// An `application/problem+json` answer (RFC 9457).
pub fn problem(status: StatusCode, title: &str, detail: impl Into<String>) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail.into(),
    });
    (
        status,
        [(CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
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
