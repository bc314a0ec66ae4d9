//! An HTTP receiver on loopback that records every request with its Idempotency-Key and
//! answers from a script.

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One request as the sink received it.
#[derive(Debug, Clone)]
pub struct Received {
    /// The `Idempotency-Key` header, if there was one.
    pub key: Option<String>,
    /// The request body.
    pub body: Vec<u8>,
    /// Every header, lowercased name to value.
    pub headers: HashMap<String, String>,
    /// When the request arrived.
    pub at: Instant,
}

/// What the sink answers: a status, extra headers, a body, and an optional delay first.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// Headers to add.
    pub headers: Vec<(&'static str, String)>,
    /// The body: any bytes, text or not.
    pub body: Vec<u8>,
    /// How long to wait before answering.
    pub delay: Duration,
}

impl Answer {
    /// A plain answer with this status.
    pub fn status(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Vec::new(),
            delay: Duration::ZERO,
        }
    }
}

/// Chooses the answer to the `attempt`th request (from 1) carrying `key`.
pub type Script = Arc<dyn Fn(&str, usize) -> Answer + Send + Sync>;

/// A running sink.
#[derive(Clone)]
pub struct Sink {
    /// Where it listens.
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Sink {
    /// Starts a sink on a free loopback port that answers 200 to everything.
    pub async fn start() -> Self {
        Self::scripted(Arc::new(|_, _| Answer::status(200))).await
    }

    /// Starts a sink on a free loopback port that answers from `script`.
    pub async fn scripted(script: Script) -> Self {
        let received = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&received);
        let app = Router::new().route(
            "/hook",
            post(move |headers: HeaderMap, body: Bytes| {
                let (log, script) = (Arc::clone(&log), Arc::clone(&script));
                async move { record(&log, &script, headers, body).await }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { addr, received }
    }

    /// The URL to post to.
    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    /// How many requests arrived so far.
    pub fn requests(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    /// Every request so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

async fn record(
    log: &Mutex<Vec<Received>>,
    script: &Script,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let headers: HashMap<String, String> = headers
        .iter()
        .map(|(name, value)| {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            (name.as_str().to_owned(), value)
        })
        .collect();
    let key = headers.get("idempotency-key").cloned();
    let attempt = {
        let mut log = log.lock().unwrap();
        log.push(Received {
            key: key.clone(),
            body: body.to_vec(),
            headers,
            at: Instant::now(),
        });
        log.iter().filter(|request| request.key == key).count()
    };
    let answer = script(key.as_deref().unwrap_or(""), attempt);
    tokio::time::sleep(answer.delay).await;
    let mut response = (StatusCode::from_u16(answer.status).unwrap(), answer.body).into_response();
    for (name, value) in answer.headers {
        response.headers_mut().insert(name, value.parse().unwrap());
    }
    response
}
