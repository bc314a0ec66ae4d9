//! `justonce bench`: the benchmark, with its receiver behind the service's own listener.

use crate::config::Settings;
use crate::listener;
use anyhow::Result;

/// Measures the database `--database` names, the configured one by default.
pub async fn run(settings: &Settings, args: justonce_bench::Args) -> Result<()> {
    let url = args.database().unwrap_or(&settings.database).to_owned();
    justonce_bench::run(&url, &args.try_into()?, serve_receiver).await
}

/// The bench's receiver behind the service's own listener and its default caps.
fn serve_receiver(
    listener: tokio::net::TcpListener,
    app: axum::Router,
) -> futures_util::future::BoxFuture<'static, ()> {
    Box::pin(async move {
        let limits = crate::config::Limits::default();
        let stopped = std::future::pending();
        listener::serve(
            listener,
            app,
            limits,
            limits.max_connections,
            false,
            stopped,
        )
        .await;
    })
}
