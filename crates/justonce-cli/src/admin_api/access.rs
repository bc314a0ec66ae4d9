//! Who may use the API. The admin listener is private by default (loopback). With
//! `server.admin_token`, every request to the API needs `Authorization: Bearer <token>`;
//! without it, reads answer and every change is refused, so that a process or page that
//! can reach the listener cannot change the store. The token is read from that header
//! only, never from a cookie or the query string, so that a page elsewhere cannot make a
//! browser send it; and a change whose `Origin` is another site is refused even with it.
//! Without a token, a request must name the listener by a loopback address, `localhost`
//! or the listen address in its `Host`: a page whose own name was made to point at the
//! listener (DNS rebinding) is of its own origin to the browser, and would read the store.

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, HOST, ORIGIN, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use justonce_http::problem;
use sha2::{Digest, Sha256};
use std::net::{IpAddr, SocketAddr};
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

/// Who may use the API: the token, if one is set, and the address the listener listens on.
pub struct Access {
    token: Option<AdminToken>,
    listen: SocketAddr,
}

impl Access {
    /// Access by `token`, or without one, by the names of the listener on `listen`.
    pub fn new(token: Option<AdminToken>, listen: SocketAddr) -> Self {
        Self { token, listen }
    }

    /// The token, if one is set.
    pub(crate) fn token(&self) -> Option<&AdminToken> {
        self.token.as_ref()
    }

    /// Without a token, the `403` for a request whose host is not the listener's own.
    fn refuse_foreign_host(&self, request: &Request) -> Option<Response> {
        if self.token.is_some() {
            return None;
        }
        let host = self.foreign_host(request)?;
        Some(problem(
            StatusCode::FORBIDDEN,
            "host refused without a token",
            format!(
                "a request for the host {host:?} is refused: without a token the admin \
                 listener answers only requests for localhost, a loopback address or its \
                 listen address, so that a web page whose name points at it cannot read the \
                 store; set server.admin_token to env:VARIABLE, the variable holding a long \
                 random token, and send it as Authorization: Bearer <token>"
            ),
        ))
    }

    /// The host the request names (its `Host`, or its URI's authority in HTTP/2) when it
    /// is not one of [`Access::own_host`]'s; empty when it names none.
    fn foreign_host(&self, request: &Request) -> Option<String> {
        let host = match request.headers().get(HOST) {
            Some(host) => host.to_str().unwrap_or_default(),
            None => request.uri().authority().map_or("", |a| a.as_str()),
        };
        (!self.own_host(host)).then(|| host.to_owned())
    }

    /// Whether `host`, a `Host` header's value, names this listener without a name that
    /// someone else's DNS resolves: a loopback address, `localhost`, or the listen
    /// address; with any port.
    fn own_host(&self, host: &str) -> bool {
        let name = host_name(host);
        if name.eq_ignore_ascii_case("localhost") {
            return true;
        }
        name.parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip == self.listen.ip())
    }
}

/// Lets a request for a page of the console through, or answers it `403` when no token
/// is set and it names a host that is not the listener's own.
pub async fn own_host_only(
    State(access): State<Arc<Access>>,
    request: Request,
    next: Next,
) -> Response {
    match access.refuse_foreign_host(&request) {
        Some(refused) => refused,
        None => next.run(request).await,
    }
}

/// Lets a request through to the API, or answers it `401` (no or a wrong token when one
/// is set) or `403` (a change without a token set, a request without one to a name that
/// is not the listener's own, or a change from another origin).
pub async fn check(State(access): State<Arc<Access>>, request: Request, next: Next) -> Response {
    let token = &access.token;
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
    if let Some(refused) = access.refuse_foreign_host(&request) {
        return refused;
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

/// The name or address of a `Host` header's value, without its port; an IPv6 address
/// without its brackets.
fn host_name(host: &str) -> &str {
    if let Some(bracketed) = host.strip_prefix('[') {
        return bracketed.split_once(']').map_or(bracketed, |(ip, _)| ip);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
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
    fn without_a_token_only_the_listeners_own_names_are_its_hosts() {
        let access = Access::new(None, "10.0.0.5:9090".parse().unwrap());
        for own in [
            "localhost",
            "LOCALHOST:9090",
            "127.0.0.1:9090",
            "127.1.2.3",
            "[::1]:9090",
            "10.0.0.5:9090",
            "10.0.0.5",
        ] {
            assert!(access.own_host(own), "{own}");
        }
        for other in [
            "evil.example",
            "evil.example:9090",
            "localhost.evil.example",
            "127.0.0.1.evil.example:9090",
            "10.0.0.6:9090",
            "[::2]:9090",
            "",
        ] {
            assert!(!access.own_host(other), "{other}");
        }
    }

    #[test]
    fn only_the_token_itself_matches() {
        let token = AdminToken::new("s3cr3t-t0ken");
        assert!(token.matches("s3cr3t-t0ken"));
        for other in ["", "s3cr3t-t0ke", "s3cr3t-t0ken ", "S3CR3T-T0KEN"] {
            assert!(!token.matches(other), "{other:?}");
        }
    }
}
