//! A deliberately broken webhook server, for the fault harness's own test of `serve-kill`:
//! it answers `200 accepted` at once and stores the event a moment later, as a server
//! that queues its work in memory does, so that a kill in between loses an event its sender
//! was told was taken. Otherwise it is what `justonce serve` runs for one source: the
//! library's receiver (`demo`, hmac-sha256 in `X-Signature` with the secret in
//! `HARNESS_SECRET`, the id at `/id`) and the relay forwarding each event to the target.
//!
//! `answer-first-server <database-url> <listen-address> <target-url>`
//!
//! SIGTERM stops it.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use justonce_http::HttpDestination;
use justonce_http::receiver::{IdLocation, Scheme, Source, health_router, router};
use justonce_sql::{Consumer, Inbox, RelayOptions};
use justonce_tests::TestBackend;
use std::process::ExitCode;
use std::time::Duration;
use tower::ServiceExt;

/// How long an answered event waits in memory before it is stored.
const QUEUED: Duration = Duration::from_millis(50);

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, listen, target] = args.as_slice() else {
        eprintln!("usage: answer-first-server <database-url> <listen-address> <target-url>");
        return ExitCode::from(2);
    };
    let result = justonce_tests::with_backend!(url, DB => serve::<DB>(url, listen, target).await);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("answer-first-server: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn serve<DB: TestBackend>(
    url: &str,
    listen: &str,
    target: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let inbox = Inbox::<DB>::connect(url, Consumer::new("demo")?).await?;
    inbox.migrate().await?;
    let secret = std::env::var("HARNESS_SECRET")?;
    let scheme = Scheme::HmacSha256 {
        secrets: vec![secret.into_bytes()],
        header: "x-signature".to_owned(),
    };
    let source = Source::new("demo", scheme, IdLocation::Json("/id".to_owned()))?;
    let receiver = router(&inbox, vec![source], 1 << 20);
    let answer_first = move |mut request: Request<Body>| {
        let receiver = receiver.clone();
        // The receiver's router reads its own path parameters, not this route's.
        request.extensions_mut().clear();
        async move {
            tokio::spawn(async move {
                tokio::time::sleep(QUEUED).await;
                let _stored = receiver.oneshot(request).await;
            });
            (StatusCode::OK, r#"{"status":"accepted"}"#).into_response()
        }
    };
    let app = health_router(&inbox).route("/webhooks/{source}", axum::routing::post(answer_first));
    let relay = inbox
        .outbox()
        .relay()
        .options(RelayOptions::default().lease(Duration::from_secs(2)))
        .destination("demo", HttpDestination::new(target)?);
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut stopping = stopping.clone();
        async move {
            let _ = stopping.wait_for(|stop| *stop).await;
        }
    };
    let signal = async move {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        terminate.recv().await;
        let _ = stop.send(true);
        Ok::<_, std::io::Error>(())
    };
    let serving = axum::serve(listener, app).with_graceful_shutdown(stopped());
    let (served, relayed, signalled) = tokio::join!(serving, relay.run(stopped()), signal);
    served?;
    relayed?;
    signalled?;
    Ok(())
}
