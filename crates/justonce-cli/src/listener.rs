//! The service's listeners: hyper's HTTP/1 server with a header-read timeout, a cap on open
//! connections and one on requests in flight, each refused over its cap with a `503`, never
//! left to hang; stopping drains the connections in flight.

use crate::config::Limits;
use axum::Router;
use axum::body::HttpBody;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::http::header::RETRY_AFTER;
use axum::middleware::Next;
use axum::response::Response;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tower::ServiceBuilder;
use tower_http::timeout::TimeoutLayer;

/// Serves `app` on `listener` within `limits` until `stopped` resolves, then waits for the
/// requests in flight (the caller bounds that wait). `max_connections` is the cap of this
/// listener, which may be below `limits.max_connections` when open files are scarce. With
/// `access_log`, each answer is logged, those the caps and timeouts give included.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    max_connections: usize,
    access_log: bool,
    stopped: impl Future<Output = ()>,
) {
    let service = ServiceBuilder::new()
        // The access log takes axum's body, as the router does.
        .map_request(|request: hyper::Request<hyper::body::Incoming>| {
            request.map(axum::body::Body::new)
        })
        .layer(axum::middleware::from_fn_with_state(access_log, log_access))
        .layer(HandleErrorLayer::new(too_many_requests))
        .load_shed()
        .concurrency_limit(limits.max_requests)
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            limits.request_timeout,
        ))
        .service(app);
    let mut http = http1::Builder::new();
    // hyper starts the header timer when a connection opens and again when it turns idle
    // after an answer: one timer bounds slow headers and idle keep-alive connections.
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let connections = Arc::new(Semaphore::new(max_connections));
    let refusals = Arc::new(Semaphore::new(REFUSALS_AT_ONCE));
    let graceful = GracefulShutdown::new();
    let mut stopped = std::pin::pin!(stopped);
    loop {
        let stream = tokio::select! {
            () = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    accept_failed(&error).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let Ok(open) = Arc::clone(&connections).try_acquire_owned() else {
            metrics::counter!("justonce_connections_refused_total").increment(1);
            // Past the refusals' own cap the connection is closed unanswered: answering
            // must not cost more open files than the connections it turns away.
            if let Ok(refusing) = Arc::clone(&refusals).try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream).await;
                    drop(refusing);
                });
            }
            continue;
        };
        let connection = http.serve_connection(
            TokioIo::new(stream),
            TowerToHyperService::new(service.clone()),
        );
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A connection's errors (a reset, a header timeout) are the client's.
            let _ = connection.await;
            drop(open);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Describes the metrics of this module, for their `# HELP` lines.
pub fn describe_metrics() {
    metrics::describe_counter!(
        "justonce_connections_refused_total",
        "Connections answered 503 and closed because a listener held its most"
    );
    metrics::describe_counter!(
        "justonce_accept_errors_total",
        "Connections a listener failed to accept, most often for want of open files"
    );
}

/// The access log: one line per request with its method, path, status, the bytes of the
/// answer's body and the time it took. Never a query string (it may carry a token), a
/// header or a body.
async fn log_access(State(enabled): State<bool>, request: Request, next: Next) -> Response {
    if !enabled {
        return next.run(request).await;
    }
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let size = response.body().size_hint();
    tracing::info!(
        target: "justonce::access",
        %method,
        path,
        status = response.status().as_u16(),
        bytes = size.exact().unwrap_or(size.lower()),
        millis = started.elapsed().as_secs_f64() * 1_000.0,
        "request"
    );
    response
}

/// Connections being refused at once, each for at most `REFUSAL_TIME`.
const REFUSALS_AT_ONCE: usize = 64;
const REFUSAL_TIME: Duration = Duration::from_secs(1);

/// Answers a connection over the cap with a `503` once its request's head has arrived (a
/// client takes an answer sent before its request for a broken connection), then reads
/// what else it sent for a moment before closing: closing on unread bytes would reset the
/// connection, and the client could lose the answer.
async fn refuse(mut stream: TcpStream) {
    let body = br#"{"type":"about:blank","title":"overloaded","status":503,"detail":"too many connections are open; try again shortly"}"#;
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_TIME, async {
        let mut received = Vec::new();
        let mut buffer = [0u8; 4096];
        while !received.windows(4).any(|w| w == b"\r\n\r\n") && received.len() < 16 << 10 {
            let read = stream.read(&mut buffer).await?;
            if read == 0 {
                return Ok(());
            }
            received.extend_from_slice(&buffer[..read]);
        }
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body).await?;
        stream.shutdown().await?;
        while stream.read(&mut buffer).await? > 0 {}
        std::io::Result::Ok(())
    })
    .await;
}

/// The answer to a request over the cap of requests in flight.
async fn too_many_requests(_: tower::BoxError) -> Response {
    let mut response = justonce_http::problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded",
        "too many requests are in flight; try again shortly",
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
    response
}

/// An accept that failed: out of open files, most often. The connections in flight close
/// in time and free some; until then, wait a little rather than spin.
async fn accept_failed(error: &std::io::Error) {
    metrics::counter!("justonce_accept_errors_total").increment(1);
    tracing::warn!(%error, "accepting a connection failed: trying again shortly");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Open files kept back for the database pool, the brokers, the relay's connections and the
/// process's own files.
const RESERVED_FILES: u64 = 256;

/// Raises the soft limit of open files to the hard limit, and returns each listener's cap on
/// connections (public, admin) within what is left after `RESERVED_FILES` and both
/// listeners' refusals.
pub fn fit_open_files(limits: &Limits) -> (usize, usize) {
    let open_files = raise_open_files();
    let refusing = 2 * REFUSALS_AT_ONCE as u64;
    let budget = open_files.saturating_sub(RESERVED_FILES + refusing).max(32) as usize;
    let admin = limits
        .max_connections
        .min(ADMIN_CONNECTIONS)
        .min(budget / 4);
    let public = limits.max_connections.min(budget - admin);
    if public < limits.max_connections {
        tracing::warn!(
            open_files,
            max_connections = limits.max_connections,
            public,
            "open files are too few for server.max_connections: the public listener \
             holds fewer"
        );
    }
    tracing::info!(open_files, public, admin, "connections each listener holds");
    (public, admin)
}

/// The admin listener's cap: operators and a scraper, not the world.
const ADMIN_CONNECTIONS: usize = 64;

/// The soft limit of open files after raising it to the hard limit.
fn raise_open_files() -> u64 {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    // An unlimited hard limit cannot be the soft one: Linux caps files at `nr_open`.
    let hard = limit.maximum.unwrap_or(1 << 20);
    if limit.current.is_some_and(|soft| soft < hard) {
        limit.current = Some(hard);
        if let Err(error) = setrlimit(Resource::Nofile, limit) {
            tracing::warn!(%error, "the soft limit of open files could not be raised");
        }
    }
    getrlimit(Resource::Nofile).current.unwrap_or(hard)
}
