//! Who may use the API. The admin listener is private by default (loopback). With
//! `server.admin_token`, every request to the API needs `Authorization: Bearer <token>`;
//! without it, reads answer and every change is refused, so that a process or page that
//! can reach the listener cannot change the store. The token is read from that header
//! only, never from a cookie or the query string, so that a page elsewhere cannot make a
//! browser send it; and a change whose `Origin` is another site is refused even with it.

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, HOST, ORIGIN, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use justonce_http::problem;
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// The token `server.admin_token` names, kept as its SHA-256 digest: two digests of one
/// length are compared in constant time, whatever the length of the token tried.
#[derive(Clone)]
pub struct AdminToken([u8; 32]);

impl AdminToken {
    /// The token `secret`.
    pub fn new(secret: &str) -> Self {
        Self(Sha256::digest(secret.as_bytes()).into())
    }

    /// Whether `given` is the token: every byte is compared, without an early exit.
    pub(crate) fn matches(&self, given: &str) -> bool {
        let given: [u8; 32] = Sha256::digest(given.as_bytes()).into();
        let difference = self
            .0
            .iter()
            .zip(given.iter())
            .fold(0u8, |difference, (a, b)| difference | (a ^ b));
        difference == 0
    }
}

/// Lets a request through to the API, or answers it `401` (no or a wrong token when one
/// is set) or `403` (a change without a token set, or from another origin).
pub async fn check(
    State(token): State<Arc<Option<AdminToken>>>,
    request: Request,
    next: Next,
) -> Response {
    let changes = !matches!(*request.method(), Method::GET | Method::HEAD);
    if changes && let Some(origin) = foreign_origin(&request) {
        return problem(
            StatusCode::FORBIDDEN,
            "cross-origin change refused",
            format!(
                "a change sent from the page of {origin} is refused: the admin API takes \
                 changes from its own origin or from clients that send no Origin"
            ),
        );
    }
    match (token.as_ref(), bearer(request.headers())) {
        (Some(token), Some(given)) if token.matches(given) => next.run(request).await,
        (Some(_), given) => {
            let detail = match given {
                Some(_) => "the bearer token is not server.admin_token",
                None => {
                    "send Authorization: Bearer <the token server.admin_token names>; \
                     a token in a cookie or the query string is not read"
                }
            };
            unauthorized(detail)
        }
        (None, _) if changes => problem(
            StatusCode::FORBIDDEN,
            "changes need a token",
            "the admin API changes nothing without a token: set server.admin_token to \
             env:VARIABLE, the variable holding a long random token, and send it as \
             Authorization: Bearer <token>",
        ),
        (None, _) => next.run(request).await,
    }
}

/// The answer to a request without the token, or with another: `401`, saying why.
pub(crate) fn unauthorized(detail: &str) -> Response {
    let mut answer = problem(StatusCode::UNAUTHORIZED, "unauthorized", detail);
    answer
        .headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    answer
}

/// The token of an `Authorization: Bearer` header.
pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|token| !token.is_empty())
}

/// The request's `Origin` when it is not the listener's own (`http://` or `https://` and
/// the `Host` the request names); `null`, an opaque origin, is never its own.
fn foreign_origin(request: &Request) -> Option<String> {
    let origin = request.headers().get(ORIGIN)?;
    let origin = origin.to_str().unwrap_or("(not text)");
    let host = request
        .headers()
        .get(HOST)
        .and_then(|host| host.to_str().ok());
    let own = host.is_some_and(|host| {
        ["http://", "https://"].iter().any(|scheme| {
            origin
                .strip_prefix(scheme)
                .is_some_and(|rest| rest.eq_ignore_ascii_case(host))
        })
    });
    (!own).then(|| origin.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_token_itself_matches() {
        let token = AdminToken::new("s3cr3t-t0ken");
        assert!(token.matches("s3cr3t-t0ken"));
        for other in ["", "s3cr3t-t0ke", "s3cr3t-t0ken ", "S3CR3T-T0KEN"] {
            assert!(!token.matches(other), "{other:?}");
        }
    }
}
