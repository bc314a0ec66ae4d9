use crate::retry_after::{is_in_progress, parse_retry_after};
use crate::standard_webhooks;
use justonce_core::{Answer, Delivered, Delivery, Destination, Error};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Client, StatusCode};
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

/// How much of an answer's body is read: kept in the row's history, and as the reason of
/// a refusal.
const REASON_BODY_BYTES: usize = 512;

/// How long `resolve` waits for the resolver.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Delivers outbox rows as `POST` requests to one URL.
///
/// | answer | what the relay does |
/// |---|---|
/// | 2xx | marks the row sent |
/// | 408, 425, 429, 5xx, a timeout, a connection error | retries later, after `Retry-After` if the answer has one |
/// | 409 with `Retry-After`: the key's first request is still running | retries after it |
/// | any other status (other 4xx, 3xx: redirects are not followed) | dead-letters the row at once, keeping the status and the start of the body |
///
/// Every request carries `Idempotency-Key: <row key>` and the row's own headers. A key
/// travels as it is when every byte is visible ASCII other than `%`; any other byte
/// (a space, `%`, a non-ASCII character's UTF-8 bytes) is written `%XX` in upper-case hex,
/// as in a URL. Percent-decoding the header gives the key back, and two keys never share a
/// header value.
#[derive(Clone)]
pub struct HttpDestination {
    client: Client,
    url: reqwest::Url,
    signing_key: Option<Vec<u8>>,
}

impl std::fmt::Debug for HttpDestination {
    /// Never prints the signing key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpDestination")
            .field("url", &self.url.as_str())
            .field("signed", &self.signing_key.is_some())
            .finish()
    }
}

impl HttpDestination {
    /// The longest a delivery may take, from connecting to the last byte of the answer.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

    /// Where deliveries are POSTed.
    pub fn url(&self) -> &str {
        self.url.as_str()
    }

    /// Resolves the destination's host, as a delivery would, without sending anything:
    /// whether it can be reached is a question for each delivery, but a name that does not
    /// resolve is a mistake to hear about before the first one.
    pub async fn resolve(&self) -> Result<(), Error> {
        let host = self.url.host_str().unwrap_or_default();
        let port = self.url.port_or_known_default().unwrap_or(80);
        // An IPv6 literal comes bracketed in URLs, bare to the resolver.
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let found = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port)))
            .await
            .map_err(|_| {
                Error::Config(format!(
                    "the host of {} did not resolve within {} s",
                    self.url,
                    RESOLVE_TIMEOUT.as_secs()
                ))
            })?
            .map_err(|e| {
                Error::Config(format!("the host of {} does not resolve: {e}", self.url))
            })?;
        if found.count() == 0 {
            return Err(Error::Config(format!(
                "the host of {} resolves to no address",
                self.url
            )));
        }
        Ok(())
    }

    /// A destination that POSTs to `url`, with a 30 s timeout.
    pub fn new(url: &str) -> Result<Self, Error> {
        Self::with_timeout(url, Self::DEFAULT_TIMEOUT)
    }

    /// A destination that POSTs to `url`, giving up on a delivery after `timeout`.
    ///
    /// TLS uses rustls with the *ring* provider, installed as the process default unless
    /// the application installed one first.
    pub fn with_timeout(url: &str, timeout: Duration) -> Result<Self, Error> {
        let url = reqwest::Url::parse(url)
            .map_err(|e| Error::Config(format!("destination URL {url:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Error::Config(format!(
                "destination URL {url} must be http or https"
            )));
        }
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| Error::Config(format!("HTTP client: {e}")))?;
        Ok(Self {
            client,
            url,
            signing_key: None,
        })
    }

    /// Signs every delivery the Standard Webhooks way with `secret` (`whsec_` and the
    /// base64 of the key): `webhook-id` is the row's key as `Idempotency-Key` carries it
    /// (percent-encoded where needed), `webhook-timestamp` the time of the attempt,
    /// `webhook-signature` the HMAC-SHA256 of `id.timestamp.body`.
    pub fn signed_with(mut self, secret: &str) -> Result<Self, Error> {
        self.signing_key = Some(standard_webhooks::decode_secret(secret)?);
        Ok(self)
    }

    /// The Standard Webhooks headers for one attempt.
    fn signature_headers(&self, key: &str, body: &[u8], headers: &mut HeaderMap) {
        let Some(signing_key) = &self.signing_key else {
            return;
        };
        let timestamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|elapsed| elapsed.as_secs())
            .unwrap_or_default();
        for (name, value) in [
            ("webhook-id", key.to_owned()),
            ("webhook-timestamp", timestamp.to_string()),
            (
                "webhook-signature",
                standard_webhooks::signature(signing_key, key, timestamp, body),
            ),
        ] {
            if let Ok(value) = HeaderValue::try_from(value) {
                headers.insert(name, value);
            }
        }
    }

    /// The target's scheme, host and port: what errors show, since a URL's path may hold a
    /// secret (as chat webhooks' do).
    fn origin(&self) -> String {
        self.url.origin().ascii_serialization()
    }

    /// Posts one delivery: what became of it, and what the target answered.
    async fn post(&self, delivery: Delivery<'_>) -> (Delivered, Answer) {
        let mut headers = HeaderMap::new();
        for (name, value) in delivery.headers {
            let (Ok(name), Ok(value)) = (
                HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) else {
                let reason = format!("header {name:?} is not a valid HTTP header");
                return (Delivered::Reject { reason }, Answer::default());
            };
            headers.append(name, value);
        }
        let key = key_header(delivery.key);
        let Ok(key_value) = HeaderValue::try_from(key.as_ref()) else {
            let reason = format!("key {:?} cannot be sent as a header", delivery.key);
            return (Delivered::Reject { reason }, Answer::default());
        };
        headers.insert("idempotency-key", key_value);
        self.signature_headers(&key, delivery.payload, &mut headers);
        let sent = self
            .client
            .post(self.url.clone())
            .headers(headers)
            .body(delivery.payload.to_vec())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(error) => {
                let reason = format!(
                    "POST {}: {}",
                    self.origin(),
                    error_chain(&error.without_url())
                );
                return (
                    Delivered::Retry {
                        after: None,
                        reason,
                    },
                    Answer::default(),
                );
            }
        };
        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(parse_retry_after);
        let in_progress = is_in_progress(status, response.headers());
        // Only the start of the body is read: it is kept in the history and as the reason,
        // and a hostile receiver must not make the relay buffer a large answer.
        let mut start = Vec::new();
        let mut response = response;
        while start.len() < REASON_BODY_BYTES {
            match response.chunk().await {
                Ok(Some(chunk)) => start.extend_from_slice(&chunk),
                _ => break,
            }
        }
        start.truncate(REASON_BODY_BYTES);
        let start = String::from_utf8_lossy(&start);
        let answer = Answer::http(status.as_u16(), start.as_ref());
        if status.is_success() {
            return (Delivered::Sent, answer);
        }
        let reason = format!("POST {} answered {status}: {start}", self.origin());
        let delivered = if is_transient(status) || in_progress {
            Delivered::Retry {
                after: retry_after,
                reason,
            }
        } else {
            Delivered::Reject { reason }
        };
        (delivered, answer)
    }
}

impl Destination for HttpDestination {
    fn deliver<'a>(
        &'a self,
        delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = Delivered> + Send + 'a>> {
        Box::pin(async move { self.post(delivery).await.0 })
    }

    fn deliver_answered<'a>(
        &'a self,
        delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = (Delivered, Answer)> + Send + 'a>> {
        Box::pin(self.post(delivery))
    }
}

/// `key` as a header value: visible ASCII but `%` as it is, every other byte `%XX`.
fn key_header(key: &str) -> std::borrow::Cow<'_, str> {
    let travels = |byte: u8| byte.is_ascii_graphic() && byte != b'%';
    if key.bytes().all(travels) {
        return key.into();
    }
    let mut encoded = String::with_capacity(key.len() * 3);
    for byte in key.bytes() {
        if travels(byte) {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded.into()
}

/// Statuses that say "not now" rather than "never".
fn is_transient(status: StatusCode) -> bool {
    status.is_server_error()
        || matches!(
            status,
            StatusCode::REQUEST_TIMEOUT | StatusCode::TOO_EARLY | StatusCode::TOO_MANY_REQUESTS
        )
}

/// An error with its causes, which say why a connection failed.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(error) = cause {
        text.push_str(": ");
        text.push_str(&error.to_string());
        cause = error.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_travel_as_visible_ascii_and_decode_back() {
        assert_eq!(key_header("shop:evt_1"), "shop:evt_1");
        assert_eq!(key_header("shop:caf\u{e9} 100%"), "shop:caf%C3%A9%20100%25");
        // The encoded form of one key is never another key as it is.
        assert_ne!(key_header("a%C3%A9"), key_header("a\u{e9}"));
        for key in ["plain", "with space", "100%", "\u{1F600}:x", "tab\there"] {
            let header = key_header(key);
            assert!(header.bytes().all(|b| b.is_ascii_graphic()), "{header}");
            assert_eq!(percent_decode(&header), key);
        }
    }

    fn percent_decode(text: &str) -> String {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                out.push(u8::from_str_radix(&text[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn only_some_statuses_are_retried() {
        for code in [408, 425, 429, 500, 502, 503, 504] {
            assert!(is_transient(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        for code in [301, 400, 401, 403, 404, 409, 410, 422] {
            assert!(!is_transient(StatusCode::from_u16(code).unwrap()), "{code}");
        }
    }
}
