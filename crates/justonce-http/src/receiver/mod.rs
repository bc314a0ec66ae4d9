//! The webhook receiver: verifies, stores and answers within one transaction, and leaves
//! the delivery to the outbox relay.
//!
//! Each [`Source`] verifies with its [`Scheme`]. Standard Webhooks sources take `whsec_`
//! secrets for `v1` (HMAC-SHA256) signatures and `whpk_` public keys for `v1a` (ed25519)
//! ones, mixed in one list.

mod signature;
mod tenant;

pub use crate::standard_webhooks::signature as standard_webhooks_signature;
pub use signature::{Rejected, Scheme};
pub use tenant::{Tenant, TenantSecrets};

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use justonce_core::trace::{self, TRACEPARENT, TRACESTATE, TraceContext};
use justonce_core::{Consumer, Error, Key, Outcome, Scope};
use justonce_sql::{Backend, Inbox, Message};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tracing::Instrument;

use crate::answer::{problem, read_limited};

/// The receiver's failpoint, as `JUSTONCE_FAILPOINT` names it in a build with the
/// `failpoints` feature: the first event stored stops there, before its answer.
pub const FAILPOINT: &str = "stored-not-answered";

/// The key of event or message `id` of the source or consumer `name` in `scope`:
/// `<name>:<id>`, or `<name>:<tenant>:<id>` in a tenant's scope, so that the target's keys
/// stay apart too.
pub fn key_in_scope(name: &str, scope: &Scope, id: &str) -> Result<Key, Error> {
    match scope.as_str() {
        "" => Key::new(format!("{name}:{id}")),
        tenant => Key::new(format!("{name}:{tenant}:{id}")),
    }
}

/// The header that tells a target the tenant of an event of a source with tenants.
pub const TENANT_HEADER: &str = "justonce-tenant";

/// Where a source puts the event id that becomes the key `<source>:<id>`, or the tenant
/// the event is for.
#[derive(Debug, Clone)]
pub enum IdLocation {
    /// A request header, such as `webhook-id`.
    Header(HeaderName),
    /// A JSON pointer into the body, such as `/id`.
    Json(String),
}

/// One sender of webhooks, served at `POST /webhooks/{name}`.
#[derive(Debug, Clone)]
pub struct Source {
    name: String,
    scheme: Scheme,
    id: IdLocation,
    tenant: Option<Tenant>,
}

impl Source {
    /// A source named `name` (also its consumer name and the prefix of its keys).
    pub fn new(name: &str, scheme: Scheme, id: IdLocation) -> Result<Self, Error> {
        Consumer::new(name)?;
        if name.contains(Key::SEPARATOR) || name.contains('/') {
            return Err(Error::Config(format!(
                "source name {name:?} may not contain ':' or '/'"
            )));
        }
        Ok(Self {
            name: name.to_owned(),
            scheme,
            id,
            tenant: None,
        })
    }

    /// The same source, storing each event in its tenant's scope under the key
    /// `<source>:<tenant>:<id>`. With [`Tenant::BySecret`], the tenants' own secrets verify
    /// each request, not the source's scheme.
    pub fn with_tenant(self, tenant: Tenant) -> Self {
        Self {
            tenant: Some(tenant),
            ..self
        }
    }

    /// The source's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the source's tenant comes from, if it has tenants.
    pub fn tenant(&self) -> Option<&Tenant> {
        self.tenant.as_ref()
    }

    /// The `tenant` label of the source's metrics: none for a source without tenants, whose
    /// metrics have no such label; else the request's tenant, empty before it is known. A
    /// tenant is only ever one the configuration names, so the label stays bounded.
    fn tenant_label(&self, scope: Option<&Scope>) -> Option<String> {
        self.tenant
            .as_ref()
            .map(|_| scope.map_or_else(String::new, |scope| scope.as_str().to_owned()))
    }
}

struct Receiving<DB: Backend> {
    /// Each source with the inbox of its consumer.
    sources: HashMap<String, (Source, Inbox<DB>)>,
    body_limit: usize,
    rejections: Rejections,
}

/// The histogram of the seconds from a webhook's arrival to its 2xx answer, by source.
pub const ANSWERED_SECONDS: &str = "justonce_webhook_seconds";

/// How often a rejection of one kind from one source is logged at most.
const REJECTION_LOG_EVERY: Duration = Duration::from_secs(10);

/// Counts every rejection, and logs at most one line per source and kind each
/// `REJECTION_LOG_EVERY`, with how many were left out before it: a sender with a wrong
/// secret, someone probing or a database outage must not flood the log. The line names the
/// kind, never the signature, the secret or the body.
#[derive(Default)]
struct Rejections {
    /// Each (source, kind) logged, by when and with the rejections left out since.
    logged: Mutex<HashMap<(String, &'static str), Logged>>,
}

struct Logged {
    at: Instant,
    left_out: u64,
}

impl Rejections {
    fn reject(&self, source: &str, tenant: Option<String>, kind: &'static str) {
        self.reject_for(source, tenant, kind, None);
    }

    /// [`Rejections::reject`], logged with the `error` that caused it.
    fn reject_for(
        &self,
        source: &str,
        tenant: Option<String>,
        kind: &'static str,
        error: Option<&Error>,
    ) {
        count(source, tenant, kind);
        let now = Instant::now();
        let mut logged = self.logged.lock().unwrap_or_else(PoisonError::into_inner);
        let left_out = match logged.get_mut(&(source.to_owned(), kind)) {
            Some(last) if now.duration_since(last.at) < REJECTION_LOG_EVERY => {
                last.left_out += 1;
                return;
            }
            Some(last) => last.left_out,
            None => 0,
        };
        logged.insert(
            (source.to_owned(), kind),
            Logged {
                at: now,
                left_out: 0,
            },
        );
        let error = error.map(tracing::field::display);
        tracing::warn!(source, kind, left_out, error, "webhook rejected");
    }
}

/// The public router: `POST /webhooks/{source}` and `GET /healthz`.
///
/// A valid request is claimed under `<source>:<id>` and its raw body and content type are
/// written to the outbox, for the destination named after the source, in one transaction;
/// then the answer is `200` with `{"status":"accepted"|"duplicate"|"key_reused","key":…}`.
/// It never waits for the delivery. Rejections are `application/problem+json` and store
/// nothing: unknown source 404, bad signature 401, body over `body_limit` 413, a missing or
/// blank id or tenant, an id that makes no valid key (over 255 bytes with the prefix, or
/// with a control character) or unreadable JSON 400, a tenant the source does not take 403;
/// a database that cannot be reached 503 with `Retry-After`. Any other id is taken as
/// given, byte for byte.
///
/// A source with a [`Tenant`] claims and stores each event in its tenant's scope, under the
/// key `<source>:<tenant>:<id>`, and its delivery carries the tenant in [`TENANT_HEADER`]:
/// the same id from two tenants is two events, with two keys for the target.
pub fn router<DB: Backend>(inbox: &Inbox<DB>, sources: Vec<Source>, body_limit: usize) -> Router {
    let sources = sources
        .into_iter()
        .map(|source| {
            let consumer = Consumer::new(source.name.as_str()).expect("checked in Source::new");
            let inbox = inbox.with_consumer(consumer);
            (source.name.clone(), (source, inbox))
        })
        .collect();
    let state = Arc::new(Receiving {
        sources,
        body_limit,
        rejections: Rejections::default(),
    });
    Router::new()
        .route("/webhooks/{source}", post(receive::<DB>))
        .with_state(state)
        .merge(health_router(inbox))
}

/// `GET /healthz`: `200 {"status":"ok"}` while the database is reachable and its tables
/// are in place, `503` with a problem otherwise.
pub fn health_router<DB: Backend>(inbox: &Inbox<DB>) -> Router {
    Router::new()
        .route("/healthz", get(healthz::<DB>))
        .with_state(inbox.clone())
}

async fn receive<DB: Backend>(
    State(state): State<Arc<Receiving<DB>>>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    let span = tracing::debug_span!(
        "justonce.receive",
        otel.kind = "server",
        source = %name,
        key = tracing::field::Empty,
    );
    // The receipt continues the sender's trace, and its delivery continues the receipt's.
    let sender = trace_context(request.headers());
    if let Some(sender) = &sender {
        trace::set_parent(&span, sender);
    }
    receive_in_span(state, name, request, sender)
        .instrument(span)
        .await
}

/// [`receive`], in the receipt's span. `sender` is the sender's trace context, if it sent
/// a well-formed one.
async fn receive_in_span<DB: Backend>(
    state: Arc<Receiving<DB>>,
    name: String,
    request: Request,
    sender: Option<TraceContext>,
) -> Response {
    let arrived = Instant::now();
    let rejections = &state.rejections;
    let Some((source, inbox)) = state.sources.get(&name) else {
        rejections.reject("", None, "unknown_source");
        return problem(
            StatusCode::NOT_FOUND,
            "unknown source",
            format!("no source is named {name:?}"),
        );
    };
    let (parts, body) = request.into_parts();
    let body = match read_limited(&parts.headers, body, state.body_limit).await {
        Ok(body) => body,
        Err(response) => {
            rejections.reject(&source.name, source.tenant_label(None), "rejected_body");
            return response;
        }
    };
    // The tenant whose secret verified the request, for a source whose tenants each sign
    // with their own.
    let verified = match &source.tenant {
        Some(Tenant::BySecret(secrets)) => secrets.signer(&parts.headers, &body).map(Some),
        _ => source.scheme.verify(&parts.headers, &body).map(|()| None),
    };
    let Ok(signer) = verified else {
        rejections.reject(
            &source.name,
            source.tenant_label(None),
            "rejected_signature",
        );
        return problem(
            StatusCode::UNAUTHORIZED,
            "signature rejected",
            "the signature, its timestamp or its headers do not verify",
        );
    };
    // After the signature: an unsigned request learns nothing of the tenants taken.
    let scope = match &source.tenant {
        None => Scope::none(),
        Some(tenant) => match tenant.of(&parts.headers, &body, signer) {
            Ok(scope) => scope,
            Err(refused) => {
                rejections.reject(&source.name, source.tenant_label(None), "rejected_tenant");
                return match refused {
                    tenant::Refused::Missing(detail) => {
                        problem(StatusCode::BAD_REQUEST, "no tenant", detail)
                    }
                    tenant::Refused::NotAllowed => problem(
                        StatusCode::FORBIDDEN,
                        "tenant not allowed",
                        "the request names a tenant this source does not take",
                    ),
                };
            }
        },
    };
    let tenant = source.tenant_label(Some(&scope));
    let id = match located_text(&source.id, &parts.headers, &body, "event id") {
        Ok(id) => id,
        Err(detail) => {
            rejections.reject(&source.name, tenant, "rejected_id");
            return problem(StatusCode::BAD_REQUEST, "no event id", detail);
        }
    };
    let key = match key_in_scope(&source.name, &scope, &id) {
        Ok(key) => key,
        Err(error) => {
            rejections.reject(&source.name, tenant, "rejected_id");
            return problem(
                StatusCode::BAD_REQUEST,
                "unusable event id",
                error.to_string(),
            );
        }
    };
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("application/octet-stream");
    tracing::Span::current().record("key", key.as_str());
    // Forwarding the same event: the delivery keeps the event's own key, and the trace
    // context of its receipt (the sender's when the receipt is not exported), so that the
    // target's work joins the sender's trace.
    let mut message =
        Message::new(source.name.as_str(), body.to_vec()).header("content-type", content_type);
    if let Some(context) = trace::context_to_send(&tracing::Span::current(), sender) {
        message = message.trace_context(&context);
    }
    let outcome = if source.tenant.is_some() {
        message = message.header(TENANT_HEADER, scope.as_str());
        inbox
            .with_scope(scope)
            .run_forward(&key, &body, message)
            .await
    } else {
        inbox.run_forward(&key, &body, message).await
    };
    let status = match outcome {
        Ok(Outcome::Processed(_)) => "accepted",
        Ok(Outcome::Duplicate) => "duplicate",
        Ok(Outcome::KeyReused { .. }) => {
            tracing::warn!(%key, source = %source.name, "same event id, different body: not stored");
            "key_reused"
        }
        Err(error) => {
            // An outage fails every request: one line per interval, with the last error.
            rejections.reject_for(&source.name, tenant, "unavailable", Some(&error));
            let mut response = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "not stored",
                "the event could not be stored; send it again later",
            );
            response
                .headers_mut()
                .insert(RETRY_AFTER, "5".parse().expect("a valid header"));
            return response;
        }
    };
    // A kill here leaves an event stored whose sender never heard so: it sends again.
    #[cfg(feature = "failpoints")]
    if status == "accepted" {
        crate::failpoint::pause(FAILPOINT).await;
    }
    let seconds = arrived.elapsed().as_secs_f64();
    match &tenant {
        Some(tenant) => metrics::histogram!(
            ANSWERED_SECONDS,
            "source" => source.name.clone(),
            "tenant" => tenant.clone()
        )
        .record(seconds),
        None => {
            metrics::histogram!(ANSWERED_SECONDS, "source" => source.name.clone()).record(seconds)
        }
    }
    count(&source.name, tenant, status);
    let body = serde_json::json!({ "status": status, "key": key.as_str() });
    ([(CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

async fn healthz<DB: Backend>(State(inbox): State<Inbox<DB>>) -> Response {
    match inbox.check().await {
        Ok(()) => ([(CONTENT_TYPE, "application/json")], r#"{"status":"ok"}"#).into_response(),
        Err(error) => {
            tracing::warn!(%error, "health check failed");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "database unavailable",
                "the database cannot be reached or its tables are not in place",
            )
        }
    }
}

/// The trace context of a request: a well-formed `traceparent`, with its `tracestate` if
/// that is short, visible ASCII. Anything else is the sender's mistake or an attack, and is
/// dropped rather than stored and sent on.
fn trace_context(headers: &HeaderMap) -> Option<TraceContext> {
    let text = |name| headers.get(name).and_then(|value| value.to_str().ok());
    TraceContext::parse(text(TRACEPARENT)?, text(TRACESTATE))
}

/// The event id or tenant (`what`) as text, from a header or a JSON pointer into the body.
/// A blank id is no id: taken as given, every blank-id event would share one key, and all
/// but the first would be dropped as duplicates.
fn located_text(
    location: &IdLocation,
    headers: &HeaderMap,
    body: &[u8],
    what: &str,
) -> Result<String, String> {
    let id = match location {
        IdLocation::Header(name) => headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
            .ok_or_else(|| format!("the {name} header is missing or not text")),
        IdLocation::Json(pointer) => json_id(body, pointer),
    }?;
    if id.trim().is_empty() {
        return Err(format!("the {what} is blank"));
    }
    Ok(id)
}

/// The id at the JSON `pointer` in `body`, as exact text: a string unescaped, a number as
/// written. A number never goes through a float, which would make ids past 2^53 that
/// differ in their last digits one key. Only the objects and arrays on the pointer's path
/// are parsed into maps; the rest is checked as JSON and skipped, without recursion, so a
/// deeply nested body cannot exhaust the stack.
fn json_id(body: &[u8], pointer: &str) -> Result<String, String> {
    use serde_json::value::RawValue;
    let not_found = || format!("the body has no string or number at {pointer}");
    let text = std::str::from_utf8(body).map_err(|_| "the body is not UTF-8".to_owned())?;
    let mut value: &RawValue =
        serde_json::from_str(text).map_err(|e| format!("the body is not JSON: {e}"))?;
    // RFC 6901: `~1` is `/` and `~0` is `~`, in that order.
    for token in pointer.split('/').skip(1) {
        let token = token.replace("~1", "/").replace("~0", "~");
        value = match value.get().as_bytes().first() {
            Some(b'{') => {
                let members: HashMap<String, &RawValue> =
                    serde_json::from_str(value.get()).map_err(|e| e.to_string())?;
                *members.get(&token).ok_or_else(not_found)?
            }
            Some(b'[') => {
                let items: Vec<&RawValue> =
                    serde_json::from_str(value.get()).map_err(|e| e.to_string())?;
                let index: usize = token.parse().map_err(|_| not_found())?;
                *items.get(index).ok_or_else(not_found)?
            }
            _ => return Err(not_found()),
        };
    }
    match value.get().as_bytes().first() {
        Some(b'"') => serde_json::from_str(value.get()).map_err(|e| e.to_string()),
        Some(b'-' | b'0'..=b'9') => Ok(value.get().to_owned()),
        _ => Err(not_found()),
    }
}

/// Counts one request of `source` by what became of it, by tenant for a source with
/// tenants.
fn count(source: &str, tenant: Option<String>, outcome: &'static str) {
    let source = source.to_owned();
    match tenant {
        Some(tenant) => metrics::counter!(
            "justonce_webhooks_total",
            "source" => source,
            "tenant" => tenant,
            "outcome" => outcome
        )
        .increment(1),
        None => {
            metrics::counter!("justonce_webhooks_total", "source" => source, "outcome" => outcome)
                .increment(1)
        }
    }
}
