//! A retrying HTTP client that gives each request one `Idempotency-Key` and sends the same
//! key on every retry.
//!
//! Retrying a POST is safe only because of that key: a receiver that deduplicates on it
//! acts once however many copies arrive, including a copy of a request it had already
//! carried out when its answer was lost. A receiver that ignores the key may act once per
//! try. So only answers that say "not now" are retried, and nothing that says "never":
//!
//! | outcome of a try | what the client does |
//! |---|---|
//! | 408, 425, 429, 500, 502, 503, 504 | retries, after `Retry-After` on 429 and 503 |
//! | 409 with `Retry-After`: the key's first request is still running | retries after it |
//! | any other status | returns the response |
//! | no connection, a timeout, or a connection that broke before the answer | retries |
//! | any other error | returns [`Error::NoAnswer`] |
//!
//! Once the attempts or the time budget of the [`RetryPolicy`] run out, the last response
//! is returned as it is (check its status), or [`Error::NoAnswer`] if there was none.
//!
//! ```no_run
//! # async fn example(row_key: String) -> Result<(), justonce_http::client::Error> {
//! use justonce_http::client::{IdempotencyKey, RetryPolicy, RetryingClient};
//! use std::time::Duration;
//!
//! let client = RetryingClient::with_policy(
//!     RetryingClient::http_client(Duration::from_secs(10))?,
//!     RetryPolicy::default().max_attempts(3),
//! );
//! let sent = client
//!     .post("https://payments.example/charges")
//!     .key(IdempotencyKey::new(row_key)?)
//!     .body(r#"{"amount":1200}"#)
//!     .send()
//!     .await?;
//! println!(
//!     "{} after {} tries with key {}",
//!     sent.response.status(),
//!     sent.attempts,
//!     sent.key
//! );
//! # Ok(())
//! # }
//! ```

use crate::retry_after::{is_in_progress, parse_retry_after};
use justonce_core::DerivedKey;
use reqwest::header::{HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Body, IntoUrl, Request, RequestBuilder, Response, StatusCode};
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::time::Duration;
use tokio::time::Instant;

/// The header every try carries.
const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The longest key accepted, as for justonce's own keys.
const MAX_KEY_BYTES: usize = 255;

/// The key a receiver deduplicates a request on, sent as `Idempotency-Key`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// A key given by the caller, such as an outbox row's key. It must be 1 to 255 visible
    /// ASCII characters, so that it goes into a header unchanged.
    pub fn new(key: impl Into<String>) -> Result<Self, Error> {
        let key = key.into();
        let visible = key.bytes().all(|byte| byte.is_ascii_graphic());
        if key.is_empty() || key.len() > MAX_KEY_BYTES || !visible {
            return Err(Error::InvalidKey(key));
        }
        Ok(Self(key))
    }

    /// A new key of 32 hex characters: 128 bits from the operating system's secure
    /// generator, so that no two keys made anywhere meet by chance.
    ///
    /// Store it before the first try if the request must survive a restart: a key made
    /// again after a crash is a new key, and the receiver acts again.
    pub fn random() -> Result<Self, Error> {
        let mut bytes = [0u8; 16];
        rustls::crypto::ring::default_provider()
            .secure_random
            .fill(&mut bytes)
            .map_err(|_| Error::NoRandomness)?;
        Ok(Self(
            bytes.iter().map(|byte| format!("{byte:02x}")).collect(),
        ))
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn header_value(&self) -> HeaderValue {
        HeaderValue::from_str(&self.0).expect("checked when the key was made")
    }
}

impl From<DerivedKey> for IdempotencyKey {
    /// A derived key is 64 hex characters, always a valid key.
    fn from(key: DerivedKey) -> Self {
        Self(key.as_str().to_owned())
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How often and how long a request is tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    give_up_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            first_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
            give_up_after: Duration::from_secs(120),
        }
    }
}

impl RetryPolicy {
    justonce_core::setters!(
        /// Tries in all, the first one included (default 5); 0 and 1 both send once.
        max_attempts: u32,
        /// The ceiling of the pause after the first failed try, doubled after each next
        /// one (default 200 ms). Each pause is a random share of its ceiling, so that
        /// clients that failed together do not come back together.
        first_backoff: Duration,
        /// The longest pause between two tries (default 30 s), also the cap on a
        /// server's `Retry-After`.
        max_backoff: Duration,
        /// The time budget from the start of the first try (default 2 min): no retry is
        /// made whose pause would end after it. A try in flight is bounded by the
        /// client's own timeout.
        give_up_after: Duration,
    );

    /// The pause after the `attempt`th try failed: the server's `Retry-After` if it gave
    /// one, else a random share of the doubling backoff ("full jitter"), both capped.
    fn pause(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(retry_after) = retry_after {
            return retry_after.min(self.max_backoff);
        }
        let doublings = attempt.saturating_sub(1).min(30);
        let ceiling = self
            .first_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff);
        ceiling.mul_f64(random_u64() as f64 / u64::MAX as f64)
    }
}

/// A `reqwest` client that retries what is safe to retry with one idempotency key.
#[derive(Debug, Clone)]
pub struct RetryingClient {
    client: reqwest::Client,
    policy: RetryPolicy,
}

impl RetryingClient {
    /// Retries `client`'s requests under the default [`RetryPolicy`].
    pub fn new(client: reqwest::Client) -> Self {
        Self::with_policy(client, RetryPolicy::default())
    }

    /// Retries `client`'s requests under `policy`.
    pub fn with_policy(client: reqwest::Client, policy: RetryPolicy) -> Self {
        Self { client, policy }
    }

    /// A `reqwest` client that gives up on a try after `timeout` and does not follow
    /// redirects, since a POST redirected with 301, 302 or 303 is sent on as a GET
    /// without its body.
    ///
    /// TLS uses rustls with the *ring* provider, installed as the process default unless
    /// the application installed one first (building a `reqwest` client before any
    /// provider is installed panics).
    pub fn http_client(timeout: Duration) -> Result<reqwest::Client, Error> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(Error::Build)
    }

    /// A POST to `url`, sent with [`RetryingRequest::send`].
    pub fn post(&self, url: impl IntoUrl) -> RetryingRequest<'_> {
        RetryingRequest {
            client: self,
            request: self.client.post(url),
            key: None,
        }
    }

    /// Sends `request`, retrying what is safe to retry, with one `Idempotency-Key` on
    /// every try: `key`, else the request's own `Idempotency-Key`, else a new
    /// [`IdempotencyKey::random`] made once before the first try.
    ///
    /// A request whose body is a stream is refused before it is sent, since a retry could
    /// not send the body again.
    pub async fn execute(
        &self,
        mut request: Request,
        key: Option<IdempotencyKey>,
    ) -> Result<Sent, Error> {
        let key = match (key, request.headers().get(IDEMPOTENCY_KEY)) {
            (Some(key), _) => key,
            (None, Some(own)) => IdempotencyKey::new(String::from_utf8_lossy(own.as_bytes()))?,
            (None, None) => IdempotencyKey::random()?,
        };
        request
            .headers_mut()
            .insert(IDEMPOTENCY_KEY, key.header_value());
        let started = Instant::now();
        let mut attempts = 0;
        loop {
            // Each try sends a copy, which keeps the request whole for the next one.
            let this_try = request.try_clone().ok_or(Error::UnrepeatableBody)?;
            attempts += 1;
            let outcome = self.client.execute(this_try).await;
            let pause = match &outcome {
                Ok(response) if is_retryable(response) => {
                    Some(self.policy.pause(attempts, retry_after(response)))
                }
                // With the key, a request that may have arrived is as safe to send again
                // as one that did not.
                Err(error) if error.is_connect() || error.is_timeout() || error.is_request() => {
                    Some(self.policy.pause(attempts, None))
                }
                _ => None,
            };
            let within_budget = |pause: &Duration| {
                attempts < self.policy.max_attempts
                    && started.elapsed() + *pause <= self.policy.give_up_after
            };
            let Some(pause) = pause.filter(within_budget) else {
                return match outcome {
                    Ok(response) => Ok(Sent {
                        response,
                        key,
                        attempts,
                    }),
                    Err(source) => Err(Error::NoAnswer {
                        key,
                        attempts,
                        source: source.without_url(),
                    }),
                };
            };
            match &outcome {
                Ok(response) => {
                    tracing::debug!(%key, attempts, ?pause, status = %response.status(), "retrying");
                }
                Err(error) => {
                    let timeout = error.is_timeout();
                    tracing::debug!(%key, attempts, ?pause, timeout, "retrying after no answer");
                }
            }
            tokio::time::sleep(pause).await;
        }
    }
}

/// A POST being built, made by [`RetryingClient::post`]. For anything more than headers
/// and a body, build a [`reqwest::Request`] and pass it to [`RetryingClient::execute`].
#[derive(Debug)]
#[must_use = "a request does nothing until it is sent"]
pub struct RetryingRequest<'a> {
    client: &'a RetryingClient,
    request: RequestBuilder,
    key: Option<IdempotencyKey>,
}

impl RetryingRequest<'_> {
    /// Sends `key` as `Idempotency-Key` instead of a new random one.
    pub fn key(mut self, key: impl Into<IdempotencyKey>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.request = self.request.header(name, value);
        self
    }

    /// Sets the body, which must not be a stream (see [`Error::UnrepeatableBody`]).
    pub fn body(mut self, body: impl Into<Body>) -> Self {
        self.request = self.request.body(body);
        self
    }

    /// Sends the request as [`RetryingClient::execute`] does.
    pub async fn send(self) -> Result<Sent, Error> {
        let request = self.request.build().map_err(Error::Build)?;
        self.client.execute(request, self.key).await
    }
}

/// The answer to a request, with the key it was sent with.
#[derive(Debug)]
#[non_exhaustive]
pub struct Sent {
    /// The last try's response: not necessarily a success, as when the retries ran out.
    pub response: Response,
    /// The `Idempotency-Key` every try carried.
    pub key: IdempotencyKey,
    /// How many tries were made, the first one included.
    pub attempts: u32,
}

/// What can go wrong in the retrying client. Match on the variants; new ones may be added.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key is not 1 to 255 visible ASCII characters.
    #[error("invalid idempotency key {0:?}: it must be 1 to 255 visible ASCII characters")]
    InvalidKey(String),
    /// The operating system gave no random bytes for a new key.
    #[error("no random bytes for a new idempotency key")]
    NoRandomness,
    /// The HTTP client or the request could not be built, such as from an invalid URL.
    #[error("cannot build the request: {0}")]
    Build(#[source] reqwest::Error),
    /// The request's body is a stream, which a retry could not send again. Nothing was
    /// sent.
    #[error("the request's body is a stream, which cannot be sent again on a retry")]
    UnrepeatableBody,
    /// The last try got no answer: it failed with `source` (its URL left out, since a
    /// URL's path may hold a secret), and was not retried or was the last one allowed.
    #[error("the last of {attempts} tries with idempotency key {key} got no answer: {source}")]
    NoAnswer {
        /// The `Idempotency-Key` every try carried.
        key: IdempotencyKey,
        /// How many tries were made.
        attempts: u32,
        /// Why the last try failed.
        #[source]
        source: reqwest::Error,
    },
}

/// Answers that say "not now": the server may not have acted, or will deduplicate if it
/// did.
fn is_retryable(response: &Response) -> bool {
    is_retryable_status(response.status()) || is_in_progress(response.status(), response.headers())
}

fn is_retryable_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 425 | 429 | 500 | 502 | 503 | 504)
}

/// The `Retry-After` of a 409, 429 or 503, the statuses it is sent with.
fn retry_after(response: &Response) -> Option<Duration> {
    if !matches!(
        response.status(),
        StatusCode::CONFLICT | StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    ) {
        return None;
    }
    let value = response.headers().get(RETRY_AFTER)?.to_str().ok()?;
    parse_retry_after(value)
}

/// 64 random bits: a SipHash keyed from the operating system's randomness (per thread,
/// then stepped per call), which is all jitter needs.
fn random_u64() -> u64 {
    RandomState::new().hash_one(std::time::Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_and_random_ones_differ() {
        assert!(IdempotencyKey::new("demo:evt_1").is_ok());
        for bad in [
            String::new(),
            "a b".into(),
            "caf\u{e9}".into(),
            "k".repeat(256),
        ] {
            assert!(matches!(
                IdempotencyKey::new(bad),
                Err(Error::InvalidKey(_))
            ));
        }
        let (one, two) = (
            IdempotencyKey::random().unwrap(),
            IdempotencyKey::random().unwrap(),
        );
        assert_eq!(one.as_str().len(), 32);
        assert_ne!(one, two);
    }

    #[test]
    fn pauses_double_up_to_the_cap_and_honour_retry_after() {
        let policy = RetryPolicy::default()
            .first_backoff(Duration::from_millis(100))
            .max_backoff(Duration::from_millis(350));
        for attempt in 1..=40 {
            let ceiling =
                Duration::from_millis(100 << (attempt - 1).min(2)).min(policy.max_backoff);
            assert!(policy.pause(attempt, None) <= ceiling, "attempt {attempt}");
        }
        let retry_after = Some(Duration::from_secs(60));
        assert_eq!(policy.pause(1, retry_after), Duration::from_millis(350));
        assert_eq!(
            policy.pause(1, Some(Duration::from_millis(5))),
            Duration::from_millis(5)
        );
    }

    #[test]
    fn only_some_statuses_are_retried() {
        for code in [408, 425, 429, 500, 502, 503, 504] {
            assert!(
                is_retryable_status(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
        for code in [200, 201, 301, 307, 400, 401, 404, 409, 422, 501, 505] {
            assert!(
                !is_retryable_status(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
    }
}
