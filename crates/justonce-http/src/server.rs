//! The Idempotency-Key layer for axum: the first request with a key runs the handler and
//! its response is stored; a retry of the same request with the same key gets that
//! response again, byte for byte, and the handler does not run.
//!
//! It follows the IETF draft "The Idempotency-Key HTTP Header Field". A key is scoped by
//! the principal the application names (tenant or user), the method and the route
//! template, never by the key alone: tenant A's key never returns tenant B's response.
//! Within that scope a key stands for one request: its fingerprint covers the method, the
//! path as sent (path parameters included), the query string, the `Content-Type` and the
//! body. The same key on `/orders/1/refunds` and then on `/orders/2/refunds` is therefore
//! a key reuse, never a replay of the other order's refund. The path and query are
//! checked rather than made part of the scope so that one route's keys stay under one
//! consumer name, to inspect and purge.
//!
//! | request | answer |
//! |---|---|
//! | first with this key | the handler's; stored unless it is a 5xx |
//! | same key and request, after the first completed | the stored response, with `Idempotent-Replayed: true` |
//! | same key while the first still runs | `409`, with `Retry-After` |
//! | same key, another path, query string, `Content-Type` or body | `422` |
//! | no key, where one is required | `400` |
//! | a key that is empty or blank, over 255 bytes, not visible ASCII or has control characters | `400` |
//! | the store cannot be reached | `503`, with `Retry-After` |
//!
//! Rejections are `application/problem+json`. A 5xx releases the key, so that the retry
//! runs the handler again. A keyed request's handler runs as a task of its own: a client
//! that disconnects does not stop it, and its response is stored for the retry. A handler
//! that crashes or runs past its lease holds the key until the lease runs out; the next
//! retry then runs it.
//!
//! A replay carries the stored status and body, and only the response headers in
//! [`IdempotencyLayer::DEFAULT_STORED_HEADERS`] (or those given to
//! [`IdempotencyLayer::stored_headers`]): representation headers such as `Content-Type`,
//! `Location` and `ETag`. Headers meant for one caller, such as `Set-Cookie`, are never
//! stored, so a retry never receives another request's session.
//!
//! A layer says whose keys are whose before it is one: [`IdempotencyLayer::principal`]
//! scopes keys by tenant or user, [`IdempotencyLayer::shared`] gives every caller one key
//! space.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) {
//! use axum::{Router, routing::post};
//! use justonce_http::server::IdempotencyLayer;
//!
//! async fn create_payment() -> (axum::http::StatusCode, &'static str) {
//!     (axum::http::StatusCode::CREATED, r#"{"id":"pay_1"}"#)
//! }
//!
//! let idempotent = IdempotencyLayer::new(inbox).principal(|request| {
//!     let tenant = request.headers.get("x-tenant")?.to_str().ok()?;
//!     Some(tenant.to_owned())
//! });
//! // `route_layer`, so that the layer sees the route template.
//! let app: Router = Router::new()
//!     .route("/payments", post(create_payment))
//!     .route_layer(idempotent);
//! # }
//! ```
//!
//! The store is any [`Leases`]: an `Inbox` of `justonce-sql` keeps keys in the same table as
//! message keys, under the consumer name [`IdempotencyLayer::consumer_for`] gives, and
//! purges them like any other consumer's keys.

use crate::answer::{problem, read_limited};
use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, OriginalUri, Request};
use axum::http::Extensions;
use axum::http::header::{
    CACHE_CONTROL, CONNECTION, CONTENT_ENCODING, CONTENT_LANGUAGE, CONTENT_LENGTH,
    CONTENT_LOCATION, CONTENT_TYPE, ETAG, EXPIRES, LAST_MODIFIED, LOCATION, RETRY_AFTER,
    SET_COOKIE, TRAILER, TRANSFER_ENCODING, UPGRADE, VARY,
};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::Response;
use justonce_core::{
    Claim, Consumer, Fingerprint, Identity, Key, Lease, LeaseClaim, LeaseFuture, Leases, Scope,
};
use justonce_sql::{Backend, Inbox, StoredKey, sqlx};
use sha2::{Digest, Sha256};
use std::convert::Infallible;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tracing::Instrument;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header a replayed response carries.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Headers never stored, whatever [`IdempotencyLayer::stored_headers`] names: those meant
/// for one caller, and the framing of one connection, which the replay sets afresh.
const NEVER_STORED: [HeaderName; 9] = [
    SET_COOKIE,
    HeaderName::from_static("authentication-info"),
    HeaderName::from_static("proxy-authentication-info"),
    CONTENT_LENGTH,
    TRANSFER_ENCODING,
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    UPGRADE,
    TRAILER,
];

type Principal = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// A tower [`Layer`](tower_layer::Layer) that makes the routes it wraps idempotent by key.
/// Apply it with axum's `route_layer`, so that it sees the route template.
///
/// [`IdempotencyLayer::new`] and [`IdempotencyLayer::transactional`] give an
/// `IdempotencyLayer<Unscoped>`, which is not a layer yet: [`IdempotencyLayer::principal`]
/// or [`IdempotencyLayer::shared`] makes it one, so that no route shares one key space
/// between tenants by accident.
///
/// ```no_run
/// # fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Sqlite>) {
/// use axum::{Router, routing::post};
/// use justonce_http::server::IdempotencyLayer;
///
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "paid" }))
///     .route_layer(IdempotencyLayer::new(inbox).shared());
/// # }
/// ```
///
/// Without either, it does not build:
///
/// ```compile_fail
/// # fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Sqlite>) {
/// use axum::{Router, routing::post};
/// use justonce_http::server::IdempotencyLayer;
///
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "paid" }))
///     .route_layer(IdempotencyLayer::new(inbox));
/// # }
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer<K = Scoped> {
    settings: Arc<Settings>,
    key_space: PhantomData<K>,
}

/// The state of an [`IdempotencyLayer`] that does not say yet whose keys are whose.
#[derive(Debug, Clone, Copy)]
pub struct Unscoped;

/// The state of an [`IdempotencyLayer`] that scopes keys by principal, or shares them on
/// purpose: a layer.
#[derive(Debug, Clone, Copy)]
pub struct Scoped;

#[derive(Clone)]
struct Settings {
    store: Store,
    principal: Option<Arc<Principal>>,
    methods: Vec<Method>,
    required: bool,
    lease_for: Duration,
    body_limit: usize,
    stored_body_limit: usize,
    stored_headers: Vec<HeaderName>,
}

impl<K> std::fmt::Debug for IdempotencyLayer<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.settings;
        f.debug_struct("IdempotencyLayer")
            .field("principal", &s.principal.is_some())
            .field("methods", &s.methods)
            .field("required", &s.required)
            .field("lease_for", &s.lease_for)
            .field("body_limit", &s.body_limit)
            .field("stored_body_limit", &s.stored_body_limit)
            .field("stored_headers", &s.stored_headers)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer<Unscoped> {
    /// How long a request holds its key before a retry may run the handler again.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
    /// The largest request body read, and the largest response body stored.
    pub const DEFAULT_BODY_LIMIT: usize = 1 << 20;
    /// The response headers stored and replayed by default: those describing the stored
    /// representation, the same for every caller.
    pub const DEFAULT_STORED_HEADERS: [HeaderName; 10] = [
        CONTENT_TYPE,
        CONTENT_ENCODING,
        CONTENT_LANGUAGE,
        CONTENT_LOCATION,
        LOCATION,
        ETAG,
        LAST_MODIFIED,
        CACHE_CONTROL,
        EXPIRES,
        VARY,
    ];

    /// A layer keeping keys in `store`, once given a [`principal`](Self::principal) or
    /// made [`shared`](Self::shared). By default it applies to POST and PATCH, requires a
    /// key on them, holds a key for 60 s while the handler runs, reads request bodies of up
    /// to 1 MiB, and stores response bodies of up to 1 MiB with the
    /// [`DEFAULT_STORED_HEADERS`](Self::DEFAULT_STORED_HEADERS).
    pub fn new(store: impl Leases + 'static) -> Self {
        Self::with_store(Store::Leases(Arc::new(store)))
    }

    /// A layer that runs each keyed request's handler inside one database transaction
    /// with its key: the handler takes a [`Tx`] and writes through it, and its writes, the
    /// key and the stored response commit together or not at all. A 5xx, or a failed
    /// commit (answered `503`), rolls everything back. A retry that arrives while the
    /// first request runs waits for its commit and gets its response. Requests without a
    /// key, where [`IdempotencyLayer::optional`] lets them through, get a transaction too.
    pub fn transactional<DB: Backend>(inbox: Inbox<DB>) -> Self {
        Self::with_store(Store::Transactional(Arc::new(inbox)))
    }

    fn with_store(store: Store) -> Self {
        Self {
            settings: Arc::new(Settings {
                store,
                principal: None,
                methods: vec![Method::POST, Method::PATCH],
                required: true,
                lease_for: Self::DEFAULT_LEASE,
                body_limit: Self::DEFAULT_BODY_LIMIT,
                stored_body_limit: Self::DEFAULT_BODY_LIMIT,
                stored_headers: Self::DEFAULT_STORED_HEADERS.to_vec(),
            }),
            key_space: PhantomData,
        }
    }

    /// Names the principal (tenant or user) that scopes each key, from the request's
    /// head. A request for which it returns `None` is refused with `400`; run
    /// authentication before this layer.
    pub fn principal(
        mut self,
        principal: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> IdempotencyLayer {
        self.settings_mut().principal = Some(Arc::new(principal));
        self.scoped()
    }

    /// One key space for every caller: the same key from two callers is one request. Only
    /// for routes whose callers are one party, or whose keys cannot collide.
    pub fn shared(self) -> IdempotencyLayer {
        self.scoped()
    }

    fn scoped(self) -> IdempotencyLayer {
        IdempotencyLayer {
            settings: self.settings,
            key_space: PhantomData,
        }
    }
}

impl<K> IdempotencyLayer<K> {
    /// The methods the layer applies to; others pass straight through.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.settings_mut().methods = methods.into_iter().collect();
        self
    }

    /// Lets requests without a key through to the handler, unprotected, instead of
    /// refusing them with `400`.
    pub fn optional(mut self) -> Self {
        self.settings_mut().required = false;
        self
    }

    /// How long a request holds its key while the handler runs. A handler that runs
    /// longer may run twice: make it at least the handler's timeout.
    pub fn lease_for(mut self, lease_for: Duration) -> Self {
        self.settings_mut().lease_for = lease_for;
        self
    }

    /// The largest request body read; a larger one is refused with `413`.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.settings_mut().body_limit = bytes;
        self
    }

    /// The largest response body stored. A larger one, or one of unknown length, is sent
    /// to the first caller and replayed as its status and headers with an empty body.
    pub fn stored_body_limit(mut self, bytes: usize) -> Self {
        self.settings_mut().stored_body_limit = bytes;
        self
    }

    /// The response headers stored and replayed besides the status and the body, instead
    /// of the [`DEFAULT_STORED_HEADERS`](IdempotencyLayer::DEFAULT_STORED_HEADERS).
    /// `Set-Cookie`, `Authentication-Info` and `Proxy-Authentication-Info`, meant for one
    /// caller, and the connection's framing headers are never stored, even when named.
    pub fn stored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let mut stored = Vec::new();
        for name in headers {
            if !NEVER_STORED.contains(&name) && !stored.contains(&name) {
                stored.push(name);
            }
        }
        self.settings_mut().stored_headers = stored;
        self
    }

    fn settings_mut(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }
}

impl IdempotencyLayer {
    /// The consumer name under which keys of `method` on `route` are stored, for
    /// inspecting and purging them: `"POST /payments"`. A name longer than a consumer name
    /// may be uses a hash of the route instead.
    pub fn consumer_for(method: &Method, route: &str) -> Consumer {
        let name = format!("{method} {route}");
        let name = if name.len() <= Consumer::MAX_LEN {
            name
        } else {
            let digest = Sha256::digest(route.as_bytes());
            let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
            format!("{method} #{hex}")
        };
        Consumer::new(name).unwrap_or_else(|_| {
            Consumer::new(format!("{method} #invalid")).expect("a valid consumer name")
        })
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Idempotent<S> {
        Idempotent {
            inner,
            settings: Arc::clone(&self.settings),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around a route.
#[derive(Clone)]
pub struct Idempotent<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S> tower_service::Service<Request> for Idempotent<S>
where
    S: tower_service::Service<Request, Response = Response, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The clone that was polled ready serves this request.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let settings = Arc::clone(&self.settings);
        // The key's fields are recorded once the request has shown them.
        let span = tracing::debug_span!(
            "justonce.idempotency",
            scope = tracing::field::Empty,
            consumer = tracing::field::Empty,
            key = tracing::field::Empty,
        );
        Box::pin(async move { Ok(handle(settings, inner, request).instrument(span).await) })
    }
}

async fn handle<S>(settings: Arc<Settings>, mut inner: S, request: Request) -> Response
where
    S: tower_service::Service<Request, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send,
{
    if !settings.methods.contains(request.method()) {
        return run(&mut inner, request).await;
    }
    let (mut parts, body) = request.into_parts();
    let key = match idempotency_key(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) if !settings.required => {
            return match &settings.store {
                Store::Leases(_) => run(&mut inner, Request::from_parts(parts, body)).await,
                Store::Transactional(store) => {
                    match store.begin(None, &mut parts.extensions).await {
                        Ok(Begun::Open(open)) => {
                            let response = run(&mut inner, Request::from_parts(parts, body)).await;
                            commit(&settings, open, None, response).await
                        }
                        Ok(Begun::Taken) => unreachable_without_a_key(),
                        Err(error) => store_unavailable(&error),
                    }
                }
            };
        }
        Ok(None) => {
            count("missing_key");
            return problem(
                StatusCode::BAD_REQUEST,
                "Idempotency-Key required",
                format!(
                    "{} {} needs an Idempotency-Key header",
                    parts.method,
                    route(&parts)
                ),
            );
        }
        Err(detail) => {
            count("invalid_key");
            return problem(StatusCode::BAD_REQUEST, "invalid Idempotency-Key", detail);
        }
    };
    let scope = match principal(&settings, &parts) {
        Ok(scope) => scope,
        Err(detail) => {
            count("invalid_principal");
            return problem(StatusCode::BAD_REQUEST, "no principal", detail);
        }
    };
    let body = match read_limited(&parts.headers, body, settings.body_limit).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    let consumer = IdempotencyLayer::consumer_for(&parts.method, route(&parts));
    let identity = Identity::new(scope, consumer, key);
    let span = tracing::Span::current();
    span.record("scope", identity.scope.as_str());
    span.record("consumer", identity.consumer.as_str());
    span.record("key", identity.key.as_str());
    to_the_end(claim_and_run(settings, inner, parts, body, identity)).await
}

/// Claims the request's key, then runs the handler and stores its answer, or answers as
/// the key's holder left it.
async fn claim_and_run<S>(
    settings: Arc<Settings>,
    mut inner: S,
    mut parts: Parts,
    body: Bytes,
    identity: Identity,
) -> Response
where
    S: tower_service::Service<Request, Response = Response, Error = Infallible>,
{
    let described = describe(&parts, &body);
    let fingerprint = Fingerprint::of(&described);
    let taken = match &settings.store {
        Store::Leases(store) => {
            match store
                .claim_lease(&identity, &fingerprint, settings.lease_for)
                .await
            {
                Ok(LeaseClaim::Acquired(lease)) => {
                    let response =
                        run(&mut inner, Request::from_parts(parts, Body::from(body))).await;
                    return complete(&settings, store.as_ref(), &lease, response).await;
                }
                Ok(taken) => taken,
                Err(error) => return store_unavailable(&error),
            }
        }
        Store::Transactional(store) => {
            match store
                .begin(Some((&identity, &described)), &mut parts.extensions)
                .await
            {
                Ok(Begun::Open(open)) => {
                    let response =
                        run(&mut inner, Request::from_parts(parts, Body::from(body))).await;
                    return commit(&settings, open, Some(&identity), response).await;
                }
                Ok(Begun::Taken) => match store.lookup(&identity).await {
                    Ok(stored) => as_taken(stored, fingerprint),
                    Err(error) => return store_unavailable(&error),
                },
                Err(error) => return store_unavailable(&error),
            }
        }
    };
    answer_taken(&settings, &identity, taken)
}

/// The answer to a request whose key another request holds or completed.
fn answer_taken(settings: &Settings, identity: &Identity, taken: LeaseClaim) -> Response {
    match taken {
        LeaseClaim::Done {
            result: Some(stored),
        } => match StoredResponse::decode(&stored) {
            Some(stored) => {
                count("replayed");
                stored.replay(&settings.stored_headers)
            }
            None => {
                tracing::error!(key = %identity.key, "a stored response could not be read");
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "stored response unreadable",
                    "the response stored for this key could not be read",
                )
            }
        },
        LeaseClaim::Done { result: None } => {
            count("in_progress");
            problem(
                StatusCode::CONFLICT,
                "key already used",
                "this key was used for work that stored no response",
            )
        }
        LeaseClaim::InProgress { remaining } => {
            count("in_progress");
            let mut response = problem(
                StatusCode::CONFLICT,
                "request in progress",
                "a request with this key is still running; retry later",
            );
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(whole_seconds(remaining)));
            response
        }
        LeaseClaim::KeyReused { .. } => {
            count("key_reused");
            problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Idempotency-Key reused",
                "this key was used for another request: another path, query string, content type or body",
            )
        }
        LeaseClaim::Acquired(_) => unreachable_without_a_key(),
    }
}

/// A transactional claim that found the key taken, as a lease claim would have seen it.
fn as_taken(stored: Option<StoredKey>, received: Fingerprint) -> LeaseClaim {
    match stored {
        // Purged between the claim and this read: the retry will claim it afresh.
        None => LeaseClaim::InProgress {
            remaining: Duration::ZERO,
        },
        Some(stored) if stored.fingerprint != received => LeaseClaim::KeyReused {
            stored: stored.fingerprint,
            received,
        },
        Some(StoredKey {
            lease_remaining: Some(remaining),
            ..
        }) => LeaseClaim::InProgress { remaining },
        Some(stored) => LeaseClaim::Done {
            result: stored.result,
        },
    }
}

/// An answer for a state the code above never produces, as a problem rather than a panic.
fn unreachable_without_a_key() -> Response {
    tracing::error!("idempotency layer reached a state it should not");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal error",
        "the idempotency layer reached an unexpected state",
    )
}

fn store_unavailable(error: &justonce_core::Error) -> Response {
    count("store_unavailable");
    tracing::warn!(%error, "idempotency key store unavailable");
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "store unavailable",
        "the idempotency key store cannot be reached; retry later",
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

async fn run<S>(inner: &mut S, request: Request) -> Response
where
    S: tower_service::Service<Request, Response = Response, Error = Infallible>,
{
    match inner.call(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// Runs a keyed request from its claim to its stored answer as a task of its own: a client
/// that disconnects drops this future but not the task, so the work runs to the end and the
/// retry finds its stored response, instead of a key held until its lease runs out.
async fn to_the_end(work: impl Future<Output = Response> + Send + 'static) -> Response {
    match tokio::spawn(work.in_current_span()).await {
        Ok(response) => response,
        // As if the handler had panicked inline: whatever catches panics around this layer
        // sees it, and the key stays held until its lease runs out.
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(_) => {
            let mut response = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting down",
                "the server stopped while the request ran; retry later",
            );
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
            response
        }
    }
}

/// What a key's fingerprint covers: the method, the path as sent (before any nesting
/// stripped a prefix) and the query string, the `Content-Type`, and the SHA-256 of the
/// body. Each field is length-prefixed, so that no two requests read alike.
fn describe(parts: &Parts, body: &[u8]) -> Vec<u8> {
    let uri = parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    let content_type: Vec<&[u8]> = parts
        .headers
        .get_all(CONTENT_TYPE)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    let content_type = content_type.join(&b", "[..]);
    let fields: [&[u8]; 4] = [
        parts.method.as_str().as_bytes(),
        uri.path().as_bytes(),
        uri.query().unwrap_or_default().as_bytes(),
        &content_type,
    ];
    let mut described = Vec::with_capacity(128);
    for field in fields {
        described.extend_from_slice(&(field.len() as u64).to_be_bytes());
        described.extend_from_slice(field);
    }
    described.extend_from_slice(&Sha256::digest(body));
    described
}

/// Reads the response's body when it fits the stored limit, and returns what to store
/// with the response to send; an `Err` is the answer when the body failed.
async fn buffer(
    settings: &Settings,
    response: Response,
) -> Result<(StoredResponse, Response), axum::Error> {
    let (parts, body) = response.into_parts();
    let fits = axum::body::HttpBody::size_hint(&body)
        .upper()
        .is_some_and(|upper| upper <= settings.stored_body_limit as u64);
    if !fits {
        let stored = StoredResponse::of(settings, &parts, None);
        return Ok((stored, Response::from_parts(parts, body)));
    }
    let bytes = axum::body::to_bytes(body, settings.stored_body_limit).await?;
    let stored = StoredResponse::of(settings, &parts, Some(bytes.to_vec()));
    Ok((stored, Response::from_parts(parts, Body::from(bytes))))
}

fn body_failed(error: &axum::Error) -> Response {
    tracing::warn!(%error, "the handler's response body failed");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "response failed",
        "the response body could not be produced",
    )
}

/// Stores the handler's response and completes the lease, or releases it after a 5xx.
async fn complete(
    settings: &Settings,
    store: &dyn Leases,
    lease: &Lease,
    response: Response,
) -> Response {
    let key = &lease.identity.key;
    if response.status().is_server_error() {
        count("released");
        if let Err(error) = store.release(lease).await {
            tracing::warn!(%error, %key, "could not release the key after a 5xx");
        }
        return response;
    }
    let (stored, response) = match buffer(settings, response).await {
        Ok(buffered) => buffered,
        Err(error) => {
            if let Err(error) = store.release(lease).await {
                tracing::warn!(%error, %key, "could not release the key");
            }
            return body_failed(&error);
        }
    };
    match store.complete(lease, &stored.encode()).await {
        Ok(()) => count("first"),
        Err(error) => {
            // The work is done either way; the caller gets its answer, and a retry finds
            // the other holder's result or runs again once this lease has run out.
            count("not_stored");
            tracing::warn!(%error, %key, "the response could not be stored");
        }
    }
    response
}

/// Commits the handler's transaction with its stored response, or rolls it back after a
/// 5xx. A commit that fails is answered `503`: the handler's writes did not happen, or
/// the retry will find its stored response.
async fn commit(
    settings: &Settings,
    open: Box<dyn Open>,
    identity: Option<&Identity>,
    response: Response,
) -> Response {
    if response.status().is_server_error() {
        count("released");
        if let Err(error) = open.rollback().await {
            tracing::warn!(%error, "could not roll back after a 5xx");
        }
        return response;
    }
    let (stored, response) = match buffer(settings, response).await {
        Ok(buffered) => buffered,
        Err(error) => {
            if let Err(error) = open.rollback().await {
                tracing::warn!(%error, "could not roll back");
            }
            return body_failed(&error);
        }
    };
    let stored = identity.map(|identity| (identity.clone(), stored.encode()));
    match open.commit(stored).await {
        Ok(()) => {
            count("first");
            response
        }
        Err(error) => store_unavailable(&error),
    }
}

/// Where a layer keeps its keys.
#[derive(Clone)]
enum Store {
    Leases(Arc<dyn Leases>),
    Transactional(Arc<dyn Transactional>),
}

/// A store that claims keys inside the transaction the handler writes in.
trait Transactional: Send + Sync {
    /// Begins a transaction and claims the key in it, if there is one, with the request's
    /// description as the payload it fingerprints. When the key is this transaction's (or
    /// there is none), the transaction goes into `extensions` for the handler's [`Tx`];
    /// when it is taken, the transaction is rolled back.
    fn begin<'a>(
        &'a self,
        key: Option<(&'a Identity, &'a [u8])>,
        extensions: &'a mut Extensions,
    ) -> LeaseFuture<'a, Begun>;

    fn lookup<'a>(&'a self, identity: &'a Identity) -> LeaseFuture<'a, Option<StoredKey>>;
}

enum Begun {
    Open(Box<dyn Open>),
    Taken,
}

/// A handler's transaction, to finish once the handler has answered.
trait Open: Send {
    /// Stores the response with the key, if there is one, and commits.
    fn commit(self: Box<Self>, stored: Option<(Identity, Vec<u8>)>) -> LeaseFuture<'static, ()>;
    fn rollback(self: Box<Self>) -> LeaseFuture<'static, ()>;
}

type Slot<DB> = Arc<tokio::sync::Mutex<Option<sqlx::Transaction<'static, DB>>>>;

impl<DB: Backend> Transactional for Inbox<DB> {
    fn begin<'a>(
        &'a self,
        key: Option<(&'a Identity, &'a [u8])>,
        extensions: &'a mut Extensions,
    ) -> LeaseFuture<'a, Begun> {
        Box::pin(async move {
            let mut tx = Inbox::begin(self).await?;
            if let Some((identity, body)) = key {
                let claimer = self
                    .with_scope(identity.scope.clone())
                    .with_consumer(identity.consumer.clone());
                if claimer.claim(&mut tx, &identity.key, body).await? != Claim::First {
                    self.roll_back(tx).await?;
                    return Ok(Begun::Taken);
                }
            }
            let slot: Slot<DB> = Arc::new(tokio::sync::Mutex::new(Some(tx)));
            extensions.insert(Tx(Arc::clone(&slot)));
            Ok(Begun::Open(Box::new(OpenTx {
                inbox: self.clone(),
                slot,
            })))
        })
    }

    fn lookup<'a>(&'a self, identity: &'a Identity) -> LeaseFuture<'a, Option<StoredKey>> {
        Box::pin(Inbox::lookup(self, identity))
    }
}

struct OpenTx<DB: Backend> {
    inbox: Inbox<DB>,
    slot: Slot<DB>,
}

impl<DB: Backend> OpenTx<DB> {
    async fn take(&self) -> Result<sqlx::Transaction<'static, DB>, justonce_core::Error> {
        self.slot.lock().await.take().ok_or_else(|| {
            justonce_core::Error::Config("the handler's transaction was finished twice".into())
        })
    }
}

impl<DB: Backend> Open for OpenTx<DB> {
    fn commit(self: Box<Self>, stored: Option<(Identity, Vec<u8>)>) -> LeaseFuture<'static, ()> {
        Box::pin(async move {
            let tx = self.take().await?;
            let stored = stored.as_ref();
            let stored = stored.map(|(identity, result)| (identity, result.as_slice()));
            self.inbox.commit_with_result(tx, stored).await
        })
    }

    fn rollback(self: Box<Self>) -> LeaseFuture<'static, ()> {
        Box::pin(async move { self.inbox.roll_back(self.take().await?).await })
    }
}

/// The transaction a route under [`IdempotencyLayer::transactional`] writes in, as an
/// axum extractor: its writes commit together with the key and the stored response.
///
/// ```no_run
/// use justonce_http::server::Tx;
/// use justonce_sql::sqlx::{self, Sqlite};
///
/// async fn create_payment(tx: Tx<Sqlite>) -> Result<&'static str, String> {
///     let mut tx = tx.lock().await.map_err(|e| e.to_string())?;
///     sqlx::query("INSERT INTO payments (amount) VALUES (1250)")
///         .execute(&mut **tx)
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok("created")
/// }
/// ```
pub struct Tx<DB: Backend>(Slot<DB>);

impl<DB: Backend> Clone for Tx<DB> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<DB: Backend> Tx<DB> {
    /// The open transaction. [`TxFinished`] once the layer has committed or rolled it back,
    /// as it does when the handler has answered.
    pub async fn lock(&self) -> Result<TxGuard<DB>, TxFinished> {
        let guard = Arc::clone(&self.0).lock_owned().await;
        tokio::sync::OwnedMutexGuard::try_map(guard, Option::as_mut).map_err(|_| TxFinished)
    }
}

/// The open transaction, held by one user at a time; it derefs to
/// [`sqlx::Transaction`].
pub type TxGuard<DB> = tokio::sync::OwnedMappedMutexGuard<
    Option<sqlx::Transaction<'static, DB>>,
    sqlx::Transaction<'static, DB>,
>;

/// The handler's transaction was used after the handler answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxFinished;

impl std::fmt::Display for TxFinished {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request's transaction is already committed or rolled back")
    }
}

impl std::error::Error for TxFinished {}

impl<DB: Backend, S: Send + Sync> axum::extract::FromRequestParts<S> for Tx<DB> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
        parts.extensions.get::<Tx<DB>>().cloned().ok_or_else(|| {
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "no transaction",
                "this route is not under IdempotencyLayer::transactional for this database",
            )
        })
    }
}

/// The key from the header, bare or as the draft's quoted string. Spaces and tabs around
/// the value are not part of it (RFC 9110, section 5.5), as hyper already strips them from
/// what it reads off a socket: `" k1 "` is `k1`, and a blank value is an empty key.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<Key>, String> {
    let mut values = headers.get_all(&IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err("the request has more than one Idempotency-Key header".to_owned());
    }
    let text = value
        .to_str()
        .map_err(|_| "the Idempotency-Key is not visible ASCII".to_owned())?
        .trim_matches([' ', '\t']);
    let bare = match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(quoted) => unescape(quoted)?,
        None => text.to_owned(),
    };
    // Quoted spaces are as blank as the bare ones trimmed away above: taken as a key, every
    // blank key would share one stored response.
    if !bare.is_empty() && bare.trim().is_empty() {
        return Err("the Idempotency-Key is blank".to_owned());
    }
    Key::new(bare)
        .map(Some)
        .map_err(|error| format!("the Idempotency-Key is unusable: {error}"))
}

/// The content of a structured-field string: `\"` and `\\` are its only escapes.
fn unescape(quoted: &str) -> Result<String, String> {
    let mut text = String::with_capacity(quoted.len());
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(escaped @ ('"' | '\\')) => text.push(escaped),
                _ => return Err("the quoted Idempotency-Key has a bad escape".to_owned()),
            },
            '"' => return Err("the quoted Idempotency-Key has an unescaped quote".to_owned()),
            c => text.push(c),
        }
    }
    Ok(text)
}

fn principal(settings: &Settings, parts: &Parts) -> Result<Scope, String> {
    let Some(principal) = &settings.principal else {
        return Ok(Scope::none());
    };
    let name = principal(parts).ok_or("the request names no principal (tenant or user)")?;
    Scope::new(name).map_err(|error| format!("the principal is unusable: {error}"))
}

/// The route template when axum matched one, else the path.
fn route(parts: &Parts) -> &str {
    parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path(), MatchedPath::as_str)
}

fn whole_seconds(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

fn count(outcome: &'static str) {
    metrics::counter!("justonce_idempotency_requests_total", "outcome" => outcome).increment(1);
}

/// A response as stored with its key: the status, the chosen headers, and the body when it
/// fitted.
#[derive(Debug, PartialEq, Eq)]
struct StoredResponse {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Option<Vec<u8>>,
}

/// The first byte of a stored response: its encoding's version.
const ENCODING: u8 = 1;

impl StoredResponse {
    fn of(settings: &Settings, parts: &axum::http::response::Parts, body: Option<Vec<u8>>) -> Self {
        let headers = settings
            .stored_headers
            .iter()
            .flat_map(|name| {
                parts
                    .headers
                    .get_all(name)
                    .iter()
                    .map(|value| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            })
            .collect();
        Self {
            status: parts.status.as_u16(),
            headers,
            body,
        }
    }

    /// Version, status, header count, each header as length-prefixed name and value, then
    /// whether the body was stored, and the body.
    fn encode(&self) -> Vec<u8> {
        let mut out = vec![ENCODING];
        out.extend_from_slice(&self.status.to_be_bytes());
        out.extend_from_slice(&(self.headers.len() as u16).to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value);
        }
        match &self.body {
            Some(body) => {
                out.push(1);
                out.extend_from_slice(body);
            }
            None => out.push(0),
        }
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let mut input = bytes;
        let mut take = |n: usize| -> Option<&[u8]> {
            let (head, rest) = input.split_at_checked(n)?;
            input = rest;
            Some(head)
        };
        if take(1)? != [ENCODING] {
            return None;
        }
        let status = u16::from_be_bytes(take(2)?.try_into().ok()?);
        let count = u16::from_be_bytes(take(2)?.try_into().ok()?);
        let mut headers = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let name_len = u16::from_be_bytes(take(2)?.try_into().ok()?);
            let name = String::from_utf8(take(usize::from(name_len))?.to_vec()).ok()?;
            let value_len = u32::from_be_bytes(take(4)?.try_into().ok()?);
            let value = take(usize::try_from(value_len).ok()?)?.to_vec();
            headers.push((name, value));
        }
        let body = match take(1)? {
            [1] => Some(input.to_vec()),
            [0] => None,
            _ => return None,
        };
        Some(Self {
            status,
            headers,
            body,
        })
    }

    /// The stored response again, with those of its headers still in `allowed`: a row
    /// stored under an older list replays no header the layer no longer stores.
    fn replay(self, allowed: &[HeaderName]) -> Response {
        let mut response = Response::new(Body::from(self.body.unwrap_or_default()));
        *response.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(&value),
            ) && allowed.contains(&name)
            {
                headers.append(name, value);
            }
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_response_reads_back_as_written() {
        let stored = StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".to_owned(), b"application/json".to_vec()),
                ("location".to_owned(), b"/payments/1".to_vec()),
            ],
            body: Some(b"{\"id\":1}".to_vec()),
        };
        assert_eq!(StoredResponse::decode(&stored.encode()), Some(stored));
        let without_body = StoredResponse {
            status: 204,
            headers: vec![],
            body: None,
        };
        assert_eq!(
            StoredResponse::decode(&without_body.encode()),
            Some(without_body)
        );
    }

    #[test]
    fn truncated_or_foreign_bytes_are_not_a_response() {
        let encoded = StoredResponse {
            status: 200,
            headers: vec![("content-type".to_owned(), b"text/plain".to_vec())],
            body: Some(b"ok".to_vec()),
        }
        .encode();
        for cut in 0..encoded.len() - 3 {
            assert_eq!(
                StoredResponse::decode(&encoded[..cut]),
                None,
                "cut at {cut}"
            );
        }
        assert_eq!(StoredResponse::decode(b"\x02anything"), None);
    }

    #[test]
    fn keys_are_taken_bare_or_quoted_and_checked() {
        let key = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(value).unwrap());
            idempotency_key(&headers)
        };
        assert_eq!(key("abc").unwrap().unwrap().as_str(), "abc");
        assert_eq!(key("\"abc\"").unwrap().unwrap().as_str(), "abc");
        assert_eq!(key(r#""a\"b""#).unwrap().unwrap().as_str(), "a\"b");
        assert!(key("\"\"").is_err(), "empty");
        assert!(key("").is_err(), "empty");
        assert!(key(&"k".repeat(256)).is_err(), "too long");
        assert!(key(&"k".repeat(255)).is_ok());
        assert!(key("a\tb").is_err(), "control character");
        assert_eq!(key(" \tabc\t ").unwrap().unwrap().as_str(), "abc");
        assert!(key("   ").is_err(), "blank");
        // Found by the `idempotency_key` fuzz target: a quoted blank key was used.
        assert_eq!(key("\" \"").unwrap_err(), "the Idempotency-Key is blank");
        assert!(key("\"   \"").is_err(), "quoted blank");
        assert_eq!(
            key("\" a \"").unwrap().unwrap().as_str(),
            " a ",
            "quoted spaces are kept"
        );
        assert!(key(r#""a\nb""#).is_err(), "bad escape");
        assert_eq!(idempotency_key(&HeaderMap::new()), Ok(None));
    }

    #[test]
    fn long_routes_get_a_hashed_consumer_name() {
        let short = IdempotencyLayer::consumer_for(&Method::POST, "/payments");
        assert_eq!(short.as_str(), "POST /payments");
        let long_route = format!("/{}", "segment/".repeat(40));
        let long = IdempotencyLayer::consumer_for(&Method::POST, &long_route);
        assert!(long.as_str().starts_with("POST #") && long.as_str().len() <= Consumer::MAX_LEN);
    }
}
